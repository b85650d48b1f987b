//! Prometheus histograms of the per-request figures, the request count by
//! outcome and the TLS handshakes of the connections, per workload. Base
//! units, low-cardinality labels (the workload's, `outcome`, the TLS
//! version and resumption): never a request, connection or client port.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use super::with_label;
use crate::requests::{Figure, Outcome, RequestRecord, TlsFacts, TlsVersion};

/// TTFT and queue, seconds: 5 ms (a cached or tiny prompt) to 30 s (a long
/// queue), dense from 50 to 500 ms where interactive service objectives
/// sit (a P99 target near 350 ms is common), since `histogram_quantile`
/// interpolates linearly inside a bucket.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.75, 1.0,
    1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0,
];

/// Time between chunks, seconds: 1 ms to 2 s, dense from 10 to 100 ms
/// where decode steps of a busy server fall (TPOT targets are usually
/// 20-100 ms); a stall of seconds still lands in a bucket of its own.
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 1.0, 2.0,
];

/// The prefill step that produced the first token, seconds: 1 ms to 10 s.
const GPU_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0,
];

/// D2H done to the first token on the wire, seconds: 50 µs (a tight
/// server) to 1 s (a stalled detokenizer or event loop).
const EGRESS_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A TLS handshake from the `ClientHello`'s arrival to its end, seconds:
/// 250 µs (a resumed session on a local link) to 5 s (a slow client or a
/// server out of CPU).
const TLS_HANDSHAKE_BUCKETS: &[f64] = &[
    0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
];

/// The `resumed` label of the TLS handshake histogram.
const RESUMED: [&str; 3] = ["true", "false", "unknown"];

/// Whole requests, seconds: 50 ms (a short completion) to 10 min (a long
/// generation at a slow decode rate).
const E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
    180.0, 300.0, 600.0,
];

fn spec(f: Figure) -> (&'static str, &'static str, &'static [f64]) {
    match f {
        Figure::Ttft => (
            "ttft_trace_time_to_first_token_seconds",
            "Time to first token: first bytes of the request received to the first \
             response send that carries body",
            TTFT_BUCKETS,
        ),
        Figure::Queue => (
            "ttft_trace_request_queue_seconds",
            "Request arrival to the first launch of the GPU episode that produced its \
             first token (0 when it joined a running batch)",
            TTFT_BUCKETS,
        ),
        Figure::Gpu => (
            "ttft_trace_request_gpu_seconds",
            "First launch to device-to-host copy done, of the GPU episode that produced \
             the request's first token",
            GPU_BUCKETS,
        ),
        Figure::Egress => (
            "ttft_trace_request_egress_seconds",
            "Device-to-host copy done to the first token sent",
            EGRESS_BUCKETS,
        ),
        Figure::Itl => (
            "ttft_trace_inter_token_latency_seconds",
            "Every gap between consecutive body sends of a response",
            ITL_BUCKETS,
        ),
        Figure::E2e => (
            "ttft_trace_request_duration_seconds",
            "First bytes of the request received to the last send of its response",
            E2E_BUCKETS,
        ),
        Figure::Tpot => (
            "ttft_trace_time_per_output_token_seconds",
            "(duration - time to first token) / (chunks - 1), per request with more \
             than one chunk",
            ITL_BUCKETS,
        ),
    }
}

pub struct RequestMetrics {
    /// Indexed by `Figure as usize`.
    figures: Vec<HistogramVec>,
    requests: IntCounterVec,
    tls_handshake: HistogramVec,
    retries: IntCounterVec,
}

impl RequestMetrics {
    /// `workload_labels`: the label names every series carries.
    pub fn new(registry: &Registry, workload_labels: &[&str]) -> Result<Self, prometheus::Error> {
        let figures = Figure::ALL
            .iter()
            .map(|&f| {
                let (name, help, buckets) = spec(f);
                let h = HistogramVec::new(
                    HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                    workload_labels,
                )?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            })
            .collect::<Result<Vec<_>, prometheus::Error>>()?;
        let requests = IntCounterVec::new(
            Opts::new(
                "ttft_trace_requests_total",
                "Requests seen on the traced server's connections, by outcome",
            ),
            &with_label(workload_labels, "outcome"),
        )?;
        registry.register(Box::new(requests.clone()))?;
        let tls_handshake = HistogramVec::new(
            HistogramOpts::new(
                "ttft_trace_tls_handshake_seconds",
                "TLS handshakes of the traced server's connections seen opening, from the \
                 ClientHello's arrival to the handshake's end as the wire shows it, by version \
                 and resumption",
            )
            .buckets(TLS_HANDSHAKE_BUCKETS.to_vec()),
            &[workload_labels, &["version", "resumed"]].concat(),
        )?;
        registry.register(Box::new(tls_handshake.clone()))?;
        let retries = IntCounterVec::new(
            Opts::new(
                "ttft_trace_retried_requests_total",
                "Requests that retried an interrupted one (reset, refused by a GOAWAY, or closed \
                 before or during its response) from the same client address to the same port \
                 within the retry window (retry_of in the JSONL)",
            ),
            workload_labels,
        )?;
        registry.register(Box::new(retries.clone()))?;
        Ok(Self {
            figures,
            requests,
            tls_handshake,
            retries,
        })
    }

    /// Creates a workload's series at zero, so that rate() works from the
    /// first scrape.
    pub fn init_workload(&self, w: &[&str]) {
        for h in &self.figures {
            h.with_label_values(w);
        }
        for o in Outcome::ALL {
            self.requests.with_label_values(&with_label(w, o.name()));
        }
        self.retries.with_label_values(w);
    }

    /// Removes a retired workload's series.
    pub fn retire_workload(&self, w: &[&str]) {
        for h in &self.figures {
            let _ = h.remove_label_values(w);
        }
        for o in Outcome::ALL {
            let _ = self.requests.remove_label_values(&with_label(w, o.name()));
        }
        let _ = self.retries.remove_label_values(w);
        for v in TlsVersion::ALL {
            for r in RESUMED {
                let _ = self
                    .tls_handshake
                    .remove_label_values(&[w, &[v.as_str(), r]].concat());
            }
        }
    }

    /// A finished request of workload `w`.
    pub fn observe(&self, r: &RequestRecord, w: &[&str]) {
        self.requests
            .with_label_values(&with_label(w, r.outcome.name()))
            .inc();
        for (figure, ns) in r.observations() {
            self.figures[figure as usize]
                .with_label_values(w)
                .observe(ns as f64 / 1e9);
        }
        if r.retry_of.is_some() {
            self.retries.with_label_values(w).inc();
        }
        // Once per connection: on the record that counts its handshake.
        if let Some(TlsFacts {
            version,
            resumed,
            handshake_ns: Some(ns),
            counted: true,
            ..
        }) = r.tls
        {
            let resumed = match resumed {
                Some(true) => RESUMED[0],
                Some(false) => RESUMED[1],
                None => RESUMED[2],
            };
            self.tls_handshake
                .with_label_values(&[w, &[version.as_str(), resumed]].concat())
                .observe(ns as f64 / 1e9);
        }
    }
}
