//! Prometheus series of stalls after the first token, per workload: stalls
//! by cause (the stall causes and `unexplained`), a stall-duration
//! histogram, and streams flagged degrading, with growing chunks, or
//! truncated (by how). Every series created when its workload starts, so
//! that rate() works from the first scrape.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use super::{causes::cause_labels, with_label};
use crate::{
    causes::CauseClass,
    judging::{JudgedStalls, Truncation},
};

/// Stall durations, seconds: 25 ms (a fixed threshold below the default
/// 100 ms floor) to 30 s, dense from 100 ms to 1 s where a preempted or
/// interfered decode step lands.
const STALL_BUCKETS: &[f64] = &[
    0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0,
];

pub struct StallMetrics {
    stalls: IntCounterVec,
    duration: HistogramVec,
    degrading: IntCounterVec,
    growing: IntCounterVec,
    truncated: IntCounterVec,
}

impl StallMetrics {
    /// `workload_labels`: the label names every series carries.
    pub fn new(registry: &Registry, workload_labels: &[&str]) -> Result<Self, prometheus::Error> {
        let stalls = IntCounterVec::new(
            Opts::new(
                "ttft_trace_stalls_total",
                "Stalls after the first token (a gap between chunks above the stall \
                 threshold) that were judged, once per cause found; unexplained when none",
            ),
            &with_label(workload_labels, "cause"),
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "ttft_trace_stall_duration_seconds",
                "Duration of each judged stall after the first token",
            )
            .buckets(STALL_BUCKETS.to_vec()),
            workload_labels,
        )?;
        let degrading = IntCounterVec::new(
            Opts::new(
                "ttft_trace_degrading_streams_total",
                "Responses whose last quarter of gaps was at least twice as slow as the first",
            ),
            workload_labels,
        )?;
        let growing = IntCounterVec::new(
            Opts::new(
                "ttft_trace_coarsening_streams_total",
                "Responses whose last quarter of chunks carried on average at least twice the \
                 bytes of the first (tokens coalesced per send)",
            ),
            workload_labels,
        )?;
        let truncated = IntCounterVec::new(
            Opts::new(
                "ttft_trace_truncated_streams_total",
                "Responses that ended without their normal end, after the first token: cut \
                 (closed mid-response), missing_terminator, no_finish_reason",
            ),
            &with_label(workload_labels, "how"),
        )?;
        for m in [&stalls, &degrading, &growing, &truncated] {
            registry.register(Box::new(m.clone()))?;
        }
        registry.register(Box::new(duration.clone()))?;
        Ok(Self {
            stalls,
            duration,
            degrading,
            growing,
            truncated,
        })
    }

    /// Creates a workload's series at zero.
    pub fn init_workload(&self, w: &[&str]) {
        for cause in cause_labels(&CauseClass::STALL) {
            self.stalls.with_label_values(&with_label(w, cause));
        }
        self.duration.with_label_values(w);
        self.degrading.with_label_values(w);
        self.growing.with_label_values(w);
        for how in Truncation::ALL {
            self.truncated.with_label_values(&with_label(w, how.name()));
        }
    }

    /// Removes a retired workload's series.
    pub fn retire_workload(&self, w: &[&str]) {
        for cause in cause_labels(&CauseClass::STALL) {
            let _ = self.stalls.remove_label_values(&with_label(w, cause));
        }
        let _ = self.duration.remove_label_values(w);
        let _ = self.degrading.remove_label_values(w);
        let _ = self.growing.remove_label_values(w);
        for how in Truncation::ALL {
            let _ = self
                .truncated
                .remove_label_values(&with_label(w, how.name()));
        }
    }

    /// Counts one request's judged stalls (those beyond the listed ones are
    /// counted in `ttft_trace_table_evictions_total{table="stall_windows"}`).
    pub fn observe(&self, s: &JudgedStalls, w: &[&str]) {
        for stall in &s.windows {
            for label in stall.labels() {
                self.stalls.with_label_values(&with_label(w, label)).inc();
            }
            self.duration
                .with_label_values(w)
                .observe(stall.duration_ns as f64 / 1e9);
        }
        if s.degrading {
            self.degrading.with_label_values(w).inc();
        }
        if s.chunks_growing {
            self.growing.with_label_values(w).inc();
        }
        if let Some(how) = s.truncated {
            self.truncated
                .with_label_values(&with_label(w, how.name()))
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{causes::Cause, judging::JudgedStall};

    fn stall(ms: u64, causes: &[CauseClass]) -> JudgedStall {
        JudgedStall {
            t_start_ns: 0,
            t_end_ns: ms * 1_000_000,
            duration_ns: ms * 1_000_000,
            seen_at: crate::requests::stream_stalls::SeenAt::Send,
            causes: causes
                .iter()
                .map(|&class| Cause {
                    class,
                    explained_ns: 1,
                    evidence: Default::default(),
                })
                .collect(),
            interfering_request: None,
        }
    }

    #[test]
    fn stalls_by_cause_and_their_durations() {
        let registry = Registry::new();
        let m = StallMetrics::new(&registry, &["comm"]).expect("metrics");
        let w = ["vllm"];
        m.init_workload(&w);
        m.observe(
            &JudgedStalls {
                windows: vec![
                    stall(450, &[CauseClass::PrefillInterference, CauseClass::Network]),
                    stall(2_500, &[]),
                ],
                degrading: true,
                chunks_growing: true,
                truncated: Some(Truncation::Cut),
                ..JudgedStalls::default()
            },
            &w,
        );
        let text = super::super::render(&registry);
        for needle in [
            "ttft_trace_stalls_total{cause=\"prefill_interference\",comm=\"vllm\"} 1",
            "ttft_trace_stalls_total{cause=\"network\",comm=\"vllm\"} 1",
            "ttft_trace_stalls_total{cause=\"unexplained\",comm=\"vllm\"} 1",
            "ttft_trace_stalls_total{cause=\"cpu\",comm=\"vllm\"} 0",
            "ttft_trace_stall_duration_seconds_bucket{comm=\"vllm\",le=\"0.5\"} 1",
            "ttft_trace_stall_duration_seconds_bucket{comm=\"vllm\",le=\"3\"} 2",
            "ttft_trace_stall_duration_seconds_count{comm=\"vllm\"} 2",
            "ttft_trace_degrading_streams_total{comm=\"vllm\"} 1",
            "ttft_trace_coarsening_streams_total{comm=\"vllm\"} 1",
            "ttft_trace_truncated_streams_total{comm=\"vllm\",how=\"cut\"} 1",
            "ttft_trace_truncated_streams_total{comm=\"vllm\",how=\"no_finish_reason\"} 0",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        assert!(!text.contains("cause=\"cold_start\""), "not a stall cause");
        m.retire_workload(&w);
        let text = super::super::render(&registry);
        assert!(!text.contains("vllm"), "retired series remain:\n{text}");
    }
}
