//! ttft-trace command line. The work is in the library modules.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use ttft_trace::{
    causes::CauseConfig,
    session::{self, LabelConfig, TraceConfig},
    workloads::DaemonConfig,
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
        /// Seconds between summary lines.
        #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
        interval: f64,
        /// Write one JSON line per GPU episode and per request.
        #[arg(long, value_name = "FILE")]
        jsonl: Option<PathBuf>,
        /// TTFT above which a request is slow and its causes are named (ms).
        #[arg(long, value_name = "MS", default_value_t = 350)]
        slo_ms: u64,
        /// Scheduler intervals (run-queue waits, on-CPU and blocked spells)
        /// at least this long, in microseconds, are kept per request for
        /// attribution; shorter ones are only summed in the kernel.
        #[arg(long, value_name = "US", default_value_t = 1000)]
        sched_min_us: u64,
        /// Ring buffer size in bytes (a power of two, multiple of the page size).
        #[arg(long, default_value_t = 1 << 22)]
        ringbuf_bytes: u32,
        /// NVML sampling period in milliseconds.
        #[arg(long, value_name = "MS", default_value_t = 100)]
        nvml_period_ms: u64,
        /// Add a pid label (the workload root's) to the per-workload series.
        #[arg(long)]
        label_pid: bool,
        #[command(flatten)]
        common: CommonArgs,
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
    /// Trace every process on the host that maps a CUDA library, as it
    /// appears; serve their metrics, labelled by workload.
    Daemon {
        /// TOML settings (see the README); flags override them.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Prometheus endpoint address ("" turns it off).
        #[arg(long)]
        listen: Option<String>,
        /// Trace only processes whose command name matches this regex.
        #[arg(long, value_name = "REGEX")]
        comm: Option<String>,
        /// Trace only processes whose cgroup path starts with this.
        #[arg(long, value_name = "PATH")]
        cgroup_prefix: Option<String>,
        /// Trace only workloads listening on this port (repeatable).
        #[arg(long = "only-port", value_name = "PORT")]
        only_ports: Vec<u16>,
        /// Milliseconds between /proc scans for new CUDA processes.
        #[arg(long, value_name = "MS")]
        rescan_ms: Option<u64>,
        /// Most workload label sets (later ones share comm="_other").
        #[arg(long, value_name = "N")]
        max_label_sets: Option<usize>,
        /// Remove the series of a vanished workload after this many seconds.
        #[arg(long, value_name = "SECONDS")]
        retire_after: Option<f64>,
        /// Add a pid label (each workload root's) to the per-workload series.
        #[arg(long)]
        label_pid: bool,
        /// Write one JSON line per GPU episode and per request.
        #[arg(long, value_name = "FILE")]
        jsonl: Option<PathBuf>,
        /// TTFT above which a request is slow (ms).
        #[arg(long, value_name = "MS")]
        slo_ms: Option<u64>,
        /// Seconds between summary lines.
        #[arg(long, value_name = "SECONDS")]
        interval: Option<f64>,
        /// Also probe this library from the start (repeatable).
        #[arg(long = "cuda-lib", value_name = "PATH")]
        cuda_libs: Vec<PathBuf>,
        #[command(flatten)]
        common: CommonArgs,
    },
}

/// Options both modes take with the same meaning.
#[derive(clap::Args)]
struct CommonArgs {
    /// Stop after this many seconds.
    #[arg(long, value_name = "SECONDS")]
    duration: Option<f64>,
    /// Follow requests on this server port too (repeatable); ports the
    /// traced processes listen on are followed anyway.
    #[arg(long = "port", value_name = "PORT")]
    ports: Vec<u16>,
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
}

fn seconds(s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s).map_err(|e| anyhow::anyhow!("bad duration {s}: {e}"))
}

/// The attribution thresholds: defaults (or `base`), then the JSON file, then the SLO.
fn causes_config_from(
    base: Option<CauseConfig>,
    file: Option<&std::path::Path>,
    slo_ms: u64,
) -> anyhow::Result<CauseConfig> {
    use anyhow::Context as _;
    let mut cfg: CauseConfig = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
        }
        None => base.unwrap_or_default(),
    };
    cfg.slow_ttft_ns = slo_ms.saturating_mul(1_000_000);
    Ok(cfg)
}

fn nvml_config(
    enabled: bool,
    library_path: Option<PathBuf>,
    period_ms: u64,
) -> Option<ttft_trace::nvml::NvmlConfig> {
    enabled.then(|| ttft_trace::nvml::NvmlConfig {
        period: Duration::from_millis(period_ms),
        library_path,
        ..Default::default()
    })
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
            interval,
            jsonl,
            slo_ms,
            sched_min_us,
            ringbuf_bytes,
            nvml_period_ms,
            label_pid,
            common,
        } => {
            let trace = TraceConfig {
                listen: (!no_listen).then_some(listen),
                duration: common.duration.map(seconds).transpose()?,
                interval: seconds(interval)?,
                jsonl,
                ringbuf_bytes,
                ports: common.ports,
                sched_min_ns: sched_min_us.saturating_mul(1000),
                causes: causes_config_from(None, common.causes_config.as_deref(), slo_ms)?,
                nvml: nvml_config(!common.no_nvml, common.nvml_lib, nvml_period_ms),
                labels: LabelConfig {
                    with_pid: label_pid,
                    ..LabelConfig::default()
                },
            };
            let cfg = session::AttachConfig {
                pid,
                wait,
                wait_timeout: wait_timeout.map(seconds).transpose()?,
                cuda_libs,
                trace,
            };
            rt.block_on(session::attach(cfg))?;
            Ok(())
        }
        Command::Daemon {
            config,
            listen,
            comm,
            cgroup_prefix,
            only_ports,
            rescan_ms,
            max_label_sets,
            retire_after,
            label_pid,
            jsonl,
            slo_ms,
            interval,
            cuda_libs,
            common,
        } => {
            let mut file = DaemonConfig::load(config.as_deref())?;
            // Flags override the file.
            file.listen = listen.unwrap_or(file.listen);
            file.discovery.comm = comm.or(file.discovery.comm);
            file.discovery.cgroup_prefix = cgroup_prefix.or(file.discovery.cgroup_prefix);
            if !only_ports.is_empty() {
                file.discovery.ports = only_ports;
            }
            file.discovery.rescan_ms = rescan_ms.unwrap_or(file.discovery.rescan_ms);
            file.labels.max_sets = max_label_sets.unwrap_or(file.labels.max_sets);
            file.labels.retire_after_s = retire_after.unwrap_or(file.labels.retire_after_s);
            file.labels.pid |= label_pid;
            file.jsonl = jsonl.or(file.jsonl);
            file.slo_ms = slo_ms.unwrap_or(file.slo_ms);
            file.interval_s = interval.unwrap_or(file.interval_s);
            let trace = TraceConfig {
                listen: file.listen_addr().map_err(anyhow::Error::msg)?,
                duration: common.duration.map(seconds).transpose()?,
                interval: seconds(file.interval_s)?,
                jsonl: file.jsonl.clone(),
                ringbuf_bytes: file.ringbuf_bytes,
                ports: common.ports,
                sched_min_ns: file.sched_min_us.saturating_mul(1000),
                causes: causes_config_from(
                    file.causes.clone(),
                    common.causes_config.as_deref(),
                    file.slo_ms,
                )?,
                nvml: nvml_config(
                    file.nvml.enabled && !common.no_nvml,
                    common.nvml_lib.or(file.nvml.library.clone()),
                    file.nvml.period_ms,
                ),
                labels: LabelConfig {
                    with_pid: file.labels.pid,
                    max_sets: file.labels.max_sets,
                    retire_after: seconds(file.labels.retire_after_s)?,
                },
            };
            let opts = session::DaemonOptions {
                filters: file.filters()?,
                rescan: Duration::from_millis(file.discovery.rescan_ms.max(10)),
                cuda_libs,
                trace,
            };
            rt.block_on(session::daemon(opts))?;
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
