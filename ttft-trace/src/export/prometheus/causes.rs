//! Prometheus counters of slow requests by cause and of SLO violations, per workload.
//! Low-cardinality labels (the workload's, `cause`: the six classes and `unexplained`),
//! every series created when its workload starts so that rate() works from the first scrape.

use prometheus::{IntCounterVec, Opts, Registry};

use super::with_label;
use crate::causes::{Attribution, CauseClass, UNEXPLAINED};

pub struct CauseMetrics {
    slow_requests: IntCounterVec,
    slo_violations: IntCounterVec,
}

/// Every value of a `cause` label over `classes`: theirs and `unexplained`.
pub(super) fn cause_labels(classes: &'static [CauseClass]) -> impl Iterator<Item = &'static str> {
    classes.iter().map(|c| c.name()).chain([UNEXPLAINED])
}

impl CauseMetrics {
    /// `workload_labels`: the label names every series carries.
    pub fn new(registry: &Registry, workload_labels: &[&str]) -> Result<Self, prometheus::Error> {
        let slow_requests = IntCounterVec::new(
            Opts::new(
                "ttft_trace_slow_requests_total",
                "Slow requests (TTFT, or the client's TTFT estimated from retransmits, above \
                 the slow threshold), once per cause found; unexplained when none",
            ),
            &with_label(workload_labels, "cause"),
        )?;
        let slo_violations = IntCounterVec::new(
            Opts::new(
                "ttft_trace_slo_violations_total",
                "Requests whose measured time to first token exceeded the slow threshold",
            ),
            workload_labels,
        )?;
        registry.register(Box::new(slow_requests.clone()))?;
        registry.register(Box::new(slo_violations.clone()))?;
        Ok(Self {
            slow_requests,
            slo_violations,
        })
    }

    /// Creates a workload's series at zero.
    pub fn init_workload(&self, w: &[&str]) {
        for cause in cause_labels(&CauseClass::ALL) {
            self.slow_requests.with_label_values(&with_label(w, cause));
        }
        self.slo_violations.with_label_values(w);
    }

    /// Removes a retired workload's series.
    pub fn retire_workload(&self, w: &[&str]) {
        for cause in cause_labels(&CauseClass::ALL) {
            let _ = self
                .slow_requests
                .remove_label_values(&with_label(w, cause));
        }
        let _ = self.slo_violations.remove_label_values(w);
    }

    /// Counts one judged request of workload `w` (one that is not slow counts nowhere).
    pub fn observe(&self, a: &Attribution, w: &[&str]) {
        for label in a.labels() {
            self.slow_requests
                .with_label_values(&with_label(w, label))
                .inc();
        }
        if a.slo_violation {
            self.slo_violations.with_label_values(w).inc();
        }
    }
}
