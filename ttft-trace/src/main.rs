//! ttft-trace command line. The work is in the library modules.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};

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
    Attach {
        /// Process to trace (its children, present and future, are traced too).
        #[arg(long)]
        pid: u32,
        /// Wait for the process to load a CUDA library instead of failing.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, value_name = "SECONDS", requires = "wait")]
        wait_timeout: Option<f64>,
        /// Also probe this library (repeatable), e.g. one not mapped yet.
        #[arg(long = "cuda-lib", value_name = "PATH")]
        cuda_libs: Vec<PathBuf>,
        /// Prometheus endpoint address.
        #[arg(long, default_value = "127.0.0.1:9464")]
        listen: SocketAddr,
        /// Do not serve /metrics.
        #[arg(long)]
        no_listen: bool,
        /// Stop after this many seconds.
        #[arg(long, value_name = "SECONDS")]
        duration: Option<f64>,
        /// Seconds between summary lines.
        #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
        interval: f64,
        /// Write one JSON line per GPU episode (and per attached library).
        #[arg(long, value_name = "FILE")]
        jsonl: Option<PathBuf>,
        /// Ring buffer size in bytes (a power of two, multiple of the page size).
        #[arg(long, default_value_t = 1 << 22)]
        ringbuf_bytes: u32,
        /// Follow requests on this server port too (repeatable); ports the
        /// traced processes listen on are followed anyway.
        #[arg(long = "port", value_name = "PORT")]
        ports: Vec<u16>,
        /// Scheduler intervals (run-queue waits, on-CPU and blocked spells)
        /// at least this long, in microseconds, are kept per request for
        /// attribution; shorter ones are only summed in the kernel.
        #[arg(long, value_name = "US", default_value_t = 1000)]
        sched_min_us: u64,
        /// TTFT above which a request is slow and its causes are named (ms).
        #[arg(long, value_name = "MS", default_value_t = 350)]
        slo_ms: u64,
        /// Attribution thresholds as JSON (any fields of CauseConfig, in ns
        /// or shares); --slo-ms overrides its slow_ttft_ns.
        #[arg(long, value_name = "FILE")]
        causes_config: Option<PathBuf>,
        /// Do not sample GPU readings through NVML.
        #[arg(long)]
        no_nvml: bool,
        /// NVML library to load (default: libnvidia-ml.so.1 from the loader's path).
        #[arg(long, value_name = "PATH")]
        nvml_lib: Option<PathBuf>,
        /// NVML sampling period in milliseconds.
        #[arg(long, value_name = "MS", default_value_t = 100)]
        nvml_period_ms: u64,
    },
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
    },
}

fn seconds(s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s).map_err(|e| anyhow::anyhow!("bad duration {s}: {e}"))
}

/// The attribution thresholds: defaults, then the JSON file, then --slo-ms.
fn causes_config_from(
    file: Option<&std::path::Path>,
    slo_ms: u64,
) -> anyhow::Result<ttft_trace::causes::CauseConfig> {
    use anyhow::Context as _;
    let mut cfg: ttft_trace::causes::CauseConfig = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
        }
        None => Default::default(),
    };
    cfg.slow_ttft_ns = slo_ms.saturating_mul(1_000_000);
    Ok(cfg)
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match cli.command {
        Command::Attach {
            pid,
            wait,
            wait_timeout,
            cuda_libs,
            listen,
            no_listen,
            duration,
            interval,
            jsonl,
            ringbuf_bytes,
            ports,
            sched_min_us,
            slo_ms,
            causes_config,
            no_nvml,
            nvml_lib,
            nvml_period_ms,
        } => {
            let cfg = ttft_trace::session::AttachConfig {
                pid,
                wait,
                wait_timeout: wait_timeout.map(seconds).transpose()?,
                cuda_libs,
                listen: (!no_listen).then_some(listen),
                duration: duration.map(seconds).transpose()?,
                interval: seconds(interval)?,
                jsonl,
                ringbuf_bytes,
                ports,
                sched_min_ns: sched_min_us.saturating_mul(1000),
                causes: causes_config_from(causes_config.as_deref(), slo_ms)?,
                nvml: (!no_nvml).then(|| ttft_trace::nvml::NvmlConfig {
                    period: Duration::from_millis(nvml_period_ms),
                    library_path: nvml_lib,
                    ..Default::default()
                }),
            };
            rt.block_on(ttft_trace::session::attach(cfg))?;
            Ok(())
        }
        Command::Check { json, nvml_lib } => {
            let report = ttft_trace::check::run(&ttft_trace::check::CheckConfig { nvml_lib });
            if json {
                println!("{}", report.to_json());
            } else {
                print!("{}", report.render());
            }
            anyhow::ensure!(report.can_trace(), "{}", report.summary());
            Ok(())
        }
    }
}
