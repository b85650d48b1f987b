//! The configuration both modes run on: the settings file and the flags,
//! merged once. `attach` starts from the file's defaults with its flags
//! applied over them; `daemon` reads the file (`--config`) and applies its
//! flags over it. Either way one [`DaemonConfig`] plus the shared flags
//! becomes the one [`TraceConfig`].

mod file;
pub mod flags;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use thiserror::Error;

pub use file::{DaemonConfig, Discovery, Labels, Nvml, Otlp, Quotas, SchedSource};

use crate::{
    causes::CauseConfig,
    export::{
        LabelConfig,
        otlp::{OtlpConfig, Protocol},
    },
    nvml::NvmlConfig,
    requests::stream_stalls::StallConfig,
    workloads::Filters,
};

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {0}: {1}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("{0}: {1}")]
    Parse(PathBuf, #[source] toml::de::Error),
    #[error("{0}: {1}")]
    ParseJson(PathBuf, #[source] serde_json::Error),
    #[error("discovery.comm {0:?} is not a valid regular expression: {1}")]
    Regex(String, #[source] regex::Error),
    #[error("listen = {0:?}: {1}")]
    Listen(String, #[source] std::net::AddrParseError),
    #[error("{0}: the OTLP protocol must be grpc or http/protobuf, not {1:?}")]
    Protocol(&'static str, String),
    #[error("the OTLP sample ratio must be between 0 and 1, not {0}")]
    SampleRatio(f64),
    #[error("{what} must be a positive number of seconds, not {value}")]
    Duration { what: &'static str, value: f64 },
    #[error("sched_sample_ms must be between 1 and 1000, not {0}")]
    SchedPeriod(u64),
    #[error("kernel_maps: {0} needs at least one entry")]
    MapEntries(&'static str),
}

/// What both modes share.
pub struct TraceConfig {
    pub listen: Option<SocketAddr>,
    pub duration: Option<Duration>,
    pub interval: Duration,
    pub jsonl: Option<PathBuf>,
    pub ringbuf_bytes: u32,
    /// (kernel map, entries) set at load time.
    pub map_entries: [(&'static str, u32); 4],
    /// Server ports to follow besides those the traced processes listen on.
    pub ports: Vec<u16>,
    /// Scheduler intervals at least this long are kept for attribution.
    pub sched_min_ns: u64,
    /// Where the scheduler intervals come from.
    pub sched: SchedSignals,
    /// Thresholds of the cause attribution.
    pub causes: CauseConfig,
    /// What a stall after the first token is.
    pub stalls: StallConfig,
    /// A request after an interrupted one from the same client address to
    /// the same port within this long is its retry (`requests/retries.rs`).
    pub retry_window_ns: u64,
    /// NVML sampling; None: off.
    pub nvml: Option<NvmlConfig>,
    pub labels: LabelConfig,
    /// One workload's share of the host-wide kernel maps.
    pub quotas: Quotas,
    /// Traces over OTLP; None: off.
    pub otlp: Option<OtlpConfig>,
}

/// Where the scheduler intervals come from, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchedSignals {
    /// The `sched_switch` program.
    Exact,
    /// The threads' `/proc` counters, read every `period`.
    Sampled { period: Duration },
}

/// `ttft-trace attach`.
pub struct AttachConfig {
    pub pid: u32,
    pub wait: bool,
    pub wait_timeout: Option<Duration>,
    pub cuda_libs: Vec<PathBuf>,
    /// Uprobes fire in every process that maps the probed files, not only
    /// in the traced ones.
    pub host_wide_probes: bool,
    pub trace: TraceConfig,
}

/// `ttft-trace daemon`.
pub struct DaemonOptions {
    pub filters: Filters,
    /// How often /proc is scanned for new CUDA processes; `None`: only at
    /// start (`rescan_ms = 0`).
    pub rescan: Option<Duration>,
    /// Probes of a library no traced process maps this long are detached.
    pub detach_unmapped: Duration,
    /// Libraries to probe from the start (e.g. not mapped by anyone yet).
    pub cuda_libs: Vec<PathBuf>,
    pub trace: TraceConfig,
}

/// A period given in seconds: zero, negative or not a number is an error
/// (a zero summary interval would spin the event loop).
pub fn seconds(what: &'static str, value: f64) -> Result<Duration, ConfigError> {
    if value.is_nan() || value <= 0.0 {
        return Err(ConfigError::Duration { what, value });
    }
    Duration::try_from_secs_f64(value).map_err(|_| ConfigError::Duration { what, value })
}

/// The scheduler source; a sampling period of zero is refused (the loop
/// would spin), and one over a second would place spells too coarsely to
/// explain a request.
fn sched_signals(source: SchedSource, period_ms: u64) -> Result<SchedSignals, ConfigError> {
    match source {
        SchedSource::Exact => Ok(SchedSignals::Exact),
        SchedSource::Sampled if (1..=1000).contains(&period_ms) => Ok(SchedSignals::Sampled {
            period: Duration::from_millis(period_ms),
        }),
        SchedSource::Sampled => Err(ConfigError::SchedPeriod(period_ms)),
    }
}

/// The settings file merged with the flags both modes take.
fn trace_config(
    file: &DaemonConfig,
    common: &flags::CommonArgs,
) -> Result<TraceConfig, ConfigError> {
    Ok(TraceConfig {
        listen: file.listen_addr()?,
        duration: common
            .duration
            .map(|d| seconds("--duration", d))
            .transpose()?,
        interval: seconds("the summary interval", file.interval_s)?,
        jsonl: file.jsonl.clone(),
        ringbuf_bytes: file.ringbuf_bytes,
        map_entries: file.kernel_maps.entries()?,
        ports: common.ports.clone(),
        sched_min_ns: file.sched_min_us.saturating_mul(1000),
        sched: sched_signals(
            common.sched.unwrap_or(file.sched),
            common.sched_sample_ms.unwrap_or(file.sched_sample_ms),
        )?,
        causes: causes_config(
            file.causes.clone(),
            common.causes_config.as_deref(),
            file.slo_ms,
        )?,
        stalls: stall_config(common.stall_threshold_ms.unwrap_or(file.stall_threshold_ms)),
        retry_window_ns: common
            .retry_window_ms
            .unwrap_or(file.retry_window_ms)
            .saturating_mul(1_000_000),
        nvml: (file.nvml.enabled && !common.no_nvml).then(|| NvmlConfig {
            period: Duration::from_millis(file.nvml.period_ms),
            library_path: common
                .nvml_lib
                .clone()
                .or_else(|| file.nvml.library.clone()),
            ..NvmlConfig::default()
        }),
        labels: LabelConfig {
            with_pid: file.labels.pid,
            max_sets: file.labels.max_sets,
            max_sets_per_pod: file.labels.max_sets_per_pod,
            retire_after: Duration::try_from_secs_f64(file.labels.retire_after_s).map_err(
                |_| ConfigError::Duration {
                    what: "labels.retire_after_s",
                    value: file.labels.retire_after_s,
                },
            )?,
            pod_log_dir: file.labels.pod_log_dir.clone(),
        },
        quotas: file.quotas,
        otlp: otlp_config(&file.otlp, common, |v| std::env::var_os(v))?.map(|o| OtlpConfig {
            attribute_sets_per_workload: file.quotas.otlp_attribute_sets,
            ..o
        }),
    })
}

/// A fixed stall threshold of `ms`, or the adaptive rule for 0.
fn stall_config(ms: u64) -> StallConfig {
    StallConfig {
        fixed_ns: (ms > 0).then(|| ms.saturating_mul(1_000_000)),
        ..StallConfig::default()
    }
}

/// OTLP export is on when an endpoint is named: by the flag, the file, or
/// the standard variables (which the exporter then reads itself).
fn otlp_config(
    file: &Otlp,
    common: &flags::CommonArgs,
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<Option<OtlpConfig>, ConfigError> {
    let endpoint = common
        .otlp_endpoint
        .clone()
        .or_else(|| file.endpoint.clone())
        .filter(|e| !e.is_empty());
    let from_env = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .any(|v| env(v).is_some_and(|e| !e.is_empty()));
    if endpoint.is_none() && !from_env {
        return Ok(None);
    }
    let sample_ratio = common.otlp_sample_ratio.unwrap_or(file.sample_ratio);
    if !(0.0..=1.0).contains(&sample_ratio) {
        return Err(ConfigError::SampleRatio(sample_ratio));
    }
    let (source, name) = match &file.protocol {
        Some(p) => ("otlp.protocol", Some(p.clone())),
        None => [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]
        .into_iter()
        .find_map(|v| Some((v, env(v)?.to_string_lossy().into_owned())))
        .map_or(("", None), |(v, p)| (v, Some(p))),
    };
    let protocol = match name {
        None => Protocol::Grpc,
        Some(p) => Protocol::parse(&p).ok_or(ConfigError::Protocol(source, p))?,
    };
    Ok(Some(OtlpConfig {
        endpoint,
        protocol,
        sample_ratio,
        queue_requests: file.queue_requests.max(1),
        gen_ai_operation_name: file.gen_ai_operation_name.clone(),
        ..OtlpConfig::default()
    }))
}

/// The attribution thresholds: defaults (or the settings file's), then the
/// JSON file, then the SLO.
fn causes_config(
    base: Option<CauseConfig>,
    file: Option<&Path>,
    slo_ms: u64,
) -> Result<CauseConfig, ConfigError> {
    let mut cfg = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
            serde_json::from_str(&text)
                .map_err(|e| ConfigError::ParseJson(path.to_path_buf(), e))?
        }
        None => base.unwrap_or_default(),
    };
    cfg.slow_ttft_ns = slo_ms.saturating_mul(1_000_000);
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_must_be_positive() {
        assert_eq!(seconds("x", 1.5).expect("ok"), Duration::from_millis(1500));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let err = seconds("--interval", bad).expect_err("refused").to_string();
            assert!(err.contains("--interval must be a positive"), "{err}");
        }
    }

    #[test]
    fn the_sampled_scheduler_source_needs_a_sane_period() {
        assert_eq!(
            sched_signals(SchedSource::Exact, 0).expect("exact"),
            SchedSignals::Exact
        );
        assert_eq!(
            sched_signals(SchedSource::Sampled, 10).expect("sampled"),
            SchedSignals::Sampled {
                period: Duration::from_millis(10)
            }
        );
        for bad in [0, 1001] {
            let err = sched_signals(SchedSource::Sampled, bad).expect_err("refused");
            assert!(err.to_string().contains("sched_sample_ms"), "{err}");
        }
        let file: DaemonConfig =
            toml::from_str("sched = \"sampled\"\nsched_sample_ms = 20").expect("parse");
        assert_eq!(
            (file.sched, file.sched_sample_ms),
            (SchedSource::Sampled, 20)
        );
    }

    #[test]
    fn the_slo_overrides_the_thresholds_file() {
        let dir = std::env::temp_dir().join(format!("ttft-causes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("causes.json");
        std::fs::write(&path, r#"{"slow_ttft_ns": 1, "queueing_min_ns": 7}"#).expect("write");
        let cfg = causes_config(None, Some(&path), 200).expect("parse");
        assert_eq!((cfg.slow_ttft_ns, cfg.queueing_min_ns), (200_000_000, 7));
        std::fs::write(&path, "{").expect("write");
        let err = causes_config(None, Some(&path), 200).expect_err("bad json");
        assert!(err.to_string().contains("causes.json"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The settings file's `stall_threshold_ms` unless the flag says
    /// otherwise; 0 is the adaptive rule.
    #[test]
    fn the_stall_threshold_from_the_file_or_the_flag() {
        let common = |ms: Option<u64>| flags::CommonArgs {
            duration: None,
            ports: vec![],
            causes_config: None,
            stall_threshold_ms: ms,
            retry_window_ms: None,
            no_nvml: true,
            nvml_lib: None,
            otlp_endpoint: None,
            otlp_sample_ratio: None,
            sched: None,
            sched_sample_ms: None,
        };
        let file = DaemonConfig {
            stall_threshold_ms: 300,
            ..DaemonConfig::default()
        };
        let fixed = |file: &DaemonConfig, ms| {
            trace_config(file, &common(ms))
                .expect("valid")
                .stalls
                .fixed_ns
        };
        assert_eq!(fixed(&file, None), Some(300_000_000));
        assert_eq!(fixed(&file, Some(0)), None);
        assert_eq!(fixed(&file, Some(150)), Some(150_000_000));
        assert_eq!(fixed(&DaemonConfig::default(), None), None);
        // The retry window: 10 s unless the file or the flag says.
        let window = |file: &DaemonConfig, ms| {
            let mut c = common(None);
            c.retry_window_ms = ms;
            trace_config(file, &c).expect("valid").retry_window_ns
        };
        assert_eq!(window(&DaemonConfig::default(), None), 10_000_000_000);
        let file = DaemonConfig {
            retry_window_ms: 2_000,
            ..DaemonConfig::default()
        };
        assert_eq!(window(&file, None), 2_000_000_000);
        assert_eq!(window(&file, Some(0)), 0);
    }

    #[test]
    fn otlp_is_on_when_an_endpoint_is_named_by_flag_file_or_variable() {
        let common = |endpoint: Option<&str>, ratio: Option<f64>| flags::CommonArgs {
            duration: None,
            ports: vec![],
            causes_config: None,
            stall_threshold_ms: None,
            retry_window_ms: None,
            no_nvml: true,
            nvml_lib: None,
            otlp_endpoint: endpoint.map(str::to_string),
            otlp_sample_ratio: ratio,
            sched: None,
            sched_sample_ms: None,
        };
        let no_env = |_: &str| None;
        let file = Otlp::default();
        assert_eq!(
            otlp_config(&file, &common(None, None), no_env).expect("ok"),
            None
        );
        let from_file = Otlp {
            endpoint: Some("http://file:4317".into()),
            protocol: None,
            sample_ratio: 0.25,
            queue_requests: 10,
            gen_ai_operation_name: "text_completion".into(),
        };
        let cfg = otlp_config(&from_file, &common(Some("http://flag:4317"), None), no_env)
            .expect("ok")
            .expect("on");
        assert_eq!(
            cfg.endpoint.as_deref(),
            Some("http://flag:4317"),
            "the flag wins"
        );
        assert_eq!((cfg.sample_ratio, cfg.queue_requests), (0.25, 10));
        assert_eq!(cfg.gen_ai_operation_name, "text_completion");
        let env = |v: &str| (v == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "http://env:4317".into());
        let cfg = otlp_config(&file, &common(None, Some(0.5)), env)
            .expect("ok")
            .expect("on from the variable");
        assert_eq!(
            cfg.endpoint, None,
            "the exporter reads the variables itself"
        );
        assert_eq!(cfg.sample_ratio, 0.5);
        let err = otlp_config(&file, &common(Some("http://x:4317"), Some(1.5)), no_env)
            .expect_err("refused");
        assert!(err.to_string().contains("between 0 and 1"), "{err}");
    }
}
