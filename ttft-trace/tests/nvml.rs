//! NVML sampler tests without a GPU: a scripted test NVML library (tests/fixtures/nvml/
//! nvml_stub.c, built here with gcc) loaded through `NvmlConfig::library_path`, and the real
//! `libnvidia-ml.so.1` from Debian's `libnvidia-ml1` (fetched by
//! tests/fixtures/nvml/fetch-real-nvml.sh), which must give the clean no-NVML path here.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus::Registry;
use ttft_trace::nvml::{self, NvmlConfig, Sampler, Started};

const MS: u64 = 1_000_000;
const GIB: u64 = 1 << 30;

fn require_fixtures() -> bool {
    std::env::var("TTFT_TRACE_REQUIRE_FIXTURES").is_ok_and(|v| v == "1")
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate dir has a parent")
        .to_path_buf()
}

/// Cargo's scratch directory for integration tests (under target/).
fn scratch_root() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nvml")
}

/// A scratch directory of this test, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = scratch_root().join(format!("{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds the stub library once per test binary; None (with the reason printed) without gcc.
fn stub_library() -> Option<&'static Path> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let src = repo_root().join("tests/fixtures/nvml/nvml_stub.c");
        let dir = scratch_root().join("build");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = dir.join("libnvml_stub.so");
        let status = std::process::Command::new("gcc")
            .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
            .arg(&out)
            .arg(&src)
            .arg("-lpthread")
            .status()
            .map_err(|e| format!("cannot run gcc: {e}"))?;
        if !status.success() {
            return Err(format!("gcc failed on {}: {status}", src.display()));
        }
        Ok(out)
    });
    match built {
        Ok(p) => Some(p.as_path()),
        Err(e) if require_fixtures() => panic!("test NVML library: {e}"),
        Err(e) => {
            eprintln!("SKIP: test NVML library not built: {e}");
            None
        }
    }
}

/// A private copy of the stub (its own inode, hence its own instance and state when dlopened)
/// with its script next to it.
struct Stub {
    dir: TempDir,
    lib: PathBuf,
}

impl Stub {
    fn new(name: &str, script: &str) -> Option<Stub> {
        let built = stub_library()?;
        let dir = TempDir::new(name);
        let lib = dir.0.join("libnvidia-ml.so.1");
        std::fs::copy(built, &lib).expect("copy stub");
        let stub = Stub { dir, lib };
        stub.script(script);
        Some(stub)
    }

    /// Replaces the script atomically; the stub re-reads it on its next call.
    fn script(&self, text: &str) {
        let tmp = self.dir.0.join("script.tmp");
        std::fs::write(&tmp, text).expect("write script");
        let mut target = self.lib.clone().into_os_string();
        target.push(".script");
        std::fs::rename(&tmp, target).expect("rename script");
    }

    fn config(&self, period_ms: u64) -> NvmlConfig {
        NvmlConfig {
            period: Duration::from_millis(period_ms),
            library_path: Some(self.lib.clone()),
            process_refresh: Duration::from_millis(2 * period_ms),
            ..Default::default()
        }
    }
}

fn start_sampler(cfg: &NvmlConfig, registry: &Registry) -> Sampler {
    match nvml::start(cfg, registry).expect("start") {
        Started::Sampler(s) => s,
        Started::Unavailable(r) => panic!("NVML unavailable with the stub: {r}"),
    }
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn exposition(reg: &Registry) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&reg.gather())
        .expect("encode")
}

/// The series lines of one family whose labels include `uuid`.
fn series(reg: &Registry, family: &str, uuid: &str) -> Vec<String> {
    exposition(reg)
        .lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) && l.contains(uuid))
        .map(str::to_string)
        .collect()
}

const GPU_FAMILIES: &[&str] = &[
    "ttft_trace_gpu_sm_clock_hertz",
    "ttft_trace_gpu_memory_clock_hertz",
    "ttft_trace_gpu_memory_used_bytes",
    "ttft_trace_gpu_memory_total_bytes",
    "ttft_trace_gpu_utilization_ratio",
    "ttft_trace_gpu_power_watts",
    "ttft_trace_gpu_temperature_celsius",
    "ttft_trace_gpu_throttle_active",
];

fn assert_no_gpu_metrics(reg: &Registry) {
    let text = exposition(reg);
    assert!(
        !text.contains("ttft_trace_gpu_"),
        "GPU metrics must be absent without NVML, got:\n{text}"
    );
}

/// Captures log records (the failure test counts its warnings).
struct Capture(Mutex<Vec<(log::Level, String)>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        if let Ok(mut v) = self.0.lock() {
            v.push((record.level(), record.args().to_string()));
        }
    }
    fn flush(&self) {}
}

static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));

fn capture_logs() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if log::set_logger(&CAPTURE).is_ok() {
            log::set_max_level(log::LevelFilter::Info);
        }
    });
}

fn logged(level: log::Level, needles: &[&str]) -> Vec<String> {
    CAPTURE
        .0
        .lock()
        .map(|v| {
            v.iter()
                .filter(|(l, m)| *l == level && needles.iter().all(|n| m.contains(n)))
                .map(|(_, m)| m.clone())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn window_readings_line_up_with_the_scripted_timeline() {
    let t0 = ttft_trace::host::clock::monotonic_ns();
    let total = 80 * GIB;
    let peak = total / 100 * 95;
    let script = format!(
        "t0 {t0}
gpus 1
uuid 0 GPU-align-0
name 0 NVIDIA H100 80GB HBM3 (stub)
at 0 0 sm=1980 mem=2619 total={total} used={used} util=35 memutil=12 power=250000 temp=55 throttle=0x1
at 300 0 sm=1200 throttle=0x20 temp=88 util=100 power=400500
at 700 0 sm=1980 throttle=0 temp=70 util=60
at 900 0 used={peak}
at 1100 0 used={used}
",
        used = 32 * GIB
    );
    let Some(stub) = Stub::new("align", &script) else {
        return;
    };
    let reg = Registry::new();
    let sampler = start_sampler(&stub.config(20), &reg);

    let gpus = sampler.gpus();
    assert_eq!(gpus.len(), 1);
    assert_eq!(gpus[0].index, 0);
    assert_eq!(gpus[0].uuid, "GPU-align-0");
    assert_eq!(gpus[0].name, "NVIDIA H100 80GB HBM3 (stub)");

    wait_until("samples past t0+1.3 s", Duration::from_secs(20), || {
        sampler.latest(0).is_some_and(|s| s.t_ns > t0 + 1_300 * MS)
    });

    // Calm start: full clock, only the idle "reason".
    let calm = sampler
        .window(Some(0), t0 + 100 * MS, t0 + 250 * MS)
        .expect("calm");
    eprintln!(
        "calm window: {}",
        serde_json::to_string(&calm).expect("json")
    );
    assert!(calm.samples >= 1, "{calm:?}");
    assert_eq!(calm.sm_clock_min_hz, Some(1_980_000_000));
    assert_eq!(calm.mem_clock_min_hz, Some(2_619_000_000));
    assert_eq!(calm.throttle_reasons, vec!["gpu_idle"]);
    assert!(!calm.throttled());
    assert_eq!(calm.utilization_max_ratio, Some(0.35));
    assert_eq!(calm.power_max_watts, Some(250.0));
    assert_eq!(calm.temperature_max_celsius, Some(55.0));

    // Inside the throttled period: the low clock and the reason.
    let hot = sampler
        .window(Some(0), t0 + 400 * MS, t0 + 600 * MS)
        .expect("hot");
    eprintln!(
        "throttled window: {}",
        serde_json::to_string(&hot).expect("json")
    );
    assert!(hot.samples >= 1, "{hot:?}");
    assert_eq!(hot.sm_clock_min_hz, Some(1_200_000_000));
    assert_eq!(hot.throttle_reasons, vec!["sw_thermal_slowdown"]);
    assert!(hot.throttled());
    assert_eq!(hot.temperature_max_celsius, Some(88.0));
    assert_eq!(hot.power_max_watts, Some(400.5));
    assert_eq!(hot.utilization_max_ratio, Some(1.0));
    assert!(!hot.memory_above(0.9));

    // A window spanning the change sees both the low clock and the full one's reasons.
    let span = sampler
        .window(Some(0), t0 + 200 * MS, t0 + 400 * MS)
        .expect("span");
    assert_eq!(span.sm_clock_min_hz, Some(1_200_000_000));
    assert_eq!(
        span.throttle_reasons,
        vec!["gpu_idle", "sw_thermal_slowdown"]
    );

    // Over the memory peak: the highest memory used and its share of total.
    let peak_w = sampler
        .window(Some(0), t0 + 950 * MS, t0 + 1_050 * MS)
        .expect("peak");
    eprintln!(
        "memory-peak window: {}",
        serde_json::to_string(&peak_w).expect("json")
    );
    assert_eq!(peak_w.mem_used_max_bytes, Some(peak));
    assert_eq!(peak_w.mem_total_bytes, Some(total));
    let ratio = peak_w.mem_used_max_ratio.expect("ratio");
    assert!((ratio - 0.95).abs() < 1e-6, "{ratio}");
    assert!(peak_w.memory_above(0.9));
    assert_eq!(peak_w.sm_clock_min_hz, Some(1_980_000_000));
    assert!(peak_w.throttle_reasons.is_empty());
    let before_peak = sampler
        .window(Some(0), t0 + 750 * MS, t0 + 850 * MS)
        .expect("before");
    assert_eq!(before_peak.mem_used_max_bytes, Some(32 * GIB));

    // A window shorter than a period with no sample inside uses the one just before.
    let short = sampler
        .window(Some(0), t0 + 450 * MS, t0 + 450 * MS + 1_000)
        .expect("short");
    assert_eq!(short.samples, 1);
    assert_eq!(short.sm_clock_min_hz, Some(1_200_000_000));

    // All GPUs together (one here) equals GPU 0; an unknown GPU has nothing.
    let all = sampler
        .window(None, t0 + 400 * MS, t0 + 600 * MS)
        .expect("all");
    assert_eq!(all.sm_clock_min_hz, hot.sm_clock_min_hz);
    assert_eq!(all.gpus, vec![0]);
    assert!(sampler.window(Some(7), t0, t0 + 1_000 * MS).is_none());
    // Before the sampler started: nothing.
    assert!(sampler.window(Some(0), 1, 2).is_none());

    // Samples are on CLOCK_MONOTONIC, in order, about one period apart.
    let samples = sampler.samples(0, t0, t0 + 1_200 * MS);
    assert!(samples.len() >= 10, "{} samples", samples.len());
    assert!(samples.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
    let now = ttft_trace::host::clock::monotonic_ns();
    assert!(samples.iter().all(|s| s.t_ns > t0 && s.t_ns < now));

    // Metrics: base units, gpu and uuid labels, current values.
    for family in GPU_FAMILIES {
        assert!(
            !series(&reg, family, "GPU-align-0").is_empty(),
            "{family} missing"
        );
    }
    let labels = r#"{gpu="0",uuid="GPU-align-0"}"#;
    let text = exposition(&reg);
    for line in [
        format!("ttft_trace_gpu_sm_clock_hertz{labels} 1980000000"),
        format!("ttft_trace_gpu_memory_clock_hertz{labels} 2619000000"),
        format!("ttft_trace_gpu_memory_total_bytes{labels} {total}"),
        format!("ttft_trace_gpu_memory_used_bytes{labels} {}", 32 * GIB),
        format!("ttft_trace_gpu_utilization_ratio{labels} 0.6"),
        format!("ttft_trace_gpu_power_watts{labels} 400.5"),
        format!("ttft_trace_gpu_temperature_celsius{labels} 70"),
        r#"ttft_trace_gpu_throttle_active{gpu="0",reason="sw_thermal_slowdown",uuid="GPU-align-0"} 0"#
            .to_string(),
        r#"ttft_trace_gpu_throttle_active{gpu="0",reason="gpu_idle",uuid="GPU-align-0"} 0"#
            .to_string(),
    ] {
        assert!(text.contains(&line), "missing `{line}` in\n{text}");
    }
    assert_eq!(
        series(&reg, "ttft_trace_gpu_throttle_active", "GPU-align-0").len(),
        9
    );

    // Dropping the sampler stops it and removes the GPU metrics.
    drop(sampler);
    assert_no_gpu_metrics(&reg);
}

#[test]
fn processes_map_to_their_gpu() {
    let script = "gpus 2
uuid 0 GPU-proc-0
uuid 1 GPU-proc-1
at 0 * sm=1980 mem=2619 total=85899345920 used=1073741824 util=0 power=70000 temp=40
proc 1 compute 4242 17179869184
proc 0 graphics 777
proc 0 compute 5000 1073741824
proc 1 compute 5000 1073741824
";
    let Some(stub) = Stub::new("proc", script) else {
        return;
    };
    let reg = Registry::new();
    let sampler = start_sampler(&stub.config(10), &reg);
    assert_eq!(
        sampler
            .gpus()
            .iter()
            .map(|g| g.uuid.as_str())
            .collect::<Vec<_>>(),
        vec!["GPU-proc-0", "GPU-proc-1"]
    );
    wait_until("a process refresh", Duration::from_secs(20), || {
        sampler.counters().1 >= 1
    });
    assert_eq!(sampler.gpu_of_pid(4242), Some(1));
    assert_eq!(sampler.gpu_of_pid(777), Some(0));
    assert_eq!(sampler.gpu_of_pid(5000), Some(0));
    assert_eq!(sampler.gpus_of_pid(5000), vec![0, 1]);
    assert_eq!(sampler.gpu_of_pid(1), None);

    // The worker moves to GPU 0; the map follows on a later refresh.
    stub.script(&script.replace("proc 1 compute 4242", "proc 0 compute 4242"));
    let seen = sampler.counters().1;
    wait_until(
        "two more process refreshes",
        Duration::from_secs(20),
        || sampler.counters().1 >= seen + 2,
    );
    assert_eq!(sampler.gpu_of_pid(4242), Some(0));

    // Per-GPU windows stay apart.
    let now = ttft_trace::host::clock::monotonic_ns();
    let w1 = sampler.window(Some(1), now - 200 * MS, now).expect("gpu 1");
    assert_eq!(w1.gpus, vec![1]);
    let both = sampler.window(None, now - 200 * MS, now).expect("both");
    assert_eq!(both.gpus, vec![0, 1]);
    assert!(both.samples > w1.samples);
}

#[test]
fn a_failing_call_is_logged_once_left_out_and_retried() {
    capture_logs();
    let good = "gpus 1
uuid 0 GPU-fail-0
at 0 0 sm=1980 mem=2619 total=85899345920 used=34359738368 util=50 power=300000 temp=60 throttle=0
";
    // nvmlDeviceGetClockInfo(NVML_CLOCK_SM) answers NVML_ERROR_GPU_IS_LOST (15) until cleared.
    let failing = format!("{good}fail 0 - 0 sm_clock 15\n");
    let Some(stub) = Stub::new("fail", &failing) else {
        return;
    };
    let reg = Registry::new();
    let sampler = start_sampler(&stub.config(10), &reg);
    wait_until("8 samples", Duration::from_secs(20), || {
        sampler.counters().0 >= 8
    });

    // The failed reading is left out of every sample (None, never 0); the others are there.
    let latest = sampler.latest(0).expect("sample");
    assert_eq!(latest.sm_clock_hz, None);
    assert_eq!(latest.mem_clock_hz, Some(2_619_000_000));
    assert_eq!(latest.mem_used_bytes, Some(32 * GIB));
    let w = sampler.window(Some(0), 0, u64::MAX).expect("window");
    assert_eq!(w.sm_clock_min_hz, None);
    assert_eq!(w.mem_clock_min_hz, Some(2_619_000_000));

    // Its metric series is absent (not 0, not stale); the others are present; errors counted.
    assert!(series(&reg, "ttft_trace_gpu_sm_clock_hertz", "GPU-fail-0").is_empty());
    assert_eq!(
        series(&reg, "ttft_trace_gpu_memory_clock_hertz", "GPU-fail-0").len(),
        1
    );
    let errors = series(&reg, "ttft_trace_gpu_reading_errors_total", "GPU-fail-0");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains(r#"reading="sm_clock""#));
    let n: u64 = errors[0]
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("counter value");
    assert!(n >= 7, "{n} errors counted");

    // Logged once, with the call, the GPU and NVML's error, however many periods it failed.
    let warns = logged(log::Level::Warn, &["GPU-fail-0", "sm_clock"]);
    assert_eq!(warns.len(), 1, "{warns:?}");
    assert!(warns[0].contains("nvmlDeviceGetClockInfo"), "{}", warns[0]);
    eprintln!("logged: {}", warns[0]);

    // The call works again: retried next period, reading and series come back, logged once.
    stub.script(good);
    wait_until("the SM clock back", Duration::from_secs(20), || {
        sampler.latest(0).is_some_and(|s| s.sm_clock_hz.is_some())
    });
    assert_eq!(
        series(&reg, "ttft_trace_gpu_sm_clock_hertz", "GPU-fail-0"),
        vec![r#"ttft_trace_gpu_sm_clock_hertz{gpu="0",uuid="GPU-fail-0"} 1980000000"#]
    );
    let samples_then = sampler.counters().0;
    wait_until("more samples", Duration::from_secs(20), || {
        sampler.counters().0 >= samples_then + 3
    });
    assert_eq!(
        logged(log::Level::Info, &["GPU-fail-0", "works again"]).len(),
        1
    );
    assert_eq!(logged(log::Level::Warn, &["GPU-fail-0"]).len(), 1);
}

#[test]
fn missing_library_is_unavailable_and_names_the_path() {
    let dir = TempDir::new("missing");
    let path = dir.0.join("no-such-dir/libnvidia-ml.so.1");
    let reg = Registry::new();
    let cfg = NvmlConfig {
        library_path: Some(path.clone()),
        ..Default::default()
    };
    match nvml::start(&cfg, &reg).expect("start") {
        Started::Unavailable(reason) => {
            eprintln!("reason: {reason}");
            assert!(reason.contains(&path.display().to_string()), "{reason}");
            assert!(reason.starts_with("NVML unavailable"), "{reason}");
        }
        Started::Sampler(_) => panic!("a missing library gave a sampler"),
    }
    assert_no_gpu_metrics(&reg);
}

#[test]
fn driver_not_loaded_and_no_gpu_are_unavailable() {
    let Some(stub) = Stub::new("noinit", "init 9\n") else {
        return;
    };
    let reg = Registry::new();
    match nvml::start(&stub.config(100), &reg).expect("start") {
        Started::Unavailable(reason) => {
            eprintln!("reason: {reason}");
            assert!(reason.contains("NVML_ERROR_DRIVER_NOT_LOADED"), "{reason}");
            assert!(reason.contains(&stub.lib.display().to_string()), "{reason}");
        }
        Started::Sampler(_) => panic!("driver-not-loaded gave a sampler"),
    }
    assert_no_gpu_metrics(&reg);

    stub.script("gpus 0\n");
    match nvml::start(&stub.config(100), &reg).expect("start") {
        Started::Unavailable(reason) => {
            eprintln!("reason: {reason}");
            assert!(reason.contains("no NVIDIA GPU"), "{reason}");
        }
        Started::Sampler(_) => panic!("zero GPUs gave a sampler"),
    }
    assert_no_gpu_metrics(&reg);
}

#[test]
fn metrics_cannot_be_registered_twice_on_one_registry() {
    let Some(stub) = Stub::new("twice", "gpus 1\nat 0 0 sm=1000 total=1000 used=10\n") else {
        return;
    };
    let reg = Registry::new();
    let first = start_sampler(&stub.config(50), &reg);
    assert!(matches!(
        nvml::start(&stub.config(50), &reg),
        Err(nvml::NvmlError::Metrics(_))
    ));
    drop(first);
    // Once the first sampler is gone, the registry is free again.
    let again = start_sampler(&stub.config(50), &reg);
    drop(again);
}

/// The real libnvidia-ml.so.1 unpacked by tests/fixtures/nvml/fetch-real-nvml.sh.
fn real_library() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TTFT_TRACE_REAL_NVML") {
        return Some(PathBuf::from(p));
    }
    // The same cache as `cargo xtask setup`: $TTFT_TRACE_CACHE or ~/.cache/ttft-trace.
    let cache = std::env::var_os("TTFT_TRACE_CACHE").map_or_else(
        || {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            PathBuf::from(home).join(".cache/ttft-trace")
        },
        PathBuf::from,
    );
    let root = cache.join("libnvidia-ml1/root");
    let candidates = [
        "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.1",
        "usr/lib/aarch64-linux-gnu/nvidia/current/libnvidia-ml.so.1",
        "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    ];
    candidates.iter().map(|c| root.join(c)).find(|p| p.exists())
}

fn nvidia_driver_present() -> bool {
    Path::new("/proc/driver/nvidia").exists() || Path::new("/dev/nvidiactl").exists()
}

#[test]
fn real_libnvidia_ml_without_a_driver_is_unavailable() {
    let Some(lib) = real_library().filter(|p| p.exists()) else {
        let msg = "real libnvidia-ml.so.1 not found: run tests/fixtures/nvml/fetch-real-nvml.sh \
                   (or cargo xtask setup)";
        if require_fixtures() {
            panic!("{msg}");
        }
        eprintln!("SKIP: {msg}");
        return;
    };
    let reg = Registry::new();
    let cfg = NvmlConfig {
        library_path: Some(lib.clone()),
        ..Default::default()
    };
    match nvml::start(&cfg, &reg).expect("start") {
        Started::Unavailable(reason) => {
            eprintln!("real libnvidia-ml.so.1 ({}): {reason}", lib.display());
            assert!(reason.contains(&lib.display().to_string()), "{reason}");
            if !nvidia_driver_present() {
                assert!(reason.contains("NVML_ERROR_DRIVER_NOT_LOADED"), "{reason}");
            }
            assert_no_gpu_metrics(&reg);
        }
        Started::Sampler(s) => {
            // Only possible on a host with an NVIDIA driver that matches this library.
            assert!(nvidia_driver_present(), "a sampler without a driver?");
            eprintln!("real libnvidia-ml.so.1 works here: {:?}", s.gpus());
        }
    }
}

/// The default library (`libnvidia-ml.so.1` from the loader's path): unavailable on a host
/// without an NVIDIA driver; on a GPU host, prints the real readings and checks them.
#[test]
fn default_library_real_gpu_or_clean_unavailable() {
    let reg = Registry::new();
    let cfg = NvmlConfig {
        period: Duration::from_millis(50),
        ..Default::default()
    };
    let sampler = match nvml::start(&cfg, &reg).expect("start") {
        Started::Unavailable(reason) => {
            eprintln!("default library: {reason}");
            assert!(reason.contains("libnvidia-ml.so.1"), "{reason}");
            assert_no_gpu_metrics(&reg);
            return;
        }
        Started::Sampler(s) => s,
    };
    let t0 = ttft_trace::host::clock::monotonic_ns();
    std::thread::sleep(Duration::from_millis(500));
    for g in sampler.gpus() {
        let samples = sampler.samples(g.index, t0, u64::MAX);
        let w = sampler.window(Some(g.index), t0, u64::MAX).expect("window");
        eprintln!(
            "GPU {} {} {}: {} samples, latest {:?}, window {}",
            g.index,
            g.uuid,
            g.name,
            samples.len(),
            samples.last(),
            serde_json::to_string(&w).unwrap_or_default()
        );
        assert!(samples.len() >= 5);
        assert!(
            g.uuid.starts_with("GPU-") || g.uuid.starts_with("MIG-"),
            "{}",
            g.uuid
        );
        assert!(w.mem_total_bytes.unwrap_or(0) > 0);
        assert!(w.sm_clock_min_hz.unwrap_or(0) > 0);
    }
    eprintln!("{}", exposition(&reg));
}
