//! ttft-trace command line. The flags and their merging with the settings
//! file are in `config`; the work is in the library modules.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use ttft_trace::{
    check,
    config::{
        self,
        flags::{AttachArgs, DaemonArgs},
    },
    report::{self, ReportArgs},
    session,
};

#[derive(Parser)]
#[command(
    version,
    about = "Why was the first token slow? eBPF tracing of GPU inference servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once per run; boxing the attach options buys nothing"
)]
enum Command {
    /// Trace one process and its descendants.
    Attach(AttachArgs),
    /// Preflight: can this host trace? Checks the kernel, tracefs, uprobes,
    /// every tracepoint, loads the probes for real, capabilities and NVML;
    /// exits non-zero when tracing cannot work.
    Check {
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// NVML library to try (default: libnvidia-ml.so.1 from the loader's path).
        #[arg(long, value_name = "PATH")]
        nvml_lib: Option<PathBuf>,
        /// Also check one process as a target: the CUDA libraries the
        /// tracer would probe in it, and the TLS libraries it maps.
        #[arg(long, value_name = "PID")]
        pid: Option<u32>,
        /// The daemon's settings file: its per-workload shares (`[quotas]`)
        /// are shown, and the workloads past one now.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Trace every process on the host that maps a CUDA library, as it
    /// appears; serve their metrics, labelled by workload.
    Daemon(DaemonArgs),
    /// Read a JSONL file the tracer wrote: TTFT and its breakdown
    /// (mean, median, P90, P99, P99.9), the share within the objective,
    /// the cause mix and the slowest requests; optionally beside another
    /// run, and as an HTML page with plots. Needs no privileges.
    Report(ReportArgs),
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp(None)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ttft-trace: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    // One thread: the session is one loop, and /metrics is served between
    // its turns (each a few milliseconds at most). A second worker only
    // added hand-offs to every timer wakeup (four futex calls a tick):
    // 20 % of the tracer's own CPU (see docs/causes.md and docs/costs.md, the sampling tick).
    let rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    match cli.command {
        Command::Attach(args) => {
            rt()?.block_on(session::attach(args.into_config()?))?;
        }
        Command::Daemon(args) => {
            rt()?.block_on(session::daemon(args.into_config()?))?;
        }
        // No runtime: the report only reads files.
        Command::Report(args) => report::print(&args)?,
        Command::Check {
            json,
            nvml_lib,
            pid,
            config,
        } => {
            let shares = match config.as_deref() {
                Some(path) => Some(config::DaemonConfig::load(Some(path))?.quotas),
                None => None,
            };
            let report = check::run(&check::CheckConfig {
                nvml_lib,
                pid,
                shares,
            });
            if json {
                println!("{}", report.to_json());
            } else {
                print!("{}", report.render());
            }
            anyhow::ensure!(report.can_trace(), "{}", report.summary());
        }
    }
    Ok(())
}
