//! Exact percentiles with hdrhistogram, per summary window and in total
//! (the Prometheus histograms carry the aggregatable form).

use hdrhistogram::Histogram;

/// Three significant digits over 1 µs .. 1 h, recorded in nanoseconds.
const LOWEST_NS: u64 = 1_000;
const HIGHEST_NS: u64 = 3_600_000_000_000;
const SIGFIG: u8 = 3;

/// Percentiles of one window, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Percentiles {
    pub count: u64,
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

/// A latency figure recorded for both the current window and the whole run.
pub struct LatencyRecorder {
    window: Histogram<u64>,
    total: Histogram<u64>,
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyRecorder {
    pub fn new() -> Self {
        let make = || {
            // The bounds are constants that hdrhistogram accepts; a failure
            // here is a programming error caught by the unit tests.
            Histogram::new_with_bounds(LOWEST_NS, HIGHEST_NS, SIGFIG)
                .expect("valid constant histogram bounds")
        };
        Self {
            window: make(),
            total: make(),
        }
    }

    /// Records one value; values beyond the range are clamped, not lost.
    pub fn record(&mut self, ns: u64) {
        let v = ns.clamp(LOWEST_NS, HIGHEST_NS);
        self.window.saturating_record(v);
        self.total.saturating_record(v);
    }

    /// Percentiles of the window since the last call, which starts a new one.
    pub fn take_window(&mut self) -> Percentiles {
        let p = percentiles(&self.window);
        self.window.reset();
        p
    }

    pub fn total(&self) -> Percentiles {
        percentiles(&self.total)
    }
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    Percentiles {
        count: h.len(),
        p50: h.value_at_quantile(0.50),
        p95: h.value_at_quantile(0.95),
        p99: h.value_at_quantile(0.99),
        p999: h.value_at_quantile(0.999),
        max: h.max(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_exact_to_three_digits() {
        let mut r = LatencyRecorder::new();
        for i in 1..=1000u64 {
            r.record(i * 1_000_000); // 1 ms .. 1 s
        }
        let w = r.take_window();
        assert_eq!(w.count, 1000);
        let close = |got: u64, want: u64| got.abs_diff(want) * 1000 <= want;
        assert!(close(w.p50, 500_000_000), "{w:?}");
        assert!(close(w.p99, 990_000_000), "{w:?}");
        assert!(close(w.p999, 999_000_000), "{w:?}");
        assert!(close(w.max, 1_000_000_000), "{w:?}");
        assert_eq!(r.take_window().count, 0, "window restarts");
        assert_eq!(r.total().count, 1000, "total keeps everything");
    }

    #[test]
    fn out_of_range_values_are_clamped() {
        let mut r = LatencyRecorder::new();
        r.record(0);
        r.record(u64::MAX);
        let t = r.total();
        assert_eq!(t.count, 2);
        assert!(t.max >= HIGHEST_NS);
    }
}
