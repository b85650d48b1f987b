//! The command-line flags of `attach` and `daemon`, and how each becomes
//! the configuration (settings file first, then flags).

use std::{net::SocketAddr, path::PathBuf};

use super::{
    AttachConfig, ConfigError, DaemonConfig, DaemonOptions, Labels, Nvml, SchedSource, seconds,
    trace_config,
};

/// `ttft-trace attach`: one process tree.
#[derive(clap::Args)]
pub struct AttachArgs {
    /// Process to trace (its children, present and future, are traced too).
    #[arg(long)]
    pub pid: u32,
    /// Wait for the process to load a CUDA library instead of failing.
    #[arg(long)]
    pub wait: bool,
    /// Give up waiting after this many seconds.
    #[arg(long, value_name = "SECONDS", requires = "wait")]
    pub wait_timeout: Option<f64>,
    /// Also probe this library (repeatable), e.g. one not mapped yet.
    #[arg(long = "cuda-lib", value_name = "PATH")]
    pub cuda_libs: Vec<PathBuf>,
    /// Put the uprobes in every process that maps the CUDA libraries (as
    /// the daemon does), not only in the traced ones: a child that a traced
    /// process forks is then traced from its first call rather than from a
    /// few milliseconds after its birth, and every other process mapping
    /// the same files takes a trap per probed call.
    #[arg(long)]
    pub host_wide_probes: bool,
    /// Prometheus endpoint address.
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub listen: SocketAddr,
    /// Do not serve /metrics.
    #[arg(long)]
    pub no_listen: bool,
    /// Seconds between summary lines.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    pub interval: f64,
    /// Write one JSON line per GPU episode and per request.
    #[arg(long, value_name = "FILE")]
    pub jsonl: Option<PathBuf>,
    /// TTFT above which a request is slow and its causes are named (ms).
    #[arg(long, value_name = "MS", default_value_t = 350)]
    pub slo_ms: u64,
    /// Scheduler intervals (run-queue waits, on-CPU and blocked spells)
    /// at least this long, in microseconds, are kept per request for
    /// attribution; shorter ones are only summed in the kernel.
    #[arg(long, value_name = "US", default_value_t = 1000)]
    pub sched_min_us: u64,
    /// Ring buffer size in bytes (a power of two, multiple of the page size).
    #[arg(long, default_value_t = 1 << 22)]
    pub ringbuf_bytes: u32,
    /// NVML sampling period in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 100)]
    pub nvml_period_ms: u64,
    /// Add a pid label (the workload root's) to the per-workload series.
    #[arg(long)]
    pub label_pid: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// `ttft-trace daemon`: every inference workload on the host.
#[derive(clap::Args)]
pub struct DaemonArgs {
    /// TOML settings (see docs/usage.md, "The settings file"); flags override them.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Prometheus endpoint address ("" turns it off).
    #[arg(long)]
    pub listen: Option<String>,
    /// Trace only processes whose command name matches this regex.
    #[arg(long, value_name = "REGEX")]
    pub comm: Option<String>,
    /// Trace only processes whose cgroup path starts with this.
    #[arg(long, value_name = "PATH")]
    pub cgroup_prefix: Option<String>,
    /// Trace only workloads listening on this port (repeatable).
    #[arg(long = "only-port", value_name = "PORT")]
    pub only_ports: Vec<u16>,
    /// Milliseconds between /proc scans for new CUDA processes (0: only the
    /// scan at start; later processes are found by the kernel's
    /// announcement alone, when they call into a library already probed).
    #[arg(long, value_name = "MS")]
    pub rescan_ms: Option<u64>,
    /// Detach the probes of a library no traced process has mapped for
    /// this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub detach_unmapped: Option<f64>,
    /// Most workload label sets (later ones share comm="_other").
    #[arg(long, value_name = "N")]
    pub max_label_sets: Option<usize>,
    /// Most label sets of one pod's workloads (its later ones share the
    /// pod's own comm="_other" set).
    #[arg(long, value_name = "N")]
    pub max_label_sets_per_pod: Option<usize>,
    /// Most listening sockets of one workload (pod, else cgroup) followed;
    /// its others are not.
    #[arg(long, value_name = "N")]
    pub max_listeners_per_workload: Option<usize>,
    /// Most processes and threads of one workload (pod, else cgroup) in
    /// the kernel's TRACKED map; past it, its new child processes are not
    /// traced.
    #[arg(long, value_name = "N")]
    pub max_threads_per_workload: Option<usize>,
    /// Most threads of one workload (pod, else cgroup) sampled for
    /// `--sched sampled` (one open file each); its others are not.
    #[arg(long, value_name = "N")]
    pub max_sampled_threads_per_workload: Option<usize>,
    /// Remove the series of a vanished workload after this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub retire_after: Option<f64>,
    /// Add a pid label (each workload root's) to the per-workload series.
    #[arg(long)]
    pub label_pid: bool,
    /// The kubelet's pod log directory, whose entries name each pod UID's
    /// namespace and pod (default /var/log/pods); what a process claims of
    /// its pod is never a label.
    #[arg(long, value_name = "DIR")]
    pub pod_log_dir: Option<PathBuf>,
    /// Write one JSON line per GPU episode and per request.
    #[arg(long, value_name = "FILE")]
    pub jsonl: Option<PathBuf>,
    /// TTFT above which a request is slow (ms).
    #[arg(long, value_name = "MS")]
    pub slo_ms: Option<u64>,
    /// Seconds between summary lines.
    #[arg(long, value_name = "SECONDS")]
    pub interval: Option<f64>,
    /// Also probe this library from the start (repeatable).
    #[arg(long = "cuda-lib", value_name = "PATH")]
    pub cuda_libs: Vec<PathBuf>,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Options both modes take with the same meaning.
#[derive(clap::Args)]
pub struct CommonArgs {
    /// Where the traced threads' scheduler intervals come from: `sampled`
    /// (their `/proc` schedstat counters every --sched-sample-ms; no
    /// program on switches, so other tasks pay nothing) or `exact` (a
    /// program on every context switch of the host: spells to the
    /// nanosecond). Default: the settings file's `sched`, else sampled.
    #[arg(long, value_name = "SOURCE")]
    pub sched: Option<SchedSource>,
    /// Period of `--sched sampled`, in milliseconds (default 10).
    #[arg(long, value_name = "MS")]
    pub sched_sample_ms: Option<u64>,
    /// Stop after this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,
    /// Follow requests on this server port too (repeatable); ports the
    /// traced processes listen on are followed anyway.
    #[arg(long = "port", value_name = "PORT")]
    pub ports: Vec<u16>,
    /// Attribution thresholds as JSON (any fields of CauseConfig, in ns
    /// or shares); --slo-ms overrides its slow_ttft_ns.
    #[arg(long, value_name = "FILE")]
    pub causes_config: Option<PathBuf>,
    /// A gap between chunks longer than this (ms) is a stall; 0: the
    /// larger of 100 ms and 4 × the request's own median gap (the default,
    /// or the settings file's `stall_threshold_ms`).
    #[arg(long, value_name = "MS")]
    pub stall_threshold_ms: Option<u64>,
    /// A request that follows an interrupted one (reset, or closed before
    /// or during its response) from the same client address to the same
    /// port within this long (ms) is its retry: `retry_of` and
    /// `user_ttft_ns` in the JSONL (default 10000, or the settings file's
    /// `retry_window_ms`; 0: off).
    #[arg(long, value_name = "MS")]
    pub retry_window_ms: Option<u64>,
    /// Do not sample GPU readings through NVML.
    #[arg(long)]
    pub no_nvml: bool,
    /// NVML library to load (default: libnvidia-ml.so.1 from the loader's path).
    #[arg(long, value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,
    /// Export each request as a trace to this OTLP collector (gRPC
    /// http://host:4317, or OTLP/HTTP http://host:4318 with
    /// OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf or otlp.protocol in the
    /// settings file); OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT also turns it
    /// on, and the other OTEL_EXPORTER_OTLP_*, OTEL_SERVICE_NAME and
    /// OTEL_RESOURCE_ATTRIBUTES variables apply.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// Share of the requests that are not slow to export as traces (slow
    /// ones always are); default 1.
    #[arg(long, value_name = "RATIO")]
    pub otlp_sample_ratio: Option<f64>,
}

impl AttachArgs {
    /// The file's defaults with the flags applied over them.
    pub fn into_config(self) -> Result<AttachConfig, ConfigError> {
        let file = DaemonConfig {
            listen: if self.no_listen {
                String::new()
            } else {
                self.listen.to_string()
            },
            jsonl: self.jsonl,
            slo_ms: self.slo_ms,
            sched_min_us: self.sched_min_us,
            ringbuf_bytes: self.ringbuf_bytes,
            interval_s: self.interval,
            labels: Labels {
                pid: self.label_pid,
                ..Labels::default()
            },
            nvml: Nvml {
                period_ms: self.nvml_period_ms,
                ..Nvml::default()
            },
            ..DaemonConfig::default()
        };
        Ok(AttachConfig {
            pid: self.pid,
            wait: self.wait,
            wait_timeout: self
                .wait_timeout
                .map(|t| seconds("--wait-timeout", t))
                .transpose()?,
            cuda_libs: self.cuda_libs,
            host_wide_probes: self.host_wide_probes,
            trace: trace_config(&file, &self.common)?,
        })
    }
}

impl DaemonArgs {
    /// The settings file (or its defaults) with the flags applied over it.
    pub fn into_config(self) -> Result<DaemonOptions, ConfigError> {
        let mut file = DaemonConfig::load(self.config.as_deref())?;
        file.listen = self.listen.unwrap_or(file.listen);
        file.discovery.comm = self.comm.or(file.discovery.comm);
        file.discovery.cgroup_prefix = self.cgroup_prefix.or(file.discovery.cgroup_prefix);
        if !self.only_ports.is_empty() {
            file.discovery.ports = self.only_ports;
        }
        file.discovery.rescan_ms = self.rescan_ms.unwrap_or(file.discovery.rescan_ms);
        file.discovery.detach_unmapped_s = self
            .detach_unmapped
            .unwrap_or(file.discovery.detach_unmapped_s);
        file.labels.max_sets = self.max_label_sets.unwrap_or(file.labels.max_sets);
        file.labels.max_sets_per_pod = self
            .max_label_sets_per_pod
            .unwrap_or(file.labels.max_sets_per_pod);
        file.quotas.listeners = self
            .max_listeners_per_workload
            .unwrap_or(file.quotas.listeners);
        file.quotas.threads = self.max_threads_per_workload.unwrap_or(file.quotas.threads);
        file.quotas.sampled_threads = self
            .max_sampled_threads_per_workload
            .unwrap_or(file.quotas.sampled_threads);
        file.labels.retire_after_s = self.retire_after.unwrap_or(file.labels.retire_after_s);
        file.labels.pid |= self.label_pid;
        file.labels.pod_log_dir = self.pod_log_dir.unwrap_or(file.labels.pod_log_dir);
        file.jsonl = self.jsonl.or(file.jsonl);
        file.slo_ms = self.slo_ms.unwrap_or(file.slo_ms);
        file.interval_s = self.interval.unwrap_or(file.interval_s);
        Ok(DaemonOptions {
            filters: file.filters()?,
            rescan: rescan_period(file.discovery.rescan_ms),
            detach_unmapped: super::seconds("--detach-unmapped", file.discovery.detach_unmapped_s)?,
            cuda_libs: self.cuda_libs,
            trace: trace_config(&file, &self.common)?,
        })
    }
}

/// The period of the daemon's /proc scan: `None` for 0 (no periodic scan),
/// else at least 10 ms.
fn rescan_period(ms: u64) -> Option<std::time::Duration> {
    (ms > 0).then(|| std::time::Duration::from_millis(ms.max(10)))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn a_rescan_period_of_zero_turns_the_periodic_scan_off() {
        use std::time::Duration;
        assert_eq!(rescan_period(0), None);
        assert_eq!(rescan_period(1), Some(Duration::from_millis(10)));
        assert_eq!(rescan_period(1000), Some(Duration::from_secs(1)));
    }

    #[derive(Parser)]
    enum Cli {
        Attach(Box<AttachArgs>),
        Daemon(Box<DaemonArgs>),
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("ttft-trace").chain(args.iter().copied()))
            .expect("parses")
    }

    #[test]
    fn attach_flags_over_the_defaults() {
        let Cli::Attach(a) = parse(&["attach", "--pid", "7", "--no-listen", "--slo-ms", "200"])
        else {
            panic!("attach")
        };
        let cfg = a.into_config().expect("valid");
        assert_eq!(cfg.pid, 7);
        assert_eq!(cfg.trace.listen, None);
        assert_eq!(cfg.trace.interval, std::time::Duration::from_secs(5));
        assert_eq!(cfg.trace.causes.slow_ttft_ns, 200_000_000);
        assert!(cfg.trace.nvml.is_some());
        assert!(!cfg.host_wide_probes, "bound to the traced processes");
        assert_eq!(
            cfg.trace.stalls.fixed_ns, None,
            "the adaptive rule by default"
        );
        let Cli::Attach(a) = parse(&["attach", "--pid", "7", "--stall-threshold-ms", "250"]) else {
            panic!("attach")
        };
        let cfg = a.into_config().expect("valid");
        assert_eq!(cfg.trace.stalls.fixed_ns, Some(250_000_000));
        let Cli::Attach(a) = parse(&["attach", "--pid", "7", "--host-wide-probes"]) else {
            panic!("attach")
        };
        assert!(a.into_config().expect("valid").host_wide_probes);
    }

    #[test]
    fn daemon_flags_over_the_file_defaults() {
        let Cli::Daemon(d) = parse(&["daemon", "--listen=", "--only-port", "8000", "--no-nvml"])
        else {
            panic!("daemon")
        };
        let cfg = d.into_config().expect("valid");
        assert_eq!(cfg.trace.listen, None);
        assert_eq!(cfg.filters.ports, vec![8000]);
        assert_eq!(cfg.trace.interval, std::time::Duration::from_secs(60));
        assert!(cfg.trace.nvml.is_none());
        assert_eq!(
            cfg.trace.labels.pod_log_dir,
            PathBuf::from("/var/log/pods"),
            "the kubelet's default"
        );
    }

    #[test]
    fn the_pod_log_dir_from_the_file_or_the_flag() {
        let dir = std::env::temp_dir().join(format!("ttft-podlogdir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("config.toml");
        std::fs::write(&path, "[labels]\npod_log_dir = \"/host/var/log/pods\"\n").expect("write");
        let config = path.display().to_string();
        let Cli::Daemon(d) = parse(&["daemon", "--config", &config]) else {
            panic!("daemon")
        };
        let cfg = d.into_config().expect("valid");
        assert_eq!(
            cfg.trace.labels.pod_log_dir,
            PathBuf::from("/host/var/log/pods")
        );
        let Cli::Daemon(d) = parse(&["daemon", "--config", &config, "--pod-log-dir", "/x/pods"])
        else {
            panic!("daemon")
        };
        let cfg = d.into_config().expect("valid");
        assert_eq!(cfg.trace.labels.pod_log_dir, PathBuf::from("/x/pods"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn zero_or_negative_periods_are_clear_errors() {
        for args in [
            &["attach", "--pid", "1", "--interval", "0"][..],
            &["attach", "--pid", "1", "--duration=-1"][..],
            &["daemon", "--interval", "0"][..],
            &["daemon", "--detach-unmapped", "0"][..],
        ] {
            let err = match parse(args) {
                Cli::Attach(a) => a.into_config().err(),
                Cli::Daemon(d) => d.into_config().err(),
            };
            let err = err.expect("refused").to_string();
            assert!(
                err.contains("must be a positive number of seconds"),
                "{err}"
            );
        }
    }
}
