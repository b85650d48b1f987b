//! The settings file (`ttft-trace daemon --config`, TOML). Every field has
//! a default, so an empty file (or none) is a valid config. `attach` starts
//! from the same settings, with its own flags applied over them.

use std::{net::SocketAddr, path::PathBuf};

use serde::Deserialize;

use super::ConfigError;
use crate::{causes::CauseConfig, workloads::Filters};

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// Prometheus endpoint; `listen = ""` turns it off.
    pub listen: String,
    /// One JSON line per request and per GPU episode.
    pub jsonl: Option<PathBuf>,
    /// TTFT above which a request is slow and its causes are named.
    pub slo_ms: u64,
    /// A gap between chunks longer than this is a stall; 0: the larger of
    /// 100 ms and 4 × the request's own median gap.
    pub stall_threshold_ms: u64,
    /// A request after an interrupted one from the same client address to
    /// the same port within this long is its retry.
    pub retry_window_ms: u64,
    /// Scheduler intervals at least this long are kept for attribution.
    pub sched_min_us: u64,
    /// Where the scheduler intervals come from (see [`SchedSource`]).
    pub sched: SchedSource,
    /// Period of the `sampled` source, in milliseconds.
    pub sched_sample_ms: u64,
    pub ringbuf_bytes: u32,
    /// Seconds between terminal summary lines.
    pub interval_s: f64,
    pub discovery: Discovery,
    pub labels: Labels,
    pub nvml: Nvml,
    /// Requests as traces to an OTLP collector.
    pub otlp: Otlp,
    /// Attribution thresholds (any fields of the causes config).
    pub causes: Option<CauseConfig>,
    /// Entries of the kernel maps that bound what is followed.
    pub kernel_maps: KernelMaps,
    /// One workload's share of those maps.
    pub quotas: Quotas,
}

/// One workload's share of a host-wide kernel map: a workload is a pod
/// (its UID in the cgroup path), else a cgroup. Past its share that
/// workload alone is degraded, counted in
/// `ttft_trace_quota_exceeded_total{resource}`.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Quotas {
    /// Listening sockets followed (`LISTEN_NETNS` pairs); past it, the
    /// workload's other listeners are not followed.
    pub listeners: usize,
    /// `TRACKED` entries: its processes and the threads the kernel adds
    /// at fork; past it, its new child processes are not traced.
    pub threads: usize,
    /// Threads sampled for `sched = "sampled"` (one open file each); past
    /// it, its other threads are not sampled.
    pub sampled_threads: usize,
    /// Attribute sets of the OTLP GenAI metrics; past it, the workload's
    /// requests on new sets are recorded in its own overflow set.
    pub otlp_attribute_sets: usize,
}

impl Default for Quotas {
    fn default() -> Self {
        // A quarter of the default maps, as label sets are a pod's.
        Self {
            listeners: 1024,
            threads: 4096,
            sampled_threads: 4096,
            otlp_attribute_sets: 250,
        }
    }
}

/// Entries of the kernel maps whose size bounds what is followed (the
/// defaults are the sizes compiled into the probes). `TRACKED` and
/// `LISTEN_NETNS` refuse inserts when full (counted in
/// `ttft_trace_map_full_total`); `CONNS` evicts its least recently used
/// connection. `LISTEN_PORTS` is an array with room for every port.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct KernelMaps {
    /// Traced processes (and threads between fork and exit).
    pub tracked: u32,
    /// (network namespace, port) pairs.
    pub listen_netns: u32,
    /// Followed server connections.
    pub conns: u32,
}

impl Default for KernelMaps {
    fn default() -> Self {
        Self {
            tracked: 16_384,
            listen_netns: 4096,
            conns: 65_536,
        }
    }
}

impl KernelMaps {
    /// (map name, entries) for the loader; zero is refused (a map needs one).
    /// `OVER_SHARE` holds a flag per workload: it is sized as `TRACKED`.
    pub fn entries(&self) -> Result<[(&'static str, u32); 4], ConfigError> {
        let all = [
            ("TRACKED", self.tracked),
            ("LISTEN_NETNS", self.listen_netns),
            ("CONNS", self.conns),
            ("OVER_SHARE", self.tracked),
        ];
        if let Some((name, _)) = all.iter().find(|(_, n)| *n == 0) {
            return Err(ConfigError::MapEntries(name));
        }
        Ok(all)
    }
}

/// Where the traced threads' scheduler intervals (on-CPU, run-queue and
/// blocked spells) come from.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SchedSource {
    /// A program on `sched_switch`: every spell, to the nanosecond; every
    /// context switch on the host runs it (about one BPF dispatch each).
    Exact,
    /// No scheduler program: the traced threads' counters in
    /// `/proc/PID/task/TID/schedstat`, read every `sched_sample_ms`; spells
    /// placed to the sampling period. Other tasks' switches pay nothing.
    /// The default: a root daemon on a shared host taxes no one else.
    #[default]
    Sampled,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Discovery {
    /// Trace only processes whose command name matches this regex.
    pub comm: Option<String>,
    /// Trace only processes whose cgroup path starts with this.
    pub cgroup_prefix: Option<String>,
    /// Trace only workloads listening on one of these ports (all when empty).
    pub ports: Vec<u16>,
    /// How often /proc is scanned for processes that map a CUDA library;
    /// 0: only at start (later processes are found by the kernel's
    /// announcement alone, when they call into a library already probed).
    pub rescan_ms: u64,
    /// Probes of a library no traced process has mapped for this long are
    /// detached (longer than a server's restart, so that a restart keeps
    /// them).
    pub detach_unmapped_s: f64,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Labels {
    /// Add a `pid` label to every per-workload series (high cardinality).
    pub pid: bool,
    /// Most workload label sets; later workloads share `comm="_other"`.
    pub max_sets: usize,
    /// Most label sets of one pod's workloads (its share of `max_sets`);
    /// its later ones share the pod's own `comm="_other"` set.
    pub max_sets_per_pod: usize,
    /// Series of workloads gone this long are removed.
    pub retire_after_s: f64,
    /// The kubelet's pod log directory on this host: its entries
    /// (`<namespace>_<pod>_<uid>`) name the pod of each pod UID found in a
    /// cgroup path. Mounted read-only at the same path in a DaemonSet.
    pub pod_log_dir: PathBuf,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Nvml {
    pub enabled: bool,
    pub period_ms: u64,
    /// Library to load instead of `libnvidia-ml.so.1` from the loader's path.
    pub library: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Otlp {
    /// OTLP/gRPC endpoint of a collector (`http://host:4317`). Traces are
    /// exported when this, `--otlp-endpoint`, `OTEL_EXPORTER_OTLP_ENDPOINT`
    /// or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set.
    pub endpoint: Option<String>,
    /// `grpc` or `http/protobuf`; default: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`,
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`, then `grpc`.
    pub protocol: Option<String>,
    /// Share of the requests that are not slow to export; slow ones always are.
    pub sample_ratio: f64,
    /// Requests queued for export at most; beyond, spans are dropped and counted.
    pub queue_requests: usize,
    /// `gen_ai.operation.name` on the GenAI metrics (`chat`,
    /// `text_completion`, ...): request paths are not read.
    pub gen_ai_operation_name: String,
}

impl Default for Otlp {
    fn default() -> Self {
        Self {
            endpoint: None,
            protocol: None,
            sample_ratio: 1.0,
            queue_requests: 2048,
            gen_ai_operation_name: "chat".into(),
        }
    }
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
            jsonl: None,
            slo_ms: 350,
            stall_threshold_ms: 0,
            retry_window_ms: 10_000,
            sched_min_us: 1000,
            sched: SchedSource::Sampled,
            sched_sample_ms: 10,
            ringbuf_bytes: 1 << 22,
            interval_s: 60.0,
            discovery: Discovery::default(),
            labels: Labels::default(),
            nvml: Nvml::default(),
            otlp: Otlp::default(),
            causes: None,
            kernel_maps: KernelMaps::default(),
            quotas: Quotas::default(),
        }
    }
}

impl Default for Discovery {
    fn default() -> Self {
        Self {
            comm: None,
            cgroup_prefix: None,
            ports: Vec::new(),
            rescan_ms: 1000,
            detach_unmapped_s: 60.0,
        }
    }
}

impl Default for Labels {
    fn default() -> Self {
        Self {
            pid: false,
            max_sets: 100,
            max_sets_per_pod: 25,
            retire_after_s: 300.0,
            pod_log_dir: PathBuf::from(crate::host::kubelet::DEFAULT_POD_LOG_DIR),
        }
    }
}

impl Default for Nvml {
    fn default() -> Self {
        Self {
            enabled: true,
            period_ms: 100,
            library: None,
        }
    }
}

impl DaemonConfig {
    /// Reads a config file; `None` gives the defaults.
    pub fn load(path: Option<&std::path::Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse(path.to_path_buf(), e))
    }

    /// The listen address, or None when turned off.
    pub fn listen_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.listen.is_empty() {
            return Ok(None);
        }
        self.listen
            .parse()
            .map(Some)
            .map_err(|e| ConfigError::Listen(self.listen.clone(), e))
    }

    /// The process filters, compiled.
    pub fn filters(&self) -> Result<Filters, ConfigError> {
        let comm = self
            .discovery
            .comm
            .as_deref()
            .map(|re| regex::Regex::new(re).map_err(|e| ConfigError::Regex(re.into(), e)))
            .transpose()?;
        Ok(Filters {
            comm,
            cgroup_prefix: self.discovery.cgroup_prefix.clone(),
            ports: self.discovery.ports.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_the_defaults() {
        let cfg: DaemonConfig = toml::from_str("").expect("parse");
        assert_eq!(cfg, DaemonConfig::default());
        assert_eq!(cfg.labels.max_sets, 100);
        assert_eq!(cfg.discovery.rescan_ms, 1000);
    }

    #[test]
    fn parses_the_documented_example() {
        let text = r#"
listen = "0.0.0.0:9464"
jsonl = "/var/log/ttft-trace/requests.jsonl"
slo_ms = 350
stall_threshold_ms = 250
[discovery]
comm = "^(python|vllm|tritonserver)"
cgroup_prefix = "/kubepods"
ports = [8000]
[labels]
pid = false
max_sets = 100
max_sets_per_pod = 10
retire_after_s = 300
[nvml]
enabled = true
period_ms = 100
[quotas]
listeners = 256
threads = 512
sampled_threads = 128
otlp_attribute_sets = 64
[causes]
queueing_min_ns = 2000000000
"#;
        let cfg: DaemonConfig = toml::from_str(text).expect("parse");
        assert_eq!(cfg.discovery.ports, vec![8000]);
        assert_eq!(cfg.labels.max_sets_per_pod, 10);
        assert_eq!(cfg.quotas.listeners, 256);
        assert_eq!(cfg.quotas.threads, 512);
        assert_eq!(cfg.quotas.sampled_threads, 128);
        assert_eq!(cfg.quotas.otlp_attribute_sets, 64);
        assert_eq!(
            cfg.listen_addr().expect("addr"),
            Some("0.0.0.0:9464".parse().expect("a"))
        );
        let f = cfg.filters().expect("filters");
        assert!(f.comm.as_ref().is_some_and(|re| re.is_match("python3")));
        assert!(cfg.causes.is_some());
        assert_eq!(cfg.stall_threshold_ms, 250);
    }

    #[test]
    fn the_kubernetes_configmap_is_a_valid_config() {
        let yaml = include_str!("../../../deploy/kubernetes/configmap.yaml");
        let body = yaml
            .split_once("config.toml: |\n")
            .map(|(_, rest)| rest)
            .expect("config.toml block");
        let toml_text: String = body
            .lines()
            .map(|l| l.strip_prefix("    ").unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
        let cfg: DaemonConfig = toml::from_str(&toml_text).expect("the ConfigMap parses");
        assert_eq!(cfg.discovery.ports, vec![8000]);
        assert_eq!(cfg.labels.retire_after_s, 300.0);
        cfg.filters().expect("filters compile");
        cfg.listen_addr().expect("listen address");
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let err = toml::from_str::<DaemonConfig>("[labels]\nmax_set = 3\n").expect_err("typo");
        assert!(err.to_string().contains("max_set"), "{err}");
        let cfg = DaemonConfig {
            discovery: Discovery {
                comm: Some("(".into()),
                ..Discovery::default()
            },
            ..DaemonConfig::default()
        };
        assert!(
            cfg.filters()
                .expect_err("bad regex")
                .to_string()
                .contains("discovery.comm")
        );
        let off = DaemonConfig {
            listen: String::new(),
            ..DaemonConfig::default()
        };
        assert_eq!(off.listen_addr().expect("off"), None);
    }
}
