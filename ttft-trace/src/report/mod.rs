//! `ttft-trace report`: reads the JSONL the tracer wrote and prints what a
//! load test's reader wants, in the style of `vllm bench serve` (`table`),
//! optionally beside a second run, and writes one self-contained HTML page
//! with plots (`html`). No root, no kernel: only the file.

mod html;
mod read;
mod stats;
mod svg;
mod table;
#[cfg(test)]
pub(crate) mod tests;

use std::{
    fs::File,
    io::BufReader,
    path::{Path, PathBuf},
};

pub use read::{LINE_CAP, Lines};

pub use crate::jsonl_schema::Request;
pub use stats::{Builder, Run, Stats};

#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// The tracer's JSONL file (`--jsonl`).
    pub file: PathBuf,
    /// A second run to compare with: shown as B beside FILE as A, with B − A.
    #[arg(long, value_name = "OTHER.jsonl")]
    pub compare: Option<PathBuf>,
    /// Also write one self-contained HTML page with plots here.
    #[arg(long, value_name = "OUT.html")]
    pub html: Option<PathBuf>,
    /// The TTFT objective, in milliseconds: the share within it is reported
    /// and marked on the plots.
    #[arg(long, default_value_t = 350.0, value_name = "MS")]
    pub slo_ms: f64,
    /// How many of the slowest requests to list and draw.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub top: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the report to stdout: {0}")]
    Stdout(std::io::Error),
    #[error("--slo-ms must be a positive number of milliseconds, not {0}")]
    Objective(f64),
}

/// Reads one JSONL file into a run.
pub fn load(path: &Path, slo_ns: u64, top: usize) -> Result<Run, ReportError> {
    let read_err = |source| ReportError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(read_err)?;
    let mut builder = Builder::new(top);
    let lines = Lines::read(BufReader::new(file), |r| builder.add(r)).map_err(read_err)?;
    Ok(builder.finish(path.display().to_string(), lines, slo_ns))
}

/// The whole command: returns the text to print; writes the page when asked.
pub fn run(args: &ReportArgs) -> Result<String, ReportError> {
    if !(args.slo_ms > 0.0 && args.slo_ms.is_finite()) {
        return Err(ReportError::Objective(args.slo_ms));
    }
    let slo_ns = (args.slo_ms * 1e6).round() as u64;
    let a = load(&args.file, slo_ns, args.top)?;
    let (text, runs) = match &args.compare {
        Some(other) => {
            let b = load(other, slo_ns, args.top)?;
            let text = format!("{}\n{}", table::single(&a), table::compare(&a, &b));
            (text, vec![a, b])
        }
        None => (table::single(&a), vec![a]),
    };
    if let Some(out) = &args.html {
        let refs: Vec<&Run> = runs.iter().collect();
        std::fs::write(out, html::page(&refs, &text)).map_err(|source| ReportError::Write {
            path: out.clone(),
            source,
        })?;
    }
    Ok(text)
}

/// Runs the command and prints the report; a closed stdout (`| head`) ends
/// it quietly.
pub fn print(args: &ReportArgs) -> Result<(), ReportError> {
    use std::io::Write as _;
    let text = run(args)?;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(ReportError::Stdout(e)),
        _ => Ok(()),
    }
}
