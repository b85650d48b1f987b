//! One round of NVML readings: a GPU's sample, the running-process lists,
//! and the bookkeeping that logs a failing reading once until it recovers.

use std::collections::{HashMap, HashSet};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use log::{info, warn};
use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError as WrapperError;

use super::metrics::GpuMetrics;
use super::throttle::ThrottleReasons;
use super::timeline::{GpuSample, SampleRing};
use crate::host::clock::monotonic_ns;

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
    pub(super) fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }
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

/// Logs a reading's first failure and its recovery, once each.
#[derive(Default)]
pub(super) struct FailureLog {
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

    pub(super) fn check<T>(
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

pub(super) fn read_sample(
    gpu: &GpuInfo,
    dev: &Device<'_>,
    log: &mut FailureLog,
    m: &GpuMetrics,
) -> GpuSample {
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

pub(super) fn refresh_processes(
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
    for (pid, gpus) in &map {
        if st.pids.get(pid) != Some(gpus) {
            log::info!("NVML: pid {pid} runs on GPU {gpus:?}");
        }
    }
    st.pids = map;
    st.process_refreshes += 1;
}
