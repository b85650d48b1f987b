//! The GenAI metrics over OTLP: `gen_ai.server.time_to_first_token`,
//! `gen_ai.server.time_per_output_token` and `gen_ai.server.request.duration`,
//! histograms in seconds with the semantic conventions' bucket boundaries,
//! through the SDK's periodic reader and the OTLP metric exporter (same
//! endpoint, protocol and `OTEL_*` variables as the spans).
//!
//! A collector that is down costs no memory and no tracing time beyond the
//! measurement itself: a measurement only adds to a cumulative histogram
//! in memory (a fixed size per attribute set, and the sets are capped),
//! the reader's own thread
//! exports a copy of them every interval, and a failed export is counted in
//! `ttft_trace_otlp_metric_exports_total{result="failed"}` and forgotten
//! (the next one carries the same cumulative totals).

use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    time::Duration,
};

use opentelemetry::{
    KeyValue,
    metrics::{Histogram, Meter, MeterProvider as _},
};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    metrics::{
        Instrument, PeriodicReader, SdkMeterProvider, Stream, Temporality, data::ResourceMetrics,
        exporter::PushMetricExporter,
    },
};
use prometheus::{IntCounterVec, Opts, Registry};

use super::{OtlpConfig, OtlpError, Protocol, http_signal_url, scope, workload_place};
use crate::{
    requests::{Figure, Outcome, RequestRecord},
    workloads::{
        WorkloadLabels,
        labels::OVERFLOW_COMM,
        quota::{Quota, Resource as QuotaResource},
    },
};

/// Bucket boundaries, in seconds, from the OpenTelemetry semantic
/// conventions for generative AI metrics
/// (open-telemetry/semantic-conventions, docs/gen-ai/gen-ai-metrics.md,
/// "Generative AI model server metrics": each metric "SHOULD be specified
/// with ExplicitBucketBoundaries of" these).
pub const TTFT_BOUNDARIES: [f64; 16] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
pub const TPOT_BOUNDARIES: [f64; 13] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
pub const DURATION_BOUNDARIES: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

/// Attribute sets kept per histogram. The SDK keeps a cumulative histogram
/// per set for the daemon's life (retired workloads included), so this is
/// what bounds its memory: about 1 KiB a set by estimate (bucket counters,
/// sum, min, max, the attribute list), three histograms. Sets past
/// the cap are folded by the SDK into one set marked
/// `otel.metric.overflow=true`. The workload labels are already capped by
/// `--max-label-sets` (later workloads share `comm="_other"`); the other
/// attributes are the server port, the operation name and the error type.
pub const MAX_ATTRIBUTE_SETS: usize = 1000;

pub struct GenAiMetrics {
    provider: SdkMeterProvider,
    ttft: Histogram<f64>,
    tpot: Histogram<f64>,
    duration: Histogram<f64>,
    operation: String,
    sets: AttributeSets,
}

/// What tells two attribute sets of one workload apart: the server port
/// and the `error.type` (the operation name is the same for all).
type SetKey = (u16, Option<String>);

/// The attribute sets handed to the SDK, by workload: one workload (its
/// pod, else its label set) holds at most a share of them; a request that
/// would open a new set past it is recorded in the workload's overflow set
/// instead (`ttft_trace.workload.comm="_other"`, its pod and namespace
/// kept, no port or error type), counted in
/// `ttft_trace_quota_exceeded_total{resource="otlp_attribute_sets"}`.
/// The sets of a workload whose label set retired are forgotten here, so
/// that it holds no share for good.
#[derive(Debug)]
pub struct AttributeSets {
    quota: Quota<String>,
    by_workload: BTreeMap<WorkloadLabels, BTreeSet<SetKey>>,
    held: BTreeMap<String, usize>,
}

impl AttributeSets {
    pub fn new(share: usize) -> Self {
        Self {
            quota: Quota::new(QuotaResource::OtlpAttributeSets, share),
            by_workload: BTreeMap::new(),
            held: BTreeMap::new(),
        }
    }

    /// Who a workload's sets are counted for: its pod, else its label set.
    fn tenant(labels: &WorkloadLabels) -> String {
        if labels.pod.is_empty() {
            format!("workload {}/{}", labels.comm, labels.container)
        } else {
            format!("pod {}/{}", labels.namespace, labels.pod)
        }
    }

    /// Whether the set (`labels`, `key`) may be recorded: it exists, or its
    /// workload is under its share (then it is kept); past it, refused and
    /// counted.
    pub fn admit(&mut self, labels: &WorkloadLabels, key: SetKey) -> bool {
        if self
            .by_workload
            .get(labels)
            .is_some_and(|s| s.contains(&key))
        {
            return true;
        }
        let tenant = Self::tenant(labels);
        let held = self.held.get(&tenant).copied().unwrap_or(0);
        if !self.quota.admit(&tenant, held) {
            return false;
        }
        self.by_workload
            .entry(labels.clone())
            .or_default()
            .insert(key);
        *self.held.entry(tenant).or_default() += 1;
        true
    }

    /// Forgets the sets of the workloads reported under `labels` (their
    /// label set retired).
    pub fn retire(&mut self, labels: &WorkloadLabels) {
        let Some(sets) = self.by_workload.remove(labels) else {
            return;
        };
        let tenant = Self::tenant(labels);
        if let Some(n) = self.held.get_mut(&tenant) {
            *n = n.saturating_sub(sets.len());
            if *n == 0 {
                self.held.remove(&tenant);
            }
        }
        let (held, share) = (&self.held, self.quota.share());
        self.quota
            .settle(|t| held.get(t).is_some_and(|&n| n >= share));
    }

    /// Sets refused past a share since the start.
    pub fn exceeded(&self) -> u64 {
        self.quota.exceeded
    }

    /// Sets kept now.
    pub fn len(&self) -> usize {
        self.held.values().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

impl GenAiMetrics {
    /// Starts the reader's thread; the exporter connects lazily, so a
    /// collector that is not up yet is not an error.
    pub fn start(
        cfg: &OtlpConfig,
        resource: Resource,
        registry: &Registry,
    ) -> Result<Self, OtlpError> {
        let exporter = OnRuntime::build(cfg, registry)?;
        let mut reader = PeriodicReader::builder(exporter);
        if let Some(every) = cfg.metrics_every {
            reader = reader.with_interval(every);
        }
        let provider = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(reader.build())
            .with_view(capped)
            .build();
        let meter = provider.meter_with_scope(scope());
        Ok(Self {
            ttft: histogram(
                &meter,
                "gen_ai.server.time_to_first_token",
                "Time to generate the first token, from the request's arrival to the first body \
                 bytes sent",
                &TTFT_BOUNDARIES,
            ),
            tpot: histogram(
                &meter,
                "gen_ai.server.time_per_output_token",
                "Time per output chunk after the first, for successful responses",
                &TPOT_BOUNDARIES,
            ),
            duration: histogram(
                &meter,
                "gen_ai.server.request.duration",
                "Request duration, from arrival to the response's last send",
                &DURATION_BOUNDARIES,
            ),
            provider,
            operation: cfg.gen_ai_operation_name.clone(),
            sets: AttributeSets::new(cfg.attribute_sets_per_workload),
        })
    }

    /// Records the request's figures: the same TTFT and TPOT the Prometheus
    /// histograms take, and its duration when it has an end.
    pub fn request(&mut self, labels: &WorkloadLabels, r: &RequestRecord) {
        let own = self.sets.admit(labels, (r.server_port, None));
        let mut attrs = if own {
            attributes(&self.operation, labels, r)
        } else {
            overflow_attributes(&self.operation, labels)
        };
        for (figure, ns) in r.observations() {
            match figure {
                Figure::Ttft => self.ttft.record(seconds(ns), &attrs),
                Figure::Tpot => self.tpot.record(seconds(ns), &attrs),
                _ => {}
            }
        }
        if let Some(ns) = duration_ns(r) {
            let error = error_type(r);
            if let Some(e) = error.clone() {
                if own && self.sets.admit(labels, (r.server_port, Some(e.clone()))) {
                    attrs.push(KeyValue::new("error.type", e));
                } else {
                    attrs = overflow_attributes(&self.operation, labels);
                }
            }
            self.duration.record(seconds(ns), &attrs);
        }
    }

    /// Forgets the attribute sets of retired label sets.
    pub fn retire(&mut self, retired: &[WorkloadLabels]) {
        for labels in retired {
            self.sets.retire(labels);
        }
    }

    /// Attribute sets refused past a workload's share since the start.
    pub fn sets_refused(&self) -> u64 {
        self.sets.exceeded()
    }

    /// Attribute sets kept now (the SDK's may be more: see
    /// [`MAX_ATTRIBUTE_SETS`]).
    pub fn sets_kept(&self) -> usize {
        self.sets.len()
    }

    /// Exports the totals one last time and stops the reader (bounded: the
    /// SDK waits at most 5 s).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            log::debug!("OTLP metrics shutdown: {e}");
        }
    }
}

fn histogram(
    meter: &Meter,
    name: &'static str,
    description: &'static str,
    boundaries: &[f64],
) -> Histogram<f64> {
    meter
        .f64_histogram(name)
        .with_unit("s")
        .with_description(description)
        .with_boundaries(boundaries.to_vec())
        .build()
}

/// The view that caps every instrument's attribute sets.
fn capped(_: &Instrument) -> Option<Stream> {
    Stream::builder()
        .with_cardinality_limit(MAX_ATTRIBUTE_SETS)
        .build()
        .ok()
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// The conventions' attributes we know (the operation as configured: the
/// request path is not read; no model: the request body is not read) and
/// the workload's labels, which are low in cardinality by construction.
fn attributes(operation: &str, labels: &WorkloadLabels, r: &RequestRecord) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("gen_ai.operation.name", operation.to_string()),
        KeyValue::new("server.port", i64::from(r.server_port)),
        KeyValue::new("ttft_trace.workload.comm", labels.comm.clone()),
    ];
    a.extend(workload_place(labels));
    a.extend(
        labels
            .pid
            .map(|p| KeyValue::new("process.pid", i64::from(p))),
    );
    a
}

/// A workload's overflow set: the operation, `comm="_other"`, its pod and
/// namespace (what it costs stays its pod's).
fn overflow_attributes(operation: &str, labels: &WorkloadLabels) -> Vec<KeyValue> {
    let overflow = WorkloadLabels {
        comm: OVERFLOW_COMM.into(),
        pod: labels.pod.clone(),
        namespace: labels.namespace.clone(),
        ..WorkloadLabels::default()
    };
    let mut a = vec![
        KeyValue::new("gen_ai.operation.name", operation.to_string()),
        KeyValue::new("ttft_trace.workload.comm", overflow.comm.clone()),
    ];
    a.extend(workload_place(&overflow));
    a
}

/// The request's duration, when it has one: arrival to the last send, for
/// whole responses and for those that ended in an error. Requests still in
/// flight at exit have no end; HTTP/2 periods and pipelined requests are
/// not requests one can time.
fn duration_ns(r: &RequestRecord) -> Option<u64> {
    match r.outcome {
        Outcome::Ok => r.e2e_ns,
        Outcome::ErrorStatus
        | Outcome::ClosedMidResponse
        | Outcome::ClosedBeforeResponse
        | Outcome::Reset
        | Outcome::GoAway
        | Outcome::Evicted => r.t_done_ns.map(|d| d.saturating_sub(r.t_arrive_ns)),
        Outcome::PipelinedUnsupported
        | Outcome::Http2Unsupported
        | Outcome::TlsUnsupported
        | Outcome::InFlightAtExit => None,
    }
}

/// `error.type` of a failed request: the HTTP status code for an error
/// response (the conventions' example), else the outcome's name.
fn error_type(r: &RequestRecord) -> Option<String> {
    match r.outcome {
        Outcome::Ok => None,
        Outcome::ErrorStatus => Some(r.http_status.map_or("_OTHER".into(), |s| s.to_string())),
        other => Some(other.name().to_string()),
    }
}

/// The OTLP metric exporter on a runtime of its own: the tonic channel and
/// the hyper client need a Tokio runtime, which the SDK's reader thread
/// does not have; each export drives this one to completion. Counts what
/// happened to each export.
struct OnRuntime {
    rt: Option<tokio::runtime::Runtime>,
    inner: opentelemetry_otlp::MetricExporter,
    exports: IntCounterVec,
}

impl OnRuntime {
    fn build(cfg: &OtlpConfig, registry: &Registry) -> Result<Self, OtlpError> {
        let exports = IntCounterVec::new(
            Opts::new(
                "ttft_trace_otlp_metric_exports_total",
                "Exports of the GenAI metrics to the OTLP collector, by result (ok, failed); \
                 a failed one loses nothing, the next carries the same cumulative totals",
            ),
            &["result"],
        )?;
        registry.register(Box::new(exports.clone()))?;
        for result in ["ok", "failed"] {
            exports.with_label_values(&[result]);
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| OtlpError::Build(e.to_string()))?;
        let built = {
            let _in_rt = rt.enter();
            let b = opentelemetry_otlp::MetricExporter::builder();
            match (cfg.protocol, cfg.endpoint.as_deref()) {
                (Protocol::Grpc, Some(e)) => b.with_tonic().with_endpoint(e).build(),
                (Protocol::Grpc, None) => b.with_tonic().build(),
                (Protocol::HttpProtobuf, e) => {
                    let b = b
                        .with_http()
                        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
                    match e {
                        Some(e) => b.with_endpoint(http_signal_url(e, "v1/metrics")).build(),
                        None => b.build(),
                    }
                }
            }
        };
        let inner = built.map_err(|e| OtlpError::Build(e.to_string()))?;
        Ok(Self {
            rt: Some(rt),
            inner,
            exports,
        })
    }
}

impl PushMetricExporter for OnRuntime {
    fn export(&self, metrics: &ResourceMetrics) -> impl Future<Output = OTelSdkResult> + Send {
        let result = match &self.rt {
            Some(rt) => rt.block_on(self.inner.export(metrics)),
            // Only while being dropped.
            None => Ok(()),
        };
        match &result {
            Ok(()) => self.exports.with_label_values(&["ok"]).inc(),
            Err(e) => {
                let failed = self.exports.with_label_values(&["failed"]);
                if failed.get() == 0 {
                    log::warn!(
                        "OTLP metric export failed (later failures are only counted; the next \
                         export carries the same totals): {e}"
                    );
                }
                failed.inc();
            }
        }
        std::future::ready(result)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

impl Drop for OnRuntime {
    /// The runtime may be dropped on a thread inside the daemon's own
    /// runtime, where a blocking drop would panic.
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests;
