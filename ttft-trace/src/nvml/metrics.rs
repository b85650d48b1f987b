//! Prometheus gauges for the GPU readings. Registered only once NVML works, so that a host
//! without NVML exposes no GPU series at all (absent, not zero).
//!
//! A reading that fails in a sample has its series removed until it succeeds again: a failed
//! reading is absent from /metrics, never a stale value and never 0.

use prometheus::core::Collector;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};

use super::throttle::REASONS;
use super::timeline::GpuSample;

const GPU_LABELS: &[&str] = &["gpu", "uuid"];

/// The GPU metric families, registered on one registry.
#[derive(Clone)]
pub struct GpuMetrics {
    sm_clock: GaugeVec,
    mem_clock: GaugeVec,
    mem_used: GaugeVec,
    mem_total: GaugeVec,
    utilization: GaugeVec,
    power: GaugeVec,
    temperature: GaugeVec,
    throttle: GaugeVec,
    errors: IntCounterVec,
}

fn gauge(name: &str, help: &str) -> prometheus::Result<GaugeVec> {
    GaugeVec::new(Opts::new(name, help), GPU_LABELS)
}

impl GpuMetrics {
    /// Creates and registers every GPU family on `registry` (all or none).
    pub fn register(registry: &Registry) -> prometheus::Result<GpuMetrics> {
        let m = GpuMetrics {
            sm_clock: gauge("ttft_trace_gpu_sm_clock_hertz", "Current SM clock.")?,
            mem_clock: gauge("ttft_trace_gpu_memory_clock_hertz", "Current memory clock.")?,
            mem_used: gauge(
                "ttft_trace_gpu_memory_used_bytes",
                "Device memory allocated.",
            )?,
            mem_total: gauge(
                "ttft_trace_gpu_memory_total_bytes",
                "Device memory installed.",
            )?,
            utilization: gauge(
                "ttft_trace_gpu_utilization_ratio",
                "Share of NVML's last sample period in which a kernel was running (0..1).",
            )?,
            power: gauge(
                "ttft_trace_gpu_power_watts",
                "Power draw of the GPU and its memory.",
            )?,
            temperature: gauge("ttft_trace_gpu_temperature_celsius", "GPU die temperature.")?,
            throttle: GaugeVec::new(
                Opts::new(
                    "ttft_trace_gpu_throttle_active",
                    "1 while NVML reports this clock-throttle reason active on the GPU, else 0.",
                ),
                &["gpu", "uuid", "reason"],
            )?,
            errors: IntCounterVec::new(
                Opts::new(
                    "ttft_trace_gpu_reading_errors_total",
                    "NVML readings that failed (left out of the sample), by reading.",
                ),
                &["gpu", "uuid", "reading"],
            )?,
        };
        for (i, c) in m.collectors().into_iter().enumerate() {
            if let Err(e) = registry.register(c) {
                for d in m.collectors().into_iter().take(i) {
                    // Best effort: undo what this call registered.
                    let _ = registry.unregister(d);
                }
                return Err(e);
            }
        }
        Ok(m)
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.sm_clock.clone()),
            Box::new(self.mem_clock.clone()),
            Box::new(self.mem_used.clone()),
            Box::new(self.mem_total.clone()),
            Box::new(self.utilization.clone()),
            Box::new(self.power.clone()),
            Box::new(self.temperature.clone()),
            Box::new(self.throttle.clone()),
            Box::new(self.errors.clone()),
        ]
    }

    /// Removes every family from `registry` (used when the sampler stops).
    pub fn unregister(&self, registry: &Registry) {
        for c in self.collectors() {
            let _ = registry.unregister(c);
        }
    }

    /// Sets (or, for a failed reading, removes) every series of one GPU from one sample.
    pub fn update(&self, uuid: &str, s: &GpuSample) {
        let gpu = s.gpu.to_string();
        let labels = [gpu.as_str(), uuid];
        let set = |g: &GaugeVec, v: Option<f64>| match v {
            Some(v) => g.with_label_values(&labels).set(v),
            // Err only means "no such series": nothing to remove.
            None => {
                let _ = g.remove_label_values(&labels);
            }
        };
        set(&self.sm_clock, s.sm_clock_hz.map(|v| v as f64));
        set(&self.mem_clock, s.mem_clock_hz.map(|v| v as f64));
        set(&self.mem_used, s.mem_used_bytes.map(|v| v as f64));
        set(&self.mem_total, s.mem_total_bytes.map(|v| v as f64));
        set(&self.utilization, s.utilization_ratio);
        set(&self.power, s.power_watts);
        set(&self.temperature, s.temperature_celsius);
        for &(bit, reason) in REASONS {
            let l = [gpu.as_str(), uuid, reason];
            match s.throttle_reasons {
                Some(r) => self
                    .throttle
                    .with_label_values(&l)
                    .set(if r.bits() & bit != 0 { 1.0 } else { 0.0 }),
                None => {
                    let _ = self.throttle.remove_label_values(&l);
                }
            }
        }
    }

    /// Counts one failed reading.
    pub fn count_error(&self, gpu: u32, uuid: &str, reading: &str) {
        let gpu = gpu.to_string();
        self.errors
            .with_label_values(&[gpu.as_str(), uuid, reading])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::super::throttle::ThrottleReasons;
    use super::*;

    /// Series lines of one family in the text exposition format.
    fn series(reg: &Registry, name: &str) -> Vec<String> {
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&reg.gather())
            .expect("encode");
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn failed_reading_is_absent_not_zero() {
        let reg = Registry::new();
        let m = GpuMetrics::register(&reg).expect("register");
        let mut s = GpuSample {
            t_ns: 1,
            gpu: 0,
            sm_clock_hz: Some(1_980_000_000),
            mem_used_bytes: Some(1 << 30),
            throttle_reasons: Some(ThrottleReasons::SW_THERMAL_SLOWDOWN),
            ..Default::default()
        };
        m.update("GPU-x", &s);
        let sm = series(&reg, "ttft_trace_gpu_sm_clock_hertz");
        assert_eq!(
            sm,
            vec![r#"ttft_trace_gpu_sm_clock_hertz{gpu="0",uuid="GPU-x"} 1980000000"#]
        );
        assert!(series(&reg, "ttft_trace_gpu_power_watts").is_empty());
        let thr = series(&reg, "ttft_trace_gpu_throttle_active");
        assert_eq!(thr.len(), REASONS.len());
        let active: Vec<_> = thr.iter().filter(|l| l.ends_with(" 1")).collect();
        assert_eq!(active.len(), 1);
        assert!(active[0].contains(r#"reason="sw_thermal_slowdown""#));

        s.sm_clock_hz = None;
        s.throttle_reasons = None;
        m.update("GPU-x", &s);
        assert!(series(&reg, "ttft_trace_gpu_sm_clock_hertz").is_empty());
        assert!(series(&reg, "ttft_trace_gpu_throttle_active").is_empty());
        assert_eq!(series(&reg, "ttft_trace_gpu_memory_used_bytes").len(), 1);
    }

    #[test]
    fn registering_twice_on_one_registry_fails() {
        let reg = Registry::new();
        let m = GpuMetrics::register(&reg).expect("first");
        assert!(GpuMetrics::register(&reg).is_err());
        m.unregister(&reg);
        assert!(GpuMetrics::register(&reg).is_ok());
    }
}
