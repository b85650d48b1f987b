//! Prometheus counters of slow requests by cause and of SLO violations. One low-cardinality
//! label (`cause`: the six classes and `unexplained`), every series created at registration
//! so that rate() works from the first scrape.

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use super::attribution::{Attribution, CauseClass, UNEXPLAINED};

pub struct CauseMetrics {
    slow_requests: IntCounterVec,
    slo_violations: IntCounter,
}

impl CauseMetrics {
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let slow_requests = IntCounterVec::new(
            Opts::new(
                "ttft_trace_slow_requests_total",
                "Slow requests (TTFT, or the client's TTFT estimated from retransmits, above \
                 the slow threshold), once per cause found; unexplained when none",
            ),
            &["cause"],
        )?;
        let slo_violations = IntCounter::new(
            "ttft_trace_slo_violations_total",
            "Requests whose measured time to first token exceeded the slow threshold",
        )?;
        registry.register(Box::new(slow_requests.clone()))?;
        registry.register(Box::new(slo_violations.clone()))?;
        for class in CauseClass::ALL {
            slow_requests.with_label_values(&[class.name()]);
        }
        slow_requests.with_label_values(&[UNEXPLAINED]);
        Ok(Self {
            slow_requests,
            slo_violations,
        })
    }

    /// Counts one judged request (a request that is not slow counts nowhere).
    pub fn observe(&self, a: &Attribution) {
        for label in a.labels() {
            self.slow_requests.with_label_values(&[label]).inc();
        }
        if a.slo_violation {
            self.slo_violations.inc();
        }
    }
}
