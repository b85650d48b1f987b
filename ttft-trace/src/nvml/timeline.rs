//! Sample history (one time-ordered ring per GPU) and window aggregation. Pure: no NVML here.

use std::collections::VecDeque;

use serde::Serialize;

use super::throttle::ThrottleReasons;

/// One sample of one GPU, stamped with `clock_gettime(CLOCK_MONOTONIC)` in ns (the clock of
/// `bpf_ktime_get_ns`). A reading that failed in this sample is `None` (never 0).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GpuSample {
    /// CLOCK_MONOTONIC ns, midpoint of the NVML calls that made this sample.
    pub t_ns: u64,
    /// NVML device index.
    pub gpu: u32,
    pub sm_clock_hz: Option<u64>,
    pub mem_clock_hz: Option<u64>,
    pub mem_used_bytes: Option<u64>,
    pub mem_total_bytes: Option<u64>,
    /// Share of the last NVML sample period in which a kernel ran (0..1).
    pub utilization_ratio: Option<f64>,
    /// Share of the last NVML sample period in which device memory was read or written (0..1).
    pub mem_utilization_ratio: Option<f64>,
    pub power_watts: Option<f64>,
    pub temperature_celsius: Option<f64>,
    pub throttle_reasons: Option<ThrottleReasons>,
}

impl GpuSample {
    /// Memory used as a share of total (0..1), when both readings are present.
    pub fn mem_used_ratio(&self) -> Option<f64> {
        match (self.mem_used_bytes, self.mem_total_bytes) {
            (Some(used), Some(total)) if total > 0 => Some(used as f64 / total as f64),
            _ => None,
        }
    }
}

/// Readings of one window `[t0_ns, t1_ns]`, for one GPU or several (the JSONL form).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WindowReadings {
    /// GPUs whose samples were used.
    pub gpus: Vec<u32>,
    /// Number of samples used.
    pub samples: u32,
    /// True when no sample fell inside the window and the nearest sample before it was used.
    pub before_window: bool,
    /// Lowest SM clock seen.
    pub sm_clock_min_hz: Option<u64>,
    /// Lowest memory clock seen.
    pub mem_clock_min_hz: Option<u64>,
    /// Highest memory used, and the total of the GPU it was seen on.
    pub mem_used_max_bytes: Option<u64>,
    pub mem_total_bytes: Option<u64>,
    /// Highest share of total memory used (0..1).
    pub mem_used_max_ratio: Option<f64>,
    /// Highest utilisation (0..1).
    pub utilization_max_ratio: Option<f64>,
    pub power_max_watts: Option<f64>,
    pub temperature_max_celsius: Option<f64>,
    /// Names of every throttle reason seen in any sample (bit order).
    pub throttle_reasons: Vec<String>,
    /// The same as a raw NVML mask.
    #[serde(skip)]
    pub throttle_mask: ThrottleReasons,
}

impl WindowReadings {
    /// Whether memory used reached `share` (0..1) of total in this window.
    pub fn memory_above(&self, share: f64) -> bool {
        self.mem_used_max_ratio.is_some_and(|r| r >= share)
    }

    /// Whether a clock slowdown other than plain idleness was seen.
    pub fn throttled(&self) -> bool {
        self.throttle_mask.is_slowdown()
    }

    /// Folds one sample in.
    pub fn add(&mut self, s: &GpuSample) {
        fn min_opt<T: PartialOrd + Copy>(acc: &mut Option<T>, v: Option<T>) {
            if let Some(v) = v
                && acc.is_none_or(|a| v < a)
            {
                *acc = Some(v);
            }
        }
        fn max_opt<T: PartialOrd + Copy>(acc: &mut Option<T>, v: Option<T>) {
            if let Some(v) = v
                && acc.is_none_or(|a| v > a)
            {
                *acc = Some(v);
            }
        }
        if let Err(i) = self.gpus.binary_search(&s.gpu) {
            self.gpus.insert(i, s.gpu);
        }
        self.samples += 1;
        min_opt(&mut self.sm_clock_min_hz, s.sm_clock_hz);
        min_opt(&mut self.mem_clock_min_hz, s.mem_clock_hz);
        if let Some(used) = s.mem_used_bytes
            && self.mem_used_max_bytes.is_none_or(|m| used > m)
        {
            self.mem_used_max_bytes = Some(used);
            self.mem_total_bytes = s.mem_total_bytes;
        }
        max_opt(&mut self.mem_used_max_ratio, s.mem_used_ratio());
        max_opt(&mut self.utilization_max_ratio, s.utilization_ratio);
        max_opt(&mut self.power_max_watts, s.power_watts);
        max_opt(&mut self.temperature_max_celsius, s.temperature_celsius);
        if let Some(r) = s.throttle_reasons {
            self.throttle_mask = self.throttle_mask.union(r);
            self.throttle_reasons = self.throttle_mask.names();
        }
    }

    /// Merges another window's readings (e.g. of another GPU) into this one.
    pub fn merge(&mut self, other: &WindowReadings) {
        for g in &other.gpus {
            if let Err(i) = self.gpus.binary_search(g) {
                self.gpus.insert(i, *g);
            }
        }
        self.samples += other.samples;
        self.before_window |= other.before_window;
        let pick_min = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let pick_max = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.sm_clock_min_hz = pick_min(self.sm_clock_min_hz, other.sm_clock_min_hz);
        self.mem_clock_min_hz = pick_min(self.mem_clock_min_hz, other.mem_clock_min_hz);
        if let Some(used) = other.mem_used_max_bytes
            && self.mem_used_max_bytes.is_none_or(|m| used > m)
        {
            self.mem_used_max_bytes = Some(used);
            self.mem_total_bytes = other.mem_total_bytes;
        }
        self.mem_used_max_ratio = pick_max(self.mem_used_max_ratio, other.mem_used_max_ratio);
        self.utilization_max_ratio =
            pick_max(self.utilization_max_ratio, other.utilization_max_ratio);
        self.power_max_watts = pick_max(self.power_max_watts, other.power_max_watts);
        self.temperature_max_celsius =
            pick_max(self.temperature_max_celsius, other.temperature_max_celsius);
        self.throttle_mask = self.throttle_mask.union(other.throttle_mask);
        self.throttle_reasons = self.throttle_mask.names();
    }
}

/// Time-ordered samples of one GPU, bounded by age (relative to the newest sample) and count.
#[derive(Debug, Clone)]
pub struct SampleRing {
    samples: VecDeque<GpuSample>,
    max_age_ns: u64,
    max_len: usize,
}

impl SampleRing {
    /// `max_age_ns`: samples older than the newest minus this are dropped; `max_len`: hard cap.
    pub fn new(max_age_ns: u64, max_len: usize) -> Self {
        let max_len = max_len.max(1);
        SampleRing {
            samples: VecDeque::with_capacity(max_len.min(1024)),
            max_age_ns,
            max_len,
        }
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn latest(&self) -> Option<&GpuSample> {
        self.samples.back()
    }

    pub fn oldest(&self) -> Option<&GpuSample> {
        self.samples.front()
    }

    /// Appends a sample. A sample older than the newest one is dropped (the ring stays sorted).
    pub fn push(&mut self, s: GpuSample) {
        if self.samples.back().is_some_and(|b| s.t_ns < b.t_ns) {
            return;
        }
        let horizon = s.t_ns.saturating_sub(self.max_age_ns);
        self.samples.push_back(s);
        while self.samples.len() > self.max_len {
            self.samples.pop_front();
        }
        while self.samples.front().is_some_and(|f| f.t_ns < horizon) {
            self.samples.pop_front();
        }
    }

    /// Samples with `t0_ns <= t_ns <= t1_ns`, oldest first.
    pub fn range(&self, t0_ns: u64, t1_ns: u64) -> impl Iterator<Item = &GpuSample> {
        let lo = self.samples.partition_point(|s| s.t_ns < t0_ns);
        let hi = self.samples.partition_point(|s| s.t_ns <= t1_ns).max(lo);
        self.samples.range(lo..hi)
    }

    /// The newest sample with `t_ns < t_ns_limit`.
    pub fn before(&self, t_ns_limit: u64) -> Option<&GpuSample> {
        let i = self.samples.partition_point(|s| s.t_ns < t_ns_limit);
        i.checked_sub(1).and_then(|i| self.samples.get(i))
    }

    /// Aggregates the samples inside `[t0_ns, t1_ns]`. When none falls inside, the newest sample
    /// before `t0_ns` is used if it is at most `fallback_max_age_ns` older than `t0_ns`
    /// (windows shorter than the sampling period). None when nothing qualifies.
    pub fn window(
        &self,
        t0_ns: u64,
        t1_ns: u64,
        fallback_max_age_ns: u64,
    ) -> Option<WindowReadings> {
        let mut w = WindowReadings::default();
        for s in self.range(t0_ns, t1_ns) {
            w.add(s);
        }
        if w.samples == 0 {
            let s = self.before(t0_ns)?;
            if t0_ns - s.t_ns > fallback_max_age_ns {
                return None;
            }
            w.add(s);
            w.before_window = true;
        }
        Some(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn sample(t_ms: u64, sm_mhz: u64, used_gib: u64, throttle: u64) -> GpuSample {
        GpuSample {
            t_ns: t_ms * MS,
            gpu: 0,
            sm_clock_hz: Some(sm_mhz * 1_000_000),
            mem_clock_hz: Some(9_501_000_000),
            mem_used_bytes: Some(used_gib << 30),
            mem_total_bytes: Some(80 << 30),
            utilization_ratio: Some(0.5),
            mem_utilization_ratio: Some(0.1),
            power_watts: Some(250.0),
            temperature_celsius: Some(60.0),
            throttle_reasons: Some(ThrottleReasons(throttle)),
        }
    }

    fn ring() -> SampleRing {
        let mut r = SampleRing::new(u64::MAX, 10_000);
        for t in (0..1000).step_by(100) {
            let (sm, thr) = if (300..700).contains(&t) {
                (1200, 0x20)
            } else {
                (1980, 0)
            };
            let used = if t == 500 { 76 } else { 40 };
            r.push(sample(t, sm, used, thr));
        }
        r
    }

    #[test]
    fn window_reports_lowest_clock_highest_memory_and_reasons() {
        let r = ring();
        let w = r.window(250 * MS, 650 * MS, 0).expect("window");
        assert_eq!(w.samples, 4); // 300, 400, 500, 600
        assert!(!w.before_window);
        assert_eq!(w.sm_clock_min_hz, Some(1_200_000_000));
        assert_eq!(w.mem_used_max_bytes, Some(76 << 30));
        assert_eq!(w.mem_total_bytes, Some(80 << 30));
        assert!((w.mem_used_max_ratio.unwrap_or(0.0) - 0.95).abs() < 1e-9);
        assert!(w.memory_above(0.9));
        assert!(!w.memory_above(0.96));
        assert_eq!(w.throttle_reasons, vec!["sw_thermal_slowdown"]);
        assert!(w.throttled());

        let calm = r.window(0, 250 * MS, 0).expect("window");
        assert_eq!(calm.samples, 3);
        assert_eq!(calm.sm_clock_min_hz, Some(1_980_000_000));
        assert!(calm.throttle_reasons.is_empty());
        assert!(!calm.throttled());
        assert_eq!(calm.mem_used_max_bytes, Some(40 << 30));
    }

    #[test]
    fn window_bounds_are_inclusive() {
        let r = ring();
        assert_eq!(r.window(300 * MS, 300 * MS, 0).map(|w| w.samples), Some(1));
        assert_eq!(r.range(300 * MS, 500 * MS).count(), 3);
        assert_eq!(r.range(500 * MS, 300 * MS).count(), 0);
    }

    #[test]
    fn short_window_uses_the_sample_before() {
        let r = ring();
        let w = r.window(410 * MS, 420 * MS, 100 * MS).expect("window");
        assert!(w.before_window);
        assert_eq!(w.samples, 1);
        assert_eq!(w.sm_clock_min_hz, Some(1_200_000_000));
        // Too old a sample does not count.
        assert!(r.window(410 * MS, 420 * MS, 5 * MS).is_none());
        // Nothing before the first sample.
        let mut r2 = SampleRing::new(u64::MAX, 10);
        r2.push(sample(100, 1980, 1, 0));
        assert!(r2.window(0, 50 * MS, u64::MAX).is_none());
        // After the last sample: the last one, if fresh enough.
        assert!(r.window(950 * MS, 990 * MS, 100 * MS).is_some());
        assert!(r.window(5_000 * MS, 6_000 * MS, 100 * MS).is_none());
    }

    #[test]
    fn missing_readings_are_skipped_not_zero() {
        let mut r = SampleRing::new(u64::MAX, 10);
        let mut a = sample(0, 1980, 10, 0);
        a.sm_clock_hz = None;
        a.throttle_reasons = None;
        r.push(a);
        let w = r.window(0, 10, 0).expect("window");
        assert_eq!(w.sm_clock_min_hz, None);
        assert_eq!(w.mem_used_max_bytes, Some(10 << 30));
        r.push(sample(1, 1500, 5, 0x4));
        let w = r.window(0, 2 * MS, 0).expect("window");
        assert_eq!(w.sm_clock_min_hz, Some(1_500_000_000));
        assert_eq!(w.mem_used_max_bytes, Some(10 << 30));
        assert_eq!(w.throttle_reasons, vec!["sw_power_cap"]);
    }

    #[test]
    fn ring_is_bounded_by_age_and_count() {
        let mut r = SampleRing::new(1_000 * MS, 5);
        for t in 0..20 {
            r.push(sample(t * 100, 1980, 1, 0));
        }
        assert_eq!(r.len(), 5);
        assert_eq!(r.oldest().map(|s| s.t_ns), Some(1_500 * MS));
        assert_eq!(r.latest().map(|s| s.t_ns), Some(1_900 * MS));

        let mut r = SampleRing::new(1_000 * MS, 1_000);
        for t in 0..100 {
            r.push(sample(t * 100, 1980, 1, 0));
        }
        // Newest at 9900 ms: everything older than 8900 ms is gone.
        assert_eq!(r.len(), 11);
        assert_eq!(r.oldest().map(|s| s.t_ns), Some(8_900 * MS));
        // Out-of-order samples are dropped.
        r.push(sample(5, 1, 1, 0));
        assert_eq!(r.len(), 11);
        assert_eq!(r.latest().map(|s| s.t_ns), Some(9_900 * MS));
    }

    #[test]
    fn merge_combines_gpus() {
        let mut a = SampleRing::new(u64::MAX, 10);
        a.push(sample(0, 1980, 70, 0x1));
        let mut b = SampleRing::new(u64::MAX, 10);
        let mut s = sample(0, 1400, 20, 0x40);
        s.gpu = 1;
        s.mem_total_bytes = Some(24 << 30);
        b.push(s);
        let mut w = a.window(0, 1, 0).expect("a");
        w.merge(&b.window(0, 1, 0).expect("b"));
        assert_eq!(w.gpus, vec![0, 1]);
        assert_eq!(w.samples, 2);
        assert_eq!(w.sm_clock_min_hz, Some(1_400_000_000));
        assert_eq!(w.mem_used_max_bytes, Some(70 << 30));
        assert_eq!(w.mem_total_bytes, Some(80 << 30));
        assert!((w.mem_used_max_ratio.unwrap_or(0.0) - 70.0 / 80.0).abs() < 1e-9);
        assert_eq!(w.throttle_reasons, vec!["gpu_idle", "hw_thermal_slowdown"]);
    }

    #[test]
    fn window_serializes_to_json() {
        let w = ring().window(250 * MS, 650 * MS, 0).expect("window");
        let v = serde_json::to_value(&w).expect("json");
        assert_eq!(v["sm_clock_min_hz"], 1_200_000_000u64);
        assert_eq!(v["throttle_reasons"][0], "sw_thermal_slowdown");
        assert!(v.get("throttle_mask").is_none());
    }
}
