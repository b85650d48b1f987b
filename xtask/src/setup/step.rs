//! One set-up step: a line that says what it is, how long it took and what
//! it did, with whatever its commands print sent to a log file of its own
//! (named on the line), whose tail is shown when the step fails.

use std::{
    fs::{self, File},
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

/// Lines of a failed step's log shown on the terminal.
const TAIL_LINES: usize = 30;

/// A set-up step.
pub struct Step {
    /// What it provides, as the line names it ("bpf-linker 0.13.0").
    pub what: &'static str,
    /// The log's name: `setup-<log>.log` under the cache's `logs/`.
    pub log: &'static str,
    /// Checks, and installs what is missing (idempotent).
    pub run: fn(&mut Log) -> Result<Outcome>,
}

/// What a step did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing to do: what it found ("present").
    Found(&'static str),
    /// It installed or changed something: what ("installed").
    Changed(String),
    /// Left as it is, and why (not root).
    Skipped(String),
}

impl Outcome {
    /// The end of the step's line, after "setup: WHAT ... ".
    fn describe(&self, secs: f64, log: &Path) -> String {
        match self {
            Outcome::Found(what) => format!("ok ({secs:.1} s, {what})"),
            Outcome::Changed(what) => format!("{what} ({secs:.1} s, log: {})", log.display()),
            Outcome::Skipped(why) => format!("skipped ({secs:.1} s, {why})"),
        }
    }
}

/// Runs `steps` in order, one line each; stops at the first that fails,
/// after printing the tail of its log.
pub fn run_all(steps: &[&Step], logs: &Path) -> Result<()> {
    for step in steps {
        let mut log = Log::new(logs.join(format!("setup-{}.log", step.log)));
        eprint!("setup: {} ... ", step.what);
        let started = Instant::now();
        let outcome = (step.run)(&mut log);
        let secs = started.elapsed().as_secs_f64();
        match outcome {
            Ok(outcome) => eprintln!("{}", outcome.describe(secs, &log.path)),
            Err(e) => {
                eprintln!("FAILED ({secs:.1} s, log: {})", log.path.display());
                for line in log.tail(TAIL_LINES) {
                    eprintln!("  | {line}");
                }
                return Err(e.context(format!(
                    "setup: {} failed (its log: {})",
                    step.what,
                    log.path.display()
                )));
            }
        }
    }
    Ok(())
}

/// A step's log: created (emptied) when the step first runs a command, so
/// that it holds the last run's output only.
pub struct Log {
    path: PathBuf,
    file: Option<File>,
}

impl Log {
    pub fn new(path: PathBuf) -> Self {
        Log { path, file: None }
    }

    fn file(&mut self) -> Result<&mut File> {
        if self.file.is_none() {
            if let Some(dir) = self.path.parent() {
                fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            let file = File::create(&self.path)
                .with_context(|| format!("creating {}", self.path.display()))?;
            self.file = Some(file);
        }
        self.file.as_mut().context("log file just opened")
    }

    /// A line of the step's own, for whoever reads the log.
    pub fn note(&mut self, line: &str) -> Result<()> {
        writeln!(self.file()?, "{line}")?;
        Ok(())
    }

    /// Runs `c` with its stdout and stderr in the log; fails on a non-zero exit.
    pub fn run(&mut self, c: &mut Command) -> Result<()> {
        self.note(&format!("$ {c:?}"))?;
        let file = self.file()?;
        let status = c
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file.try_clone()?)
            .status()
            .with_context(|| format!("running {c:?}"))?;
        if !status.success() {
            bail!("{c:?} failed: {status}");
        }
        Ok(())
    }

    /// Runs `c` and returns its stdout, with its stderr in the log; fails on
    /// a non-zero exit.
    pub fn output(&mut self, c: &mut Command) -> Result<String> {
        self.note(&format!("$ {c:?}"))?;
        let file = self.file()?;
        let out = c
            .stdin(Stdio::null())
            .stderr(file.try_clone()?)
            .output()
            .with_context(|| format!("running {c:?}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            if !stdout.is_empty() {
                self.note(stdout.trim_end())?;
            }
            bail!("{c:?} failed: {}", out.status);
        }
        Ok(stdout)
    }

    /// The last `n` lines written (none when the step wrote nothing).
    fn tail(&self, n: usize) -> Vec<String> {
        let text = fs::read_to_string(&self.path).unwrap_or_default();
        last_lines(&text, n)
    }
}

fn last_lines(text: &str, n: usize) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(n);
    lines[from..].iter().map(|l| l.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_says_what_happened_how_long_it_took_and_where_the_log_is() {
        let log = Path::new("/c/logs/setup-bpf-linker.log");
        assert_eq!(
            Outcome::Found("present").describe(0.04, log),
            "ok (0.0 s, present)"
        );
        assert_eq!(
            Outcome::Changed("installed".into()).describe(41.23, log),
            "installed (41.2 s, log: /c/logs/setup-bpf-linker.log)"
        );
        assert_eq!(
            Outcome::Skipped("not root".into()).describe(0.0, log),
            "skipped (0.0 s, not root)"
        );
    }

    #[test]
    fn the_tail_is_the_last_lines() {
        assert_eq!(last_lines("a\nb\nc\n", 2), ["b", "c"]);
        assert_eq!(last_lines("a\n", 30), ["a"]);
        assert!(last_lines("", 30).is_empty());
    }

    fn temp_log(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("xtask-step-{}-{name}.log", std::process::id()))
    }

    fn ok(_: &mut Log) -> Result<Outcome> {
        Ok(Outcome::Found("present"))
    }

    fn fails_after_output(log: &mut Log) -> Result<Outcome> {
        log.run(Command::new("sh").args(["-c", "seq 1 50; echo broken >&2; exit 3"]))?;
        Ok(Outcome::Changed("installed".into()))
    }

    #[test]
    fn a_failing_step_stops_the_run_and_names_its_log() {
        let logs = temp_log("dir");
        let steps = [
            &Step {
                what: "fine",
                log: "fine",
                run: ok,
            },
            &Step {
                what: "broken",
                log: "broken",
                run: fails_after_output,
            },
        ];
        let err = run_all(&steps, &logs).expect_err("the second step fails");
        let path = logs.join("setup-broken.log");
        assert!(format!("{err:#}").contains(&path.display().to_string()));
        let log = Log::new(path);
        let tail = log.tail(TAIL_LINES);
        assert_eq!(tail.len(), TAIL_LINES);
        assert_eq!(tail.last().map(String::as_str), Some("broken"));
        // The step that found everything present wrote no log.
        assert!(!logs.join("setup-fine.log").exists());
        fs::remove_dir_all(&logs).expect("removing the test's logs");
    }

    #[test]
    fn output_returns_stdout_and_logs_stderr() {
        let path = temp_log("output");
        let mut log = Log::new(path.clone());
        let out = log
            .output(Command::new("sh").args(["-c", "echo out; echo err >&2"]))
            .expect("sh runs");
        assert_eq!(out, "out\n");
        let text = fs::read_to_string(&path).expect("the log exists");
        assert!(text.contains("err") && !text.contains("out\n"), "{text}");
        fs::remove_file(&path).expect("removing the test's log");
    }
}
