//! GPU readings from NVML (through nvml-wrapper), aligned with requests and episodes.
//!
//! [`start`] loads NVML, registers the `ttft_trace_gpu_*` metrics and starts a sampler on its
//! own thread. Every [`GpuSample`] is stamped with `clock_gettime(CLOCK_MONOTONIC)` in ns, the
//! clock of `bpf_ktime_get_ns`, so [`Sampler::window`] takes kernel event times directly.
//!
//! Without NVML (no library, no driver, no GPU) [`start`] returns [`Started::Unavailable`] with a
//! one-line reason and registers nothing: the GPU metrics are absent, not zero. An NVML call
//! failing while running is logged once (until it recovers), left out of the sample (`None`,
//! and its metric series removed: absent, not 0 and not stale) and retried next period.

mod metrics;
mod readings;
mod sampler;
mod throttle;
mod timeline;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use log::debug;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError as WrapperError;

pub use metrics::GpuMetrics;
pub use readings::GpuInfo;
pub use sampler::Sampler;
pub use throttle::{REASONS as THROTTLE_REASONS, ThrottleReasons};
pub use timeline::{GpuSample, SampleRing, WindowReadings};

/// The library nvml-wrapper loads when no path is configured.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// Sampler settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlConfig {
    /// Sampling period (default 100 ms).
    pub period: Duration,
    /// NVML library to load (nvml-wrapper's `lib_path`); None: `libnvidia-ml.so.1` from the
    /// dynamic loader's search path.
    pub library_path: Option<PathBuf>,
    /// How much history each GPU keeps (default 10 minutes).
    pub history: Duration,
    /// How often NVML's running-process lists are re-read (default 1 s; at least one period).
    pub process_refresh: Duration,
    /// For a window with no sample inside, the nearest sample before it counts when at most
    /// this much older than the window's start. None: 5 periods.
    pub window_fallback: Option<Duration>,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig {
            period: Duration::from_millis(100),
            library_path: None,
            history: Duration::from_secs(600),
            process_refresh: Duration::from_secs(1),
            window_fallback: None,
        }
    }
}

/// Errors of [`start`] that are not "NVML is unavailable" (that is [`Started::Unavailable`]).
#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("invalid NVML sampler configuration: {0}")]
    Config(String),
    #[error("registering the GPU metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("starting the NVML sampler thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// What [`start`] gives.
#[derive(Debug)]
pub enum Started {
    /// NVML works; the sampler runs until dropped.
    Sampler(Sampler),
    /// No NVML: a one-line reason for the user (printed once by the caller). Nothing was
    /// registered on the registry.
    Unavailable(String),
}

impl Started {
    /// The sampler, if NVML is available.
    pub fn sampler(self) -> Option<Sampler> {
        match self {
            Started::Sampler(s) => Some(s),
            Started::Unavailable(_) => None,
        }
    }
}

/// The NVML return-code name behind a wrapper error, where there is one.
fn nvml_code(e: &WrapperError) -> Option<&'static str> {
    Some(match e {
        WrapperError::Uninitialized => "NVML_ERROR_UNINITIALIZED",
        WrapperError::InvalidArg => "NVML_ERROR_INVALID_ARGUMENT",
        WrapperError::NotSupported => "NVML_ERROR_NOT_SUPPORTED",
        WrapperError::NoPermission => "NVML_ERROR_NO_PERMISSION",
        WrapperError::NotFound => "NVML_ERROR_NOT_FOUND",
        WrapperError::InsufficientPower => "NVML_ERROR_INSUFFICIENT_POWER",
        WrapperError::DriverNotLoaded => "NVML_ERROR_DRIVER_NOT_LOADED",
        WrapperError::Timeout => "NVML_ERROR_TIMEOUT",
        WrapperError::IrqIssue => "NVML_ERROR_IRQ_ISSUE",
        WrapperError::LibraryNotFound => "NVML_ERROR_LIBRARY_NOT_FOUND",
        WrapperError::FunctionNotFound => "NVML_ERROR_FUNCTION_NOT_FOUND",
        WrapperError::CorruptedInfoROM => "NVML_ERROR_CORRUPTED_INFOROM",
        WrapperError::GpuLost => "NVML_ERROR_GPU_IS_LOST",
        WrapperError::ResetRequired => "NVML_ERROR_RESET_REQUIRED",
        WrapperError::OperatingSystem => "NVML_ERROR_OPERATING_SYSTEM",
        WrapperError::LibRmVersionMismatch => "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
        WrapperError::InUse => "NVML_ERROR_IN_USE",
        WrapperError::InsufficientMemory => "NVML_ERROR_MEMORY",
        WrapperError::NoData => "NVML_ERROR_NO_DATA",
        WrapperError::Unknown => "NVML_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// The one-line reason for an `Nvml::init` failure.
fn init_failure_reason(library: &str, e: &WrapperError) -> String {
    match e {
        WrapperError::LibloadingError(le) => {
            format!("NVML unavailable: cannot load {library}: {le}")
        }
        WrapperError::FailedToLoadSymbol(s) => {
            format!("NVML unavailable: {library} has no usable nvmlInit_v2: {s}")
        }
        WrapperError::DriverNotLoaded => format!(
            "NVML unavailable: {library} loaded, but nvmlInit_v2 returned \
             NVML_ERROR_DRIVER_NOT_LOADED (the NVIDIA driver is not running)"
        ),
        other => match nvml_code(other) {
            Some(code) => {
                format!(
                    "NVML unavailable: {library} loaded, but nvmlInit_v2 returned {code} ({other})"
                )
            }
            None => format!("NVML unavailable: {library}: nvmlInit_v2 failed: {other}"),
        },
    }
}

/// Loads and initialises NVML (`library_path`, else [`DEFAULT_LIBRARY`] from the loader's
/// path) and lists the GPUs: (NVML, the library's name, the GPUs), or the one-line reason
/// NVML cannot be used.
fn open(library_path: Option<&Path>) -> Result<(Nvml, String, Vec<GpuInfo>), String> {
    let library = match library_path {
        Some(p) => p.display().to_string(),
        None => DEFAULT_LIBRARY.to_string(),
    };
    let mut builder = Nvml::builder();
    builder.lib_path(library_path.map_or(OsStr::new(DEFAULT_LIBRARY), Path::as_os_str));
    let nvml = builder
        .init()
        .map_err(|e| init_failure_reason(&library, &e))?;
    let count = match nvml.device_count() {
        Ok(0) => {
            return Err(format!(
                "NVML unavailable: {library} loaded, but it reports no NVIDIA GPU"
            ));
        }
        Ok(n) => n,
        Err(e) => {
            let code = nvml_code(&e).unwrap_or("error");
            return Err(format!(
                "NVML unavailable: {library} loaded, but nvmlDeviceGetCount_v2 returned {code} ({e})"
            ));
        }
    };
    let mut gpus = Vec::with_capacity(count as usize);
    for index in 0..count {
        let (uuid, name) = match nvml.device_by_index(index) {
            Ok(d) => (
                d.uuid().unwrap_or_else(|_| "unknown".into()),
                d.name().unwrap_or_else(|_| "unknown".into()),
            ),
            Err(e) => {
                log::warn!("NVML: no handle for GPU {index} yet ({e}); will retry");
                ("unknown".into(), "unknown".into())
            }
        };
        gpus.push(GpuInfo { index, uuid, name });
    }
    Ok((nvml, library, gpus))
}

/// What `ttft-trace check` reports of NVML: the library and its GPUs, or why not.
pub fn probe(library_path: Option<&Path>) -> Result<(String, Vec<GpuInfo>), String> {
    open(library_path).map(|(_, library, gpus)| (library, gpus))
}

/// Loads NVML, registers the GPU metrics on `registry` and starts the sampler thread.
///
/// `Ok(Started::Unavailable(reason))` when NVML cannot be used (library missing, driver not
/// loaded, no GPU); nothing is registered then. `Err` only for a bad configuration, metrics
/// already registered on `registry`, or a thread that cannot start.
pub fn start(cfg: &NvmlConfig, registry: &prometheus::Registry) -> Result<Started, NvmlError> {
    if cfg.period.is_zero() {
        return Err(NvmlError::Config("period must be above zero".into()));
    }
    let (nvml, library, gpus) = match open(cfg.library_path.as_deref()) {
        Ok(opened) => opened,
        Err(reason) => {
            debug!("{reason}");
            return Ok(Started::Unavailable(reason));
        }
    };

    let period_ns = u64::try_from(cfg.period.as_nanos()).unwrap_or(u64::MAX);
    let history_ns = u64::try_from(cfg.history.as_nanos()).unwrap_or(u64::MAX);
    let ring_len = usize::try_from(history_ns / period_ns)
        .unwrap_or(usize::MAX)
        .saturating_add(16)
        .min(1 << 22);
    let fallback = cfg.window_fallback.unwrap_or(cfg.period * 5);
    let process_every = (cfg.process_refresh.as_nanos() / cfg.period.as_nanos()).max(1);
    let params = sampler::Params {
        period: cfg.period,
        history_ns,
        ring_len,
        fallback_max_age_ns: u64::try_from(fallback.as_nanos()).unwrap_or(u64::MAX),
        process_every: u64::try_from(process_every).unwrap_or(u64::MAX),
    };

    let metrics = GpuMetrics::register(registry)?;
    match Sampler::spawn(
        nvml,
        gpus,
        params,
        metrics.clone(),
        registry.clone(),
        library,
    ) {
        Ok(s) => Ok(Started::Sampler(s)),
        Err(e) => {
            metrics.unregister(registry);
            Err(NvmlError::Spawn(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config() {
        let c = NvmlConfig::default();
        assert_eq!(c.period, Duration::from_millis(100));
        assert_eq!(c.library_path, None);
        assert_eq!(c.history, Duration::from_secs(600));
    }

    #[test]
    fn zero_period_is_an_error() {
        let cfg = NvmlConfig {
            period: Duration::ZERO,
            ..Default::default()
        };
        assert!(matches!(
            start(&cfg, &prometheus::Registry::new()),
            Err(NvmlError::Config(_))
        ));
    }

    #[test]
    fn reasons_name_the_library_and_the_code() {
        let r = init_failure_reason("/x/libnvidia-ml.so.1", &WrapperError::DriverNotLoaded);
        assert!(r.contains("/x/libnvidia-ml.so.1"));
        assert!(r.contains("NVML_ERROR_DRIVER_NOT_LOADED"));
        let r = init_failure_reason("lib", &WrapperError::NoPermission);
        assert!(r.contains("NVML_ERROR_NO_PERMISSION"));
    }

    #[test]
    fn sampler_can_be_shared_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Sampler>();
        send_sync::<WindowReadings>();
        send_sync::<GpuSample>();
    }
}
