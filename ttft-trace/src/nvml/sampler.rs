//! The sampler thread: reads every GPU each period, keeps the history, updates the metrics and
//! refreshes the process → GPU map.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{info, warn};
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError as WrapperError;
use nvml_wrapper::{Device, Nvml};

use super::metrics::GpuMetrics;
use super::throttle::ThrottleReasons;
use super::timeline::{GpuSample, SampleRing, WindowReadings};
use crate::clock::monotonic_ns;

/// Identity of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GpuInfo {
    /// NVML device index (the `gpu` label).
    pub index: u32,
    /// NVML UUID (`GPU-…`; the `uuid` label), "unknown" when NVML could not say.
    pub uuid: String,
    /// Product name, "unknown" when NVML could not say.
    pub name: String,
}

/// One NVML reading, for "failed once" bookkeeping, logs and the error counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Reading {
    Handle,
    SmClock,
    MemClock,
    Memory,
    Utilization,
    Power,
    Temperature,
    Throttle,
    ComputeProcesses,
    GraphicsProcesses,
}

impl Reading {
    /// Short name (the `reading` label of `ttft_trace_gpu_reading_errors_total`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Reading::Handle => "handle",
            Reading::SmClock => "sm_clock",
            Reading::MemClock => "memory_clock",
            Reading::Memory => "memory",
            Reading::Utilization => "utilization",
            Reading::Power => "power",
            Reading::Temperature => "temperature",
            Reading::Throttle => "throttle_reasons",
            Reading::ComputeProcesses => "compute_processes",
            Reading::GraphicsProcesses => "graphics_processes",
        }
    }

    /// The NVML entry point behind the reading.
    pub(crate) fn nvml_call(self) -> &'static str {
        match self {
            Reading::Handle => "nvmlDeviceGetHandleByIndex_v2",
            Reading::SmClock | Reading::MemClock => "nvmlDeviceGetClockInfo",
            Reading::Memory => "nvmlDeviceGetMemoryInfo_v2",
            Reading::Utilization => "nvmlDeviceGetUtilizationRates",
            Reading::Power => "nvmlDeviceGetPowerUsage",
            Reading::Temperature => "nvmlDeviceGetTemperature",
            Reading::Throttle => "nvmlDeviceGetCurrentClocksThrottleReasons",
            Reading::ComputeProcesses => "nvmlDeviceGetComputeRunningProcesses_v3",
            Reading::GraphicsProcesses => "nvmlDeviceGetGraphicsRunningProcesses_v3",
        }
    }
}

/// State shared between the sampler thread and the queries.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// One ring per GPU, in the order of `Sampler::gpus`.
    pub(crate) rings: Vec<(u32, SampleRing)>,
    /// pid → GPU indices (sorted) from NVML's running compute and graphics process lists.
    pub(crate) pids: HashMap<u32, Vec<u32>>,
    /// Samples taken so far (all GPUs).
    pub(crate) samples_taken: u64,
    /// Process-list refreshes done so far.
    pub(crate) process_refreshes: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    state: RwLock<State>,
}

impl Shared {
    // A panic while the lock is held leaves consistent data (each update is one push or one
    // map swap), so a poisoned lock is still read.
    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }
    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// Settings of a running sampler (from `NvmlConfig`, resolved).
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub(crate) period: Duration,
    pub(crate) history_ns: u64,
    pub(crate) ring_len: usize,
    pub(crate) fallback_max_age_ns: u64,
    pub(crate) process_every: u64,
}

/// A running NVML sampler. Dropping it stops the thread and removes the GPU metrics.
pub struct Sampler {
    gpus: Vec<GpuInfo>,
    shared: Arc<Shared>,
    params: Params,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    metrics: GpuMetrics,
    registry: prometheus::Registry,
    library: String,
}

impl Sampler {
    pub(crate) fn spawn(
        nvml: Nvml,
        gpus: Vec<GpuInfo>,
        params: Params,
        metrics: GpuMetrics,
        registry: prometheus::Registry,
        library: String,
    ) -> std::io::Result<Sampler> {
        let shared = Arc::new(Shared::default());
        {
            let mut st = shared.write();
            st.rings = gpus
                .iter()
                .map(|g| (g.index, SampleRing::new(params.history_ns, params.ring_len)))
                .collect();
        }
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let thread = {
            let shared = shared.clone();
            let gpus = gpus.clone();
            let params = params.clone();
            let metrics = metrics.clone();
            std::thread::Builder::new()
                .name("ttft-nvml".into())
                .spawn(move || run(nvml, gpus, params, metrics, shared, stop_rx))?
        };
        Ok(Sampler {
            gpus,
            shared,
            params,
            stop: Some(stop_tx),
            thread: Some(thread),
            metrics,
            registry,
            library,
        })
    }

    /// The GPUs sampled (NVML index, UUID, name).
    pub fn gpus(&self) -> Vec<GpuInfo> {
        self.gpus.clone()
    }

    /// The library NVML was loaded from (the configured path, or the default name).
    pub fn library(&self) -> &str {
        &self.library
    }

    /// The sampling period.
    pub fn period(&self) -> Duration {
        self.params.period
    }

    /// Readings inside `[t0_ns, t1_ns]` (CLOCK_MONOTONIC ns) for one GPU (by NVML index) or,
    /// with `None`, for all GPUs together: lowest SM and memory clocks, highest memory used
    /// (bytes and share of total), highest utilisation, throttle reasons seen, sample count.
    /// When no sample falls inside, the nearest sample before `t0_ns` counts if it is recent
    /// (see `NvmlConfig::window_fallback`). None when no sample qualifies or the GPU is unknown.
    pub fn window(&self, gpu: Option<u32>, t0_ns: u64, t1_ns: u64) -> Option<WindowReadings> {
        let st = self.shared.read();
        let mut out: Option<WindowReadings> = None;
        for (index, ring) in &st.rings {
            if gpu.is_some_and(|g| g != *index) {
                continue;
            }
            if let Some(w) = ring.window(t0_ns, t1_ns, self.params.fallback_max_age_ns) {
                match &mut out {
                    Some(acc) => acc.merge(&w),
                    None => out = Some(w),
                }
            }
        }
        out
    }

    /// Samples of one GPU inside `[t0_ns, t1_ns]`, oldest first.
    pub fn samples(&self, gpu: u32, t0_ns: u64, t1_ns: u64) -> Vec<GpuSample> {
        let st = self.shared.read();
        st.rings
            .iter()
            .filter(|(i, _)| *i == gpu)
            .flat_map(|(_, r)| r.range(t0_ns, t1_ns).cloned())
            .collect()
    }

    /// The newest sample of one GPU.
    pub fn latest(&self, gpu: u32) -> Option<GpuSample> {
        let st = self.shared.read();
        st.rings
            .iter()
            .find(|(i, _)| *i == gpu)
            .and_then(|(_, r)| r.latest().cloned())
    }

    /// Which GPU a process uses (the lowest index when it uses several), from NVML's running
    /// compute and graphics process lists (refreshed every `NvmlConfig::process_refresh`).
    pub fn gpu_of_pid(&self, pid: u32) -> Option<u32> {
        self.shared
            .read()
            .pids
            .get(&pid)
            .and_then(|g| g.first().copied())
    }

    /// Every GPU a process uses, sorted.
    pub fn gpus_of_pid(&self, pid: u32) -> Vec<u32> {
        self.shared
            .read()
            .pids
            .get(&pid)
            .cloned()
            .unwrap_or_default()
    }

    /// Samples taken so far over all GPUs, and process-list refreshes done.
    pub fn counters(&self) -> (u64, u64) {
        let st = self.shared.read();
        (st.samples_taken, st.process_refreshes)
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        // Dropping the sender wakes the thread's wait at once.
        drop(self.stop.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            warn!("NVML sampler thread panicked");
        }
        self.metrics.unregister(&self.registry);
    }
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("gpus", &self.gpus)
            .field("library", &self.library)
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

/// Logs a reading's first failure and its recovery, once each.
struct FailureLog {
    failing: HashSet<(u32, Reading)>,
}

impl FailureLog {
    fn failed(&mut self, gpu: &GpuInfo, r: Reading, e: &WrapperError, metrics: &GpuMetrics) {
        metrics.count_error(gpu.index, &gpu.uuid, r.name());
        if self.failing.insert((gpu.index, r)) {
            warn!(
                "NVML {} ({}) failed on GPU {} ({}): {}; reading left out, retried every period \
                 (logged once until it recovers)",
                r.nvml_call(),
                r.name(),
                gpu.index,
                gpu.uuid,
                e
            );
        }
    }

    fn ok(&mut self, gpu: &GpuInfo, r: Reading) {
        if self.failing.remove(&(gpu.index, r)) {
            info!(
                "NVML {} ({}) works again on GPU {} ({})",
                r.nvml_call(),
                r.name(),
                gpu.index,
                gpu.uuid
            );
        }
    }

    fn check<T>(
        &mut self,
        gpu: &GpuInfo,
        r: Reading,
        res: Result<T, WrapperError>,
        metrics: &GpuMetrics,
    ) -> Option<T> {
        match res {
            Ok(v) => {
                self.ok(gpu, r);
                Some(v)
            }
            Err(e) => {
                self.failed(gpu, r, &e, metrics);
                None
            }
        }
    }
}

fn run(
    nvml: Nvml,
    gpus: Vec<GpuInfo>,
    params: Params,
    metrics: GpuMetrics,
    shared: Arc<Shared>,
    stop: mpsc::Receiver<()>,
) {
    let mut log = FailureLog {
        failing: HashSet::new(),
    };
    let mut devices: Vec<Option<Device<'_>>> = gpus.iter().map(|_| None).collect();
    let mut tick: u64 = 0;
    let mut next = Instant::now();
    loop {
        for (gpu, slot) in gpus.iter().zip(devices.iter_mut()) {
            if slot.is_none() {
                *slot = log.check(
                    gpu,
                    Reading::Handle,
                    nvml.device_by_index(gpu.index),
                    &metrics,
                );
            }
        }
        for (gpu, dev) in gpus.iter().zip(devices.iter()) {
            let Some(dev) = dev else { continue };
            let s = read_sample(gpu, dev, &mut log, &metrics);
            metrics.update(&gpu.uuid, &s);
            let mut st = shared.write();
            st.samples_taken += 1;
            if let Some((_, ring)) = st.rings.iter_mut().find(|(i, _)| *i == gpu.index) {
                ring.push(s);
            }
        }
        if tick.is_multiple_of(params.process_every) {
            refresh_processes(&gpus, &devices, &mut log, &metrics, &shared);
        }
        tick += 1;

        next += params.period;
        let now = Instant::now();
        if next < now {
            // Fell behind (slow NVML calls): skip the missed ticks rather than burst.
            next = now + params.period;
        }
        match stop.recv_timeout(next - now) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    // Dropping `devices` then `nvml` calls nvmlShutdown.
    drop(devices);
    drop(nvml);
}

fn read_sample(gpu: &GpuInfo, dev: &Device<'_>, log: &mut FailureLog, m: &GpuMetrics) -> GpuSample {
    let t_start = monotonic_ns();
    let sm = log.check(gpu, Reading::SmClock, dev.clock_info(Clock::SM), m);
    let mem_clk = log.check(gpu, Reading::MemClock, dev.clock_info(Clock::Memory), m);
    let mem = log.check(gpu, Reading::Memory, dev.memory_info(), m);
    let util = log.check(gpu, Reading::Utilization, dev.utilization_rates(), m);
    let power = log.check(gpu, Reading::Power, dev.power_usage(), m);
    let temp = log.check(
        gpu,
        Reading::Temperature,
        dev.temperature(TemperatureSensor::Gpu),
        m,
    );
    let throttle = log.check(gpu, Reading::Throttle, dev.current_throttle_reasons(), m);
    let t_end = monotonic_ns();
    GpuSample {
        t_ns: t_start + t_end.saturating_sub(t_start) / 2,
        gpu: gpu.index,
        sm_clock_hz: sm.map(|mhz| u64::from(mhz) * 1_000_000),
        mem_clock_hz: mem_clk.map(|mhz| u64::from(mhz) * 1_000_000),
        mem_used_bytes: mem.as_ref().map(|m| m.used),
        mem_total_bytes: mem.as_ref().map(|m| m.total),
        utilization_ratio: util.as_ref().map(|u| f64::from(u.gpu) / 100.0),
        mem_utilization_ratio: util.as_ref().map(|u| f64::from(u.memory) / 100.0),
        power_watts: power.map(|mw| f64::from(mw) / 1000.0),
        temperature_celsius: temp.map(f64::from),
        throttle_reasons: throttle.map(|t| ThrottleReasons(t.bits())),
    }
}

fn refresh_processes(
    gpus: &[GpuInfo],
    devices: &[Option<Device<'_>>],
    log: &mut FailureLog,
    metrics: &GpuMetrics,
    shared: &Shared,
) {
    let mut map: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut stale: Vec<u32> = Vec::new();
    for (gpu, dev) in gpus.iter().zip(devices.iter()) {
        let Some(dev) = dev else {
            stale.push(gpu.index);
            continue;
        };
        let compute = log.check(
            gpu,
            Reading::ComputeProcesses,
            dev.running_compute_processes(),
            metrics,
        );
        let graphics = log.check(
            gpu,
            Reading::GraphicsProcesses,
            dev.running_graphics_processes(),
            metrics,
        );
        if compute.is_none() || graphics.is_none() {
            stale.push(gpu.index);
        }
        for p in compute.into_iter().chain(graphics).flatten() {
            let v = map.entry(p.pid).or_default();
            if let Err(i) = v.binary_search(&gpu.index) {
                v.insert(i, gpu.index);
            }
        }
    }
    let mut st = shared.write();
    // A GPU whose lists could not be read keeps its previous entries.
    for g in stale {
        for (pid, old) in &st.pids {
            if old.contains(&g) {
                let v = map.entry(*pid).or_default();
                if let Err(i) = v.binary_search(&g) {
                    v.insert(i, g);
                }
            }
        }
    }
    st.pids = map;
    st.process_refreshes += 1;
}
