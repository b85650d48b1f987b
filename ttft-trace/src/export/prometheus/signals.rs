//! Metrics of the scheduler and TCP signals. The run-queue delay histogram
//! is aggregated in the kernel (log2 ns buckets) and exported as a
//! Prometheus histogram whose bucket bounds are those powers of two.

use std::sync::{Arc, Mutex};

use prometheus::{
    Counter, CounterVec, IntCounterVec, Opts, Registry,
    core::{Collector, Desc},
    proto::{Bucket, Histogram, Metric, MetricFamily, MetricType},
};
use ttft_trace_common::signals::{RUNQ_BUCKETS, SchedTotals, TCP_RETRANSMIT};

const RUNQ_NAME: &str = "ttft_trace_runqueue_delay_seconds";
const RUNQ_HELP: &str = "Run-queue delay of the traced threads (runnable, waiting for a CPU): \
    wakeup or preemption to running";
/// Smallest bucket bound exported: 2^10 ns (about 1 µs); smaller waits are
/// all in it.
const FIRST_EXPORTED_BUCKET: u32 = 9;

/// The kernel's run-queue histogram as last read.
#[derive(Debug, Default, Clone)]
struct RunqSnapshot {
    buckets: Vec<u64>,
    sum_ns: u64,
}

/// Exports the kernel histogram at scrape time.
#[derive(Clone)]
pub struct RunqHistogram {
    desc: Desc,
    snapshot: Arc<Mutex<RunqSnapshot>>,
}

impl RunqHistogram {
    fn new() -> prometheus::Result<Self> {
        Ok(Self {
            desc: Desc::new(
                RUNQ_NAME.into(),
                RUNQ_HELP.into(),
                Vec::new(),
                Default::default(),
            )?,
            snapshot: Arc::default(),
        })
    }

    /// Replaces the snapshot with the kernel's current totals (`buckets`
    /// holds `RUNQ_BUCKETS` counts, each already summed over CPUs).
    pub fn set(&self, buckets: Vec<u64>, sum_ns: u64) {
        if let Ok(mut s) = self.snapshot.lock() {
            *s = RunqSnapshot { buckets, sum_ns };
        }
    }
}

impl Collector for RunqHistogram {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let snap = self.snapshot.lock().map(|s| s.clone()).unwrap_or_default();
        let mut cumulative = 0u64;
        let mut buckets = Vec::new();
        for i in 0..RUNQ_BUCKETS {
            cumulative += snap.buckets.get(i as usize).copied().unwrap_or(0);
            if i < FIRST_EXPORTED_BUCKET || i + 1 == RUNQ_BUCKETS {
                // Folded into the next bound / the +Inf bucket.
                continue;
            }
            let mut b = Bucket::default();
            // Bucket i holds [2^i, 2^(i+1)) ns: all of it is <= 2^(i+1) ns.
            b.set_upper_bound((1u64 << (i + 1)) as f64 / 1e9);
            b.set_cumulative_count(cumulative);
            buckets.push(b);
        }
        let mut h = Histogram::default();
        h.set_sample_count(cumulative);
        h.set_sample_sum(snap.sum_ns as f64 / 1e9);
        h.set_bucket(buckets);
        let mut m = Metric::default();
        m.set_histogram(h);
        let mut mf = MetricFamily::default();
        mf.set_name(RUNQ_NAME.into());
        mf.set_help(RUNQ_HELP.into());
        mf.set_field_type(MetricType::HISTOGRAM);
        mf.set_metric(vec![m]);
        vec![mf]
    }
}

pub struct SignalMetrics {
    pub runq: RunqHistogram,
    offcpu: CounterVec,
    oncpu: Counter,
    tcp: IntCounterVec,
}

impl SignalMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let runq = RunqHistogram::new()?;
        let offcpu = CounterVec::new(
            Opts::new(
                "ttft_trace_offcpu_seconds_total",
                "Off-CPU time of the traced threads: runnable (waiting for a CPU) or blocked \
                 (sleeping, waiting on locks or I/O)",
            ),
            &["state"],
        )?;
        let oncpu = Counter::new(
            "ttft_trace_oncpu_seconds_total",
            "On-CPU time of the traced threads",
        )?;
        let tcp = IntCounterVec::new(
            Opts::new(
                "ttft_trace_tcp_events_total",
                "TCP retransmits and resets on followed server connections",
            ),
            &["event"],
        )?;
        registry.register(Box::new(runq.clone()))?;
        registry.register(Box::new(offcpu.clone()))?;
        registry.register(Box::new(oncpu.clone()))?;
        registry.register(Box::new(tcp.clone()))?;
        for state in ["runnable", "blocked"] {
            offcpu.with_label_values(&[state]);
        }
        for event in ["retransmit", "reset"] {
            tcp.with_label_values(&[event]);
        }
        Ok(Self {
            runq,
            offcpu,
            oncpu,
            tcp,
        })
    }

    /// Sets the time counters to the kernel's totals over every process
    /// seen (`total` only grows: callers keep exited processes' last values).
    pub fn set_sched_totals(&self, total: &SchedTotals) {
        let set = |c: &Counter, ns: u64| {
            let delta = ns as f64 / 1e9 - c.get();
            if delta > 0.0 {
                c.inc_by(delta);
            }
        };
        set(&self.offcpu.with_label_values(&["runnable"]), total.runq_ns);
        set(
            &self.offcpu.with_label_values(&["blocked"]),
            total.blocked_ns,
        );
        set(&self.oncpu, total.oncpu_ns);
    }

    pub fn tcp_event(&self, what: u32) {
        let event = if what == TCP_RETRANSMIT {
            "retransmit"
        } else {
            "reset"
        };
        self.tcp.with_label_values(&[event]).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_histogram_renders_as_prometheus_buckets() {
        let reg = Registry::new();
        let m = SignalMetrics::new(&reg).expect("metrics");
        let mut buckets = vec![0u64; RUNQ_BUCKETS as usize];
        buckets[5] = 3; // 32-63 ns: folded into the first exported bound
        buckets[19] = 2; // ~0.5-1 ms
        buckets[(RUNQ_BUCKETS - 1) as usize] = 1; // beyond the last bound
        m.runq.set(buckets, 2_500_000);
        m.set_sched_totals(&SchedTotals {
            oncpu_ns: 3_500_000_000,
            runq_ns: 0,
            runq_count: 0,
            blocked_ns: 1_000_000_000,
        });
        m.tcp_event(TCP_RETRANSMIT);
        let text = super::super::render(&reg);
        for needle in [
            "ttft_trace_runqueue_delay_seconds_bucket{le=\"0.000001024\"} 3",
            "ttft_trace_runqueue_delay_seconds_bucket{le=\"0.001048576\"} 5",
            "ttft_trace_runqueue_delay_seconds_bucket{le=\"+Inf\"} 6",
            "ttft_trace_runqueue_delay_seconds_count 6",
            "ttft_trace_runqueue_delay_seconds_sum 0.0025",
            "ttft_trace_offcpu_seconds_total{state=\"blocked\"} 1",
            "ttft_trace_offcpu_seconds_total{state=\"runnable\"} 0",
            "ttft_trace_oncpu_seconds_total 3.5",
            "ttft_trace_tcp_events_total{event=\"retransmit\"} 1",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
