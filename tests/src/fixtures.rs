//! GPU-free CUDA fixtures for the ttft-trace tests.
//!
//! `tests/build.rs` compiles the C sources of `tests/fixtures/` with gcc into
//! [`fixture_dir()`] (`<target dir>/fixtures/`):
//!
//! | file | what it is |
//! | --- | --- |
//! | `libcuda.so.1` | stub driver: real CUDA 12 names and signatures, emulated device time |
//! | `libcudart.so.12` | stub runtime on top of the stub driver; exports are `name@@libcudart.so.12` |
//! | `libcudart-4e0b8a1f.so.12` | the same runtime under a wheel-style hashed soname |
//! | `libworkload_ext.so` | "extension module": workload + the runtime compiled in, runtime symbols hidden (`.symtab` only), exports only `workload_main` |
//! | `workload` | the workload linked to `libcudart.so.12` + `libcuda.so.1` |
//! | `workload_hashed` | the workload linked to `libcudart-4e0b8a1f.so.12` + `libcuda.so.1` |
//! | `workload_dl` | links no CUDA library; `dlopen`s the runtime after `--dlopen-delay-ms` |
//! | `workload_ext_host` | links no CUDA library; `dlopen`s `libworkload_ext.so` and calls `workload_main` |
//! | `workload_real` | linked to the real `libcudart.so.12` of the wheel (only when [`real_cudart()`] was found at build time); every call fails with 35 here, use `--ignore-errors` |
//! | `abi_check`, `abi_check_real` | print struct sizes/offsets and enum values of our header / of the real CUDA headers |
//!
//! Emulated device (stub driver): one in-order queue per process, whatever the
//! stream. A launch adds its kernel's duration (`--kernel-us`), a copy adds
//! `bytes / TTFT_STUB_BW_GBPS` (GB/s, default 25); synchronising calls sleep
//! until the queue drains, synchronous copies until their own copy is done.
//! Env `TTFT_STUB_KERNEL_NS` sets the duration of launches whose function is
//! not a stub kernel descriptor.
//!
//! Each workload episode is (optional H2D copy) → K launches → D2H copy →
//! completion; its ground truth is one line of the truth JSONL, read with
//! [`read_truth`]. Timestamps are `CLOCK_MONOTONIC` nanoseconds, the clock of
//! `bpf_ktime_get_ns()`.

use std::{
    ffi::{OsStr, OsString},
    fmt, fs,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    str::FromStr,
    sync::atomic::{AtomicU64, Ordering},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Deserialize;

/// File name of the stub driver.
pub const STUB_CUDA: &str = "libcuda.so.1";
/// File name (and soname) of the stub runtime.
pub const STUB_CUDART: &str = "libcudart.so.12";
/// File name (and soname) of the stub runtime as Python wheels name it.
pub const STUB_CUDART_HASHED: &str = "libcudart-4e0b8a1f.so.12";
/// The extension module with a hidden, statically linked stub runtime.
pub const EXT_MODULE: &str = "libworkload_ext.so";
/// Version node of every runtime export, stub and real.
pub const CUDART_VERSION_NODE: &str = "libcudart.so.12";
/// First 8 bytes of a stub kernel / graph descriptor (`struct ttft_stub_kernel`
/// in `cuda_api.h`): the bytes "TTFTKERN".
pub const STUB_KERNEL_MAGIC: u64 = 0x4e52_454b_5446_5454;
/// `cudaErrorInsufficientDriver`: what the real runtime returns without a GPU.
pub const CUDA_ERROR_INSUFFICIENT_DRIVER: i32 = 35;
/// Where the real runtime sits inside the cache directory.
pub const REAL_CUDART_IN_CACHE: &str =
    "nvidia-cuda-runtime-cu12-12.9.79/nvidia/cuda_runtime/lib/libcudart.so.12";

/// The directory holding the built fixtures: env `TTFT_FIXTURE_DIR` at run
/// time if set, else the one `tests/build.rs` built into.
pub fn fixture_dir() -> PathBuf {
    match std::env::var_os("TTFT_FIXTURE_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("TTFT_FIXTURE_DIR")),
    }
}

/// Path of one built fixture, e.g. `fixture("libcudart.so.12")` (not checked).
pub fn fixture(name: &str) -> PathBuf {
    fixture_dir().join(name)
}

/// Like [`fixture`], but an error naming the file when it was not built.
pub fn existing_fixture(name: &str) -> Result<PathBuf> {
    let p = fixture(name);
    if p.exists() {
        Ok(p)
    } else {
        bail!(
            "fixture {} not found (built by tests/build.rs: `cargo build -p ttft-trace-tests`)",
            p.display()
        )
    }
}

/// The cache directory: `$TTFT_TRACE_CACHE`, else `$HOME/.cache/ttft-trace`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TTFT_TRACE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/ttft-trace")
}

/// Where the real `libcudart.so.12` is expected, whether or not it is there:
/// `$TTFT_TRACE_REAL_CUDART`, else `<cache_dir>/`[`REAL_CUDART_IN_CACHE`].
pub fn real_cudart_path() -> PathBuf {
    match std::env::var_os("TTFT_TRACE_REAL_CUDART") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => cache_dir().join(REAL_CUDART_IN_CACHE),
    }
}

/// The real runtime, or the reason it cannot be used (missing file, or
/// `workload_real` not built because the file appeared after the build).
pub fn real_cudart_status() -> Result<PathBuf, String> {
    let p = real_cudart_path();
    if !p.is_file() {
        return Err(format!(
            "real libcudart.so.12 not found at {} (set TTFT_TRACE_REAL_CUDART, or unpack the \
             nvidia-cuda-runtime-cu12 12.9.79 wheel into {})",
            p.display(),
            cache_dir().display()
        ));
    }
    if !fixture(Variant::Real.binary()).exists() {
        return Err(format!(
            "{} exists but workload_real was not built: rebuild ttft-trace-tests",
            p.display()
        ));
    }
    Ok(p)
}

/// The real runtime if it is there and `workload_real` was built against it;
/// `None` (with the reason on stderr) otherwise, so `test` can skip, or a
/// failure under `TTFT_TRACE_REQUIRE_FIXTURES` (`cargo xtask setup` fetches
/// the runtime).
pub fn real_cudart(test: &str) -> Option<PathBuf> {
    match real_cudart_status() {
        Ok(p) => Some(p),
        Err(why) => {
            crate::skip_or_fail(test, &format!("real CUDA runtime unavailable: {why}"));
            None
        }
    }
}

/// How an episode launches work and waits for its D2H copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Style {
    /// `cudaLaunchKernel` ×K, `cudaMemcpy(DeviceToHost)`.
    Sync,
    /// `cudaLaunchKernel` ×K, `cudaMemcpyAsync(D2H)`, `cudaStreamSynchronize`.
    Stream,
    /// `cudaLaunchKernel` ×K, `cudaMemcpyAsync`, `cudaEventRecord`, `cudaEventSynchronize`.
    Event,
    /// `cudaLaunchKernel` ×K, `cudaMemcpyAsync`, `cudaDeviceSynchronize`.
    Device,
    /// `cudaGraphLaunch` ×K, `cudaMemcpyAsync`, `cudaStreamSynchronize`.
    Graph,
    /// `cudaLaunchKernelExC` ×K, `cudaMemcpyAsync`, `cudaStreamSynchronize`.
    LaunchEx,
    /// Driver API only: `cuLaunchKernel` ×K, `cuMemcpyDtoHAsync_v2`, `cuStreamSynchronize`.
    Driver,
    /// Driver API only: `cuLaunchKernel` ×K, `cuMemcpyDtoH_v2`.
    DriverSync,
}

impl Style {
    /// Every style.
    pub const ALL: [Style; 8] = [
        Style::Sync,
        Style::Stream,
        Style::Event,
        Style::Device,
        Style::Graph,
        Style::LaunchEx,
        Style::Driver,
        Style::DriverSync,
    ];

    /// The name used by `--style` and in the truth records.
    pub fn as_str(self) -> &'static str {
        match self {
            Style::Sync => "sync",
            Style::Stream => "stream",
            Style::Event => "event",
            Style::Device => "device",
            Style::Graph => "graph",
            Style::LaunchEx => "launch-ex",
            Style::Driver => "driver",
            Style::DriverSync => "driver-sync",
        }
    }

    /// Uses the driver API only (no runtime call at all).
    pub fn is_driver(self) -> bool {
        matches!(self, Style::Driver | Style::DriverSync)
    }

    /// The D2H copy completes on the copy call's own return.
    pub fn is_sync_copy(self) -> bool {
        matches!(self, Style::Sync | Style::DriverSync)
    }

    /// The API function called K times per episode.
    pub fn launch_function(self) -> &'static str {
        match self {
            Style::Graph => "cudaGraphLaunch",
            Style::LaunchEx => "cudaLaunchKernelExC",
            Style::Driver | Style::DriverSync => "cuLaunchKernel",
            _ => "cudaLaunchKernel",
        }
    }

    /// The API function whose return completes the D2H copy (t_complete_ns).
    pub fn completion_function(self) -> &'static str {
        match self {
            Style::Sync => "cudaMemcpy",
            Style::Event => "cudaEventSynchronize",
            Style::Device => "cudaDeviceSynchronize",
            Style::Driver => "cuStreamSynchronize",
            Style::DriverSync => "cuMemcpyDtoH_v2",
            Style::Stream | Style::Graph | Style::LaunchEx => "cudaStreamSynchronize",
        }
    }
}

impl fmt::Display for Style {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Style {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Style::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| anyhow!("unknown workload style {s:?}"))
    }
}

/// Which workload binary, i.e. how the process reaches CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// `workload`: linked to the stub `libcudart.so.12` and `libcuda.so.1`.
    Linked,
    /// `workload_hashed`: linked to `libcudart-4e0b8a1f.so.12`.
    Hashed,
    /// `workload_dl`: `dlopen`s the runtime (default the stub `libcudart.so.12`)
    /// after `--dlopen-delay-ms`.
    Dl,
    /// `workload_ext_host`: the runtime is hidden inside `libworkload_ext.so`.
    ExtHost,
    /// `workload_real`: the real runtime of the wheel (runtime styles only).
    Real,
}

impl Variant {
    /// Every variant.
    pub const ALL: [Variant; 5] = [
        Variant::Linked,
        Variant::Hashed,
        Variant::Dl,
        Variant::ExtHost,
        Variant::Real,
    ];

    /// File name of the binary in [`fixture_dir()`].
    pub fn binary(self) -> &'static str {
        match self {
            Variant::Linked => "workload",
            Variant::Hashed => "workload_hashed",
            Variant::Dl => "workload_dl",
            Variant::ExtHost => "workload_ext_host",
            Variant::Real => "workload_real",
        }
    }

    /// The `"variant"` field of its truth records.
    pub fn truth_name(self) -> &'static str {
        match self {
            Variant::Linked => "linked",
            Variant::Hashed => "hashed",
            Variant::Dl => "dl",
            Variant::ExtHost => "ext",
            Variant::Real => "real",
        }
    }

    /// The ELF file that holds the runtime (`cuda*`) functions this variant
    /// calls: where a tracer must attach its runtime probes. For `Dl` this is
    /// the default `--dlopen` library.
    pub fn runtime_library(self) -> PathBuf {
        match self {
            Variant::Linked | Variant::Dl => fixture(STUB_CUDART),
            Variant::Hashed => fixture(STUB_CUDART_HASHED),
            Variant::ExtHost => fixture(EXT_MODULE),
            Variant::Real => real_cudart_path(),
        }
    }

    /// Whether the process maps the stub `libcuda.so.1` (every variant but
    /// `Real`; for `Dl` only once the runtime is loaded).
    pub fn has_driver(self) -> bool {
        self != Variant::Real
    }
}

/// Builder for one run of a workload binary. Defaults are the program's own:
/// style `stream`, 10 episodes, 4 launches of 200 µs, 4096 D2H bytes, no H2D,
/// 1000 µs between episodes.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Which binary.
    pub variant: Variant,
    /// `--style`.
    pub style: Style,
    /// `--episodes`.
    pub episodes: u32,
    /// `--launches` per episode.
    pub launches: u32,
    /// `--kernel-us`: emulated duration of each launch.
    pub kernel_us: u64,
    /// `--copy-bytes`: D2H bytes per episode.
    pub copy_bytes: u64,
    /// `--h2d-bytes`: H2D bytes per episode, before the launches.
    pub h2d_bytes: u64,
    /// `--gap-us` between episodes.
    pub gap_us: u64,
    /// `--stop-before-work`: SIGSTOP itself after start-up (see [`wait_stopped`], [`cont`]).
    pub stop_before_work: bool,
    /// `--fork-child`: a forked child does the work (stopping happens before the fork).
    pub fork_child: bool,
    /// `--thread`: the work runs in a second thread (truth `tid` != `pid`).
    pub thread: bool,
    /// `--ptsz`: use the `_ptsz`/`_ptds` runtime entry points on stream 0.
    pub ptsz: bool,
    /// `--ignore-errors`: keep going on CUDA errors (needed for `Real`).
    pub ignore_errors: bool,
    /// `--truth FILE`.
    pub truth: Option<PathBuf>,
    /// `--dlopen PATH` (`Dl` only).
    pub dlopen: Option<PathBuf>,
    /// `--dlopen-delay-ms` (`Dl` only).
    pub dlopen_delay_ms: Option<u64>,
    /// `--bench-launches N`: only time N zero-duration launches.
    pub bench_launches: Option<u64>,
    /// Arguments appended after the ones above (e.g. `--grid 8,1,1`).
    pub extra_args: Vec<OsString>,
    /// Environment set for the child (after `LD_LIBRARY_PATH`/`LD_PRELOAD`
    /// are removed, so they can be set back here).
    pub envs: Vec<(OsString, OsString)>,
}

impl Workload {
    /// A run of `workload` (the linked variant) with the given style.
    pub fn new(style: Style) -> Self {
        Workload {
            variant: Variant::Linked,
            style,
            episodes: 10,
            launches: 4,
            kernel_us: 200,
            copy_bytes: 4096,
            h2d_bytes: 0,
            gap_us: 1000,
            stop_before_work: false,
            fork_child: false,
            thread: false,
            ptsz: false,
            ignore_errors: false,
            truth: None,
            dlopen: None,
            dlopen_delay_ms: None,
            bench_launches: None,
            extra_args: Vec::new(),
            envs: Vec::new(),
        }
    }

    /// Sets the binary.
    pub fn variant(mut self, v: Variant) -> Self {
        self.variant = v;
        if v == Variant::Real {
            self.ignore_errors = true;
        }
        self
    }
    /// Sets `--style`.
    pub fn style(mut self, s: Style) -> Self {
        self.style = s;
        self
    }
    /// Sets `--episodes`.
    pub fn episodes(mut self, n: u32) -> Self {
        self.episodes = n;
        self
    }
    /// Sets `--launches` (per episode).
    pub fn launches(mut self, k: u32) -> Self {
        self.launches = k;
        self
    }
    /// Sets `--kernel-us`.
    pub fn kernel_us(mut self, us: u64) -> Self {
        self.kernel_us = us;
        self
    }
    /// Sets `--copy-bytes` (D2H).
    pub fn copy_bytes(mut self, b: u64) -> Self {
        self.copy_bytes = b;
        self
    }
    /// Sets `--h2d-bytes`.
    pub fn h2d_bytes(mut self, b: u64) -> Self {
        self.h2d_bytes = b;
        self
    }
    /// Sets `--gap-us`.
    pub fn gap_us(mut self, us: u64) -> Self {
        self.gap_us = us;
        self
    }
    /// Sets `--stop-before-work`.
    pub fn stop_before_work(mut self, on: bool) -> Self {
        self.stop_before_work = on;
        self
    }
    /// Sets `--fork-child`.
    pub fn fork_child(mut self, on: bool) -> Self {
        self.fork_child = on;
        self
    }
    /// Sets `--thread`.
    pub fn thread(mut self, on: bool) -> Self {
        self.thread = on;
        self
    }
    /// Sets `--ptsz`.
    pub fn ptsz(mut self, on: bool) -> Self {
        self.ptsz = on;
        self
    }
    /// Sets `--ignore-errors` (on by default for [`Variant::Real`]).
    pub fn ignore_errors(mut self, on: bool) -> Self {
        self.ignore_errors = on;
        self
    }
    /// Sets `--truth FILE`.
    pub fn truth(mut self, path: impl Into<PathBuf>) -> Self {
        self.truth = Some(path.into());
        self
    }
    /// Sets `--dlopen PATH` (variant `Dl`).
    pub fn dlopen(mut self, path: impl Into<PathBuf>) -> Self {
        self.dlopen = Some(path.into());
        self
    }
    /// Sets `--dlopen-delay-ms` (variant `Dl`).
    pub fn dlopen_delay_ms(mut self, ms: u64) -> Self {
        self.dlopen_delay_ms = Some(ms);
        self
    }
    /// Sets `--bench-launches N`.
    pub fn bench_launches(mut self, n: u64) -> Self {
        self.bench_launches = Some(n);
        self
    }
    /// Appends one raw argument.
    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.extra_args.push(a.as_ref().to_owned());
        self
    }
    /// Sets an environment variable of the child (e.g. `TTFT_STUB_BW_GBPS`).
    pub fn env(mut self, k: impl AsRef<OsStr>, v: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((k.as_ref().to_owned(), v.as_ref().to_owned()));
        self
    }

    /// Path of the binary.
    pub fn binary(&self) -> PathBuf {
        fixture(self.variant.binary())
    }

    /// The command-line arguments (without the program).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        let mut kv = |k: &str, v: &dyn fmt::Display| {
            a.push(k.into());
            a.push(v.to_string().into());
        };
        kv("--style", &self.style);
        kv("--episodes", &self.episodes);
        kv("--launches", &self.launches);
        kv("--kernel-us", &self.kernel_us);
        kv("--copy-bytes", &self.copy_bytes);
        kv("--h2d-bytes", &self.h2d_bytes);
        kv("--gap-us", &self.gap_us);
        if let Some(ms) = self.dlopen_delay_ms {
            kv("--dlopen-delay-ms", &ms);
        }
        if let Some(n) = self.bench_launches {
            kv("--bench-launches", &n);
        }
        for (flag, on) in [
            ("--stop-before-work", self.stop_before_work),
            ("--fork-child", self.fork_child),
            ("--thread", self.thread),
            ("--ptsz", self.ptsz),
            ("--ignore-errors", self.ignore_errors),
        ] {
            if on {
                a.push(flag.into());
            }
        }
        if let Some(t) = &self.truth {
            a.push("--truth".into());
            a.push(t.into());
        }
        if let Some(p) = &self.dlopen {
            a.push("--dlopen".into());
            a.push(p.into());
        }
        a.extend(self.extra_args.iter().cloned());
        a
    }

    /// The command, ready to spawn: stdin null, `LD_LIBRARY_PATH` and
    /// `LD_PRELOAD` removed (they would override the fixtures' run paths),
    /// then [`Workload::envs`] applied.
    pub fn command(&self) -> Command {
        let mut c = Command::new(self.binary());
        c.args(self.to_args())
            .stdin(Stdio::null())
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("LD_PRELOAD");
        for (k, v) in &self.envs {
            c.env(k, v);
        }
        c
    }

    /// Spawns the workload (stdout/stderr inherited).
    pub fn spawn(&self) -> Result<Child> {
        self.spawn_with(Stdio::inherit(), Stdio::inherit())
    }

    /// Spawns the workload with the given stdout and stderr.
    pub fn spawn_with(&self, stdout: Stdio, stderr: Stdio) -> Result<Child> {
        let bin = self.binary();
        if !bin.exists() {
            if self.variant == Variant::Real
                && let Err(why) = real_cudart_status()
            {
                bail!("workload_real unavailable: {why}");
            }
            existing_fixture(self.variant.binary())?;
        }
        self.command()
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))
    }

    /// Spawns the workload in a [`ChildGuard`] (killed if dropped unwaited).
    pub fn spawn_guarded(&self) -> Result<ChildGuard> {
        self.spawn().map(ChildGuard::new)
    }

    /// Spawns the workload with `--stop-before-work` and returns once it has
    /// stopped itself, libraries loaded, ready for a tracer to attach.
    pub fn spawn_stopped(&self) -> Result<ChildGuard> {
        let child = self.clone().stop_before_work(true).spawn_guarded()?;
        wait_stopped(child.id())?;
        Ok(child)
    }

    /// Runs the workload to completion, capturing its output, and reads the
    /// truth file if one was set. Does not fail on a non-zero exit: see
    /// [`Finished::ensure_success`].
    pub fn run(&self) -> Result<Finished> {
        let child = self.spawn_with(Stdio::piped(), Stdio::piped())?;
        let out = child
            .wait_with_output()
            .with_context(|| format!("waiting for {}", self.binary().display()))?;
        let truth = match &self.truth {
            Some(t) if t.exists() => read_truth(t)?,
            _ => Vec::new(),
        };
        Ok(Finished {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            truth,
        })
    }

    /// Runs with `--bench-launches n` and parses its result line.
    pub fn run_bench(&self, n: u64) -> Result<BenchResult> {
        let f = self.clone().bench_launches(n).run()?.ensure_success()?;
        let line = f
            .stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .ok_or_else(|| anyhow!("benchmark printed nothing"))?;
        serde_json::from_str(line).with_context(|| format!("parsing benchmark line {line:?}"))
    }
}

/// A finished workload run.
#[derive(Debug)]
pub struct Finished {
    /// Exit status.
    pub status: ExitStatus,
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
    /// The truth records (empty without a truth file).
    pub truth: Vec<TruthEpisode>,
}

impl Finished {
    /// `Ok(self)` if the workload exited 0, else an error with its stderr.
    pub fn ensure_success(self) -> Result<Self> {
        if self.status.success() {
            Ok(self)
        } else {
            bail!("workload failed ({}):\n{}", self.status, self.stderr)
        }
    }
}

/// Output of `--bench-launches`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct BenchResult {
    /// Number of launches timed.
    pub launches: u64,
    /// Mean wall time of one launch call, ns.
    pub ns_per_launch: f64,
}

/// One episode of ground truth (one line of the truth JSONL). Times are
/// `CLOCK_MONOTONIC` ns.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct TruthEpisode {
    /// Index, from 0.
    pub episode: u64,
    /// Process that did the work (the child with `--fork-child`).
    pub pid: u32,
    /// Thread that did the work.
    pub tid: u32,
    /// Read right before the first launch call of the episode (after its H2D copy).
    pub t_launch_ns: u64,
    /// Read right before the D2H copy call.
    pub t_copy_ns: u64,
    /// Read right after the call that completes the D2H copy returned
    /// ([`Style::completion_function`]).
    pub t_complete_ns: u64,
    /// Kernel launch calls in the episode (0 for `graph`).
    pub kernel_launches: u64,
    /// Graph launch calls in the episode (`graph` only).
    pub graph_launches: u64,
    /// Bytes of the D2H copy.
    pub d2h_bytes: u64,
    /// Bytes of the H2D copy before the launches (0: none).
    #[serde(default)]
    pub h2d_bytes: u64,
    /// The style name.
    pub style: String,
    /// The variant name ([`Variant::truth_name`]).
    #[serde(default)]
    pub variant: String,
    /// CUDA calls of the episode that returned an error (`--ignore-errors`).
    #[serde(default)]
    pub errors: u64,
    /// The stream handle passed to the calls (0: default stream).
    #[serde(default)]
    pub stream: u64,
    /// The kernel function pointer passed to the launches (`graph`: the
    /// graph exec handle).
    #[serde(default)]
    pub func: u64,
}

impl TruthEpisode {
    /// Launch to completion: the "GPU" part of TTFT.
    pub fn gpu_ns(&self) -> u64 {
        self.t_complete_ns.saturating_sub(self.t_launch_ns)
    }
    /// Copy call to completion.
    pub fn copy_ns(&self) -> u64 {
        self.t_complete_ns.saturating_sub(self.t_copy_ns)
    }
    /// Kernel plus graph launches.
    pub fn launches(&self) -> u64 {
        self.kernel_launches + self.graph_launches
    }
}

/// Reads a truth JSONL file (blank lines skipped).
pub fn read_truth(path: impl AsRef<Path>) -> Result<Vec<TruthEpisode>> {
    let path = path.as_ref();
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{}:{}: bad truth record {l:?}", path.display(), i + 1))
        })
        .collect()
}

/// `clock_gettime(CLOCK_MONOTONIC)` in ns: the clock of the truth records
/// and of `bpf_ktime_get_ns()`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// A fresh path in the temp directory (nothing is created), e.g. for a truth file.
pub fn temp_path(prefix: &str, ext: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "ttft-{prefix}-{}-{n}-{t}.{ext}",
        std::process::id()
    ))
}

/// The state letter of `/proc/PID/stat` (`R`, `S`, `T`, `Z`, ...).
pub fn process_state(pid: u32) -> Result<char> {
    let path = format!("/proc/{pid}/stat");
    let stat = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // "pid (comm) S ...": comm may hold spaces and parentheses.
    let after = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or_else(|| anyhow!("malformed {path}: {stat:?}"))?;
    after
        .trim_start()
        .chars()
        .next()
        .ok_or_else(|| anyhow!("malformed {path}: {stat:?}"))
}

/// Waits (up to 10 s) until process `pid` is stopped (state `T`), e.g. a
/// workload run with `--stop-before-work`.
pub fn wait_stopped(pid: u32) -> Result<()> {
    wait_stopped_timeout(pid, Duration::from_secs(10))
}

/// [`wait_stopped`] with a timeout.
pub fn wait_stopped_timeout(pid: u32, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        let state = process_state(pid)?;
        match state {
            'T' => return Ok(()),
            'Z' | 'X' => bail!("process {pid} exited instead of stopping"),
            _ => {}
        }
        if start.elapsed() > timeout {
            bail!("process {pid} not stopped after {timeout:?} (state {state})");
        }
        thread::sleep(Duration::from_millis(2));
    }
}

/// Sends SIGCONT to `pid`.
pub fn cont(pid: u32) -> Result<()> {
    signal(pid, libc::SIGCONT)
}

fn signal(pid: u32, sig: libc::c_int) -> Result<()> {
    let p = libc::pid_t::try_from(pid).context("pid out of range")?;
    // SAFETY: kill(2) has no memory-safety preconditions.
    let rc = unsafe { libc::kill(p, sig) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error()).with_context(|| format!("kill({pid}, {sig})"))
    }
}

/// A process named `workload` (the tests' comm filter) that maps `path`
/// and waits (`fixtures/map_file.py`), returned once it has mapped it;
/// killed on drop.
pub fn map_file(path: &Path) -> Result<ChildGuard> {
    let mut child = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/map_file.py"))
        .arg(path)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting map_file.py")?;
    let out = child.stdout.take().context("map_file.py's stdout")?;
    let guard = ChildGuard::new(child);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)?;
    if line.trim() != "mapped" {
        bail!("map_file.py said {line:?}");
    }
    Ok(guard)
}

/// A child process that is killed (SIGKILL) and reaped when dropped, so a
/// failing test does not leave a stopped workload behind.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
}

impl ChildGuard {
    /// Guards `child`.
    pub fn new(child: Child) -> Self {
        ChildGuard { child: Some(child) }
    }
    /// Its pid.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }
    /// The child, still guarded.
    pub fn child_mut(&mut self) -> Option<&mut Child> {
        self.child.as_mut()
    }
    /// Waits for the child (then nothing is left to kill).
    pub fn wait(&mut self) -> Result<ExitStatus> {
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| anyhow!("child already taken"))?;
        let st = child.wait().context("waiting for child")?;
        self.child = None;
        Ok(st)
    }
    /// Waits up to `timeout`; kills the child and fails if it runs longer.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let start = Instant::now();
        loop {
            let child = self
                .child
                .as_mut()
                .ok_or_else(|| anyhow!("child already taken"))?;
            if let Some(st) = child.try_wait().context("waiting for child")? {
                self.child = None;
                return Ok(st);
            }
            if start.elapsed() > timeout {
                let pid = child.id();
                let _ = child.kill();
                let _ = child.wait();
                self.child = None;
                bail!("process {pid} still running after {timeout:?}; killed");
            }
            thread::sleep(Duration::from_millis(5));
        }
    }
    /// Releases the child from the guard.
    pub fn into_inner(mut self) -> Option<Child> {
        self.child.take()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
