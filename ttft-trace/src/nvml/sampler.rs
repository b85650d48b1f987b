//! The sampler thread: reads every GPU each period, keeps the history, updates the metrics and
//! refreshes the process → GPU map.

use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvml_wrapper::{Device, Nvml};

use super::metrics::GpuMetrics;
use super::readings::{FailureLog, GpuInfo, Reading, Shared, read_sample, refresh_processes};
use super::timeline::{GpuSample, SampleRing, WindowReadings};

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
            log::warn!("NVML sampler thread panicked");
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

fn run(
    nvml: Nvml,
    gpus: Vec<GpuInfo>,
    params: Params,
    metrics: GpuMetrics,
    shared: Arc<Shared>,
    stop: mpsc::Receiver<()>,
) {
    let mut log = FailureLog::default();
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
