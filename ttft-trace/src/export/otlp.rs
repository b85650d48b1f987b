//! OTLP export of requests as traces (`--otlp-endpoint`, the `OTEL_*`
//! variables, `[otlp]` in the settings file), through the OpenTelemetry
//! crates' OTLP/gRPC exporter. One server span per request, from its arrival
//! to its response's end, with child spans for the queue, the GPU episode
//! that produced the first token and egress; the first token, its ACK and
//! TCP retransmits as events; figures, causes, evidence, workload labels and
//! GPU readings as attributes (semantic-convention names where they exist,
//! `ttft_trace.` otherwise).
//!
//! A collector that is down or slow never slows tracing nor grows memory:
//! spans go through a bounded queue to a thread of their own that exports
//! them in batches; a full queue or a failed export drops them, counted in
//! `ttft_trace_otlp_spans_dropped_total{reason}`.
//!
//! Beside the spans, every request (sampled or not) enters the GenAI
//! metrics ([`metrics`]).

pub mod metrics;

use std::{
    borrow::Cow,
    sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use opentelemetry::{
    Array, InstrumentationScope, KeyValue, StringValue, Value,
    trace::{Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::{
    Resource,
    trace::{IdGenerator, RandomIdGenerator, SpanData, SpanEvents, SpanExporter as _, SpanLinks},
};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use self::metrics::GenAiMetrics;
use crate::{
    host::clock::monotonic_ns,
    judging::{JudgedRequest, JudgedStall},
    workloads::WorkloadLabels,
};

/// The OTLP transport, as `OTEL_EXPORTER_OTLP_PROTOCOL` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    #[default]
    Grpc,
    HttpProtobuf,
}

impl Protocol {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "grpc" => Some(Self::Grpc),
            "http/protobuf" => Some(Self::HttpProtobuf),
            _ => None,
        }
    }
}

/// A signal's URL for OTLP/HTTP (`path`: `v1/traces`, `v1/metrics`): a base
/// URL (`http://host:4318`) gets the signal's path, as the exporter does for
/// `OTEL_EXPORTER_OTLP_ENDPOINT`; a URL with a path is used as it is.
fn http_signal_url(endpoint: &str, path: &str) -> String {
    let after_scheme = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    match after_scheme.split_once('/') {
        None => format!("{endpoint}/{path}"),
        Some((_, "")) => format!("{endpoint}{path}"),
        Some(_) => endpoint.to_string(),
    }
}

/// How requests are exported as traces.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpConfig {
    /// Collector URL (gRPC `http://host:4317`, HTTP `http://host:4318`);
    /// `None`: the exporter's own resolution
    /// (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT`,
    /// then localhost).
    pub endpoint: Option<String>,
    pub protocol: Protocol,
    /// Share of the requests that are not slow to export (0..=1); slow ones
    /// always are.
    pub sample_ratio: f64,
    /// Requests waiting for export at most; more are dropped.
    pub queue_requests: usize,
    /// Spans per export call at most.
    pub batch_spans: usize,
    /// A batch not full is sent after this long.
    pub flush_every: Duration,
    /// How often the GenAI metrics are exported; `None`: the SDK's
    /// `OTEL_METRIC_EXPORT_INTERVAL`, else 60 s.
    pub metrics_every: Option<Duration>,
    /// `gen_ai.operation.name` on the metrics: the daemon does not read
    /// request paths, so it cannot tell chat from text completion.
    pub gen_ai_operation_name: String,
    /// Attribute sets of the GenAI metrics one workload (pod, else label
    /// set) may hold (`[quotas] otlp_attribute_sets`).
    pub attribute_sets_per_workload: usize,
}

impl Default for OtlpConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            protocol: Protocol::Grpc,
            sample_ratio: 1.0,
            queue_requests: 2048,
            batch_spans: 512,
            flush_every: Duration::from_secs(1),
            metrics_every: None,
            gen_ai_operation_name: "chat".into(),
            attribute_sets_per_workload: 250,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    #[error("OTLP exporter: {0}")]
    Build(String),
    #[error("starting the OTLP export thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("OTLP metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// CLOCK_MONOTONIC (the JSONL's and the kernel's clock) to the wall clock
/// OTLP wants: one offset, taken once, so that every span's times are the
/// JSONL's plus that offset, to the nanosecond.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    /// Unix time minus monotonic time, ns.
    pub offset_ns: i128,
}

impl Clock {
    pub fn now() -> Self {
        let mono = monotonic_ns();
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        Self {
            offset_ns: wall - i128::from(mono),
        }
    }

    pub fn at(&self, monotonic_ns: u64) -> SystemTime {
        let unix = (i128::from(monotonic_ns) + self.offset_ns).max(0);
        UNIX_EPOCH + Duration::from_nanos(u64::try_from(unix).unwrap_or(u64::MAX))
    }
}

/// What the export counted, exported as Prometheus counters.
#[derive(Clone)]
struct Counters {
    exported: IntCounter,
    dropped: IntCounterVec,
    unsampled: IntCounter,
}

impl Counters {
    fn new(registry: &Registry) -> prometheus::Result<Self> {
        let exported = IntCounter::new(
            "ttft_trace_otlp_spans_exported_total",
            "Spans the OTLP collector accepted",
        )?;
        let dropped = IntCounterVec::new(
            Opts::new(
                "ttft_trace_otlp_spans_dropped_total",
                "Spans not exported: the queue to the exporter was full (queue_full) or the \
                 collector refused or did not answer in time (export_failed)",
            ),
            &["reason"],
        )?;
        let unsampled = IntCounter::new(
            "ttft_trace_otlp_requests_unsampled_total",
            "Requests not slow and left out by the OTLP sample ratio",
        )?;
        registry.register(Box::new(exported.clone()))?;
        registry.register(Box::new(dropped.clone()))?;
        registry.register(Box::new(unsampled.clone()))?;
        for reason in ["queue_full", "export_failed"] {
            dropped.with_label_values(&[reason]);
        }
        Ok(Self {
            exported,
            dropped,
            unsampled,
        })
    }
}

/// The OTLP sink.
pub struct Otlp {
    metrics: GenAiMetrics,
    queue: Option<SyncSender<Vec<SpanData>>>,
    done: Receiver<()>,
    counters: Counters,
    clock: Clock,
    ids: RandomIdGenerator,
    sample_ratio: f64,
    /// How long shutdown waits for the last batches.
    flush_deadline: Duration,
}

impl Otlp {
    /// Starts the export thread; the exporter connects lazily, so a
    /// collector that is not up yet is not an error.
    pub fn start(cfg: &OtlpConfig, registry: &Registry) -> Result<Self, OtlpError> {
        let counters = Counters::new(registry)?;
        let clock = Clock::now();
        let (queue, rx) = mpsc::sync_channel(cfg.queue_requests.max(1));
        let (done_tx, done) = mpsc::channel();
        let (ready_tx, ready) = mpsc::channel();
        let worker = Worker {
            rx,
            counters: counters.clone(),
            batch_spans: cfg.batch_spans.max(1),
            flush_every: cfg.flush_every,
        };
        let endpoint = cfg.endpoint.clone();
        let protocol = cfg.protocol;
        let resource = resource(clock);
        let metrics = GenAiMetrics::start(cfg, resource.clone(), registry)?;
        thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || {
                worker.run(protocol, endpoint, resource, ready_tx);
                let _ = done_tx.send(());
            })
            .map_err(OtlpError::Thread)?;
        ready
            .recv()
            .map_err(|_| OtlpError::Build("the export thread ended".into()))?
            .map_err(OtlpError::Build)?;
        Ok(Self {
            metrics,
            queue: Some(queue),
            done,
            counters,
            clock,
            ids: RandomIdGenerator::default(),
            sample_ratio: cfg.sample_ratio.clamp(0.0, 1.0),
            flush_deadline: Duration::from_secs(15),
        })
    }

    /// Records the request in the metrics and queues its spans, or counts
    /// them dropped; never blocks.
    pub fn request(&mut self, labels: &WorkloadLabels, root: u32, j: &JudgedRequest) {
        self.metrics.request(labels, &j.record);
        let trace_id = self.ids.new_trace_id();
        if !j.attribution.slow && !sampled(trace_id, self.sample_ratio) {
            self.counters.unsampled.inc();
            return;
        }
        let spans = spans(j, labels, root, self.clock, trace_id, &self.ids);
        let n = spans.len() as u64;
        let Some(queue) = &self.queue else { return };
        match queue.try_send(spans) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counters
                    .dropped
                    .with_label_values(&["queue_full"])
                    .inc_by(n);
            }
        }
    }

    /// The GenAI metrics' attribute sets: those of `retired` label sets
    /// forgotten; (refused past a workload's share since the start, kept
    /// now).
    pub fn attribute_sets(&mut self, retired: &[WorkloadLabels]) -> (u64, usize) {
        self.metrics.retire(retired);
        (self.metrics.sets_refused(), self.metrics.sets_kept())
    }

    /// Sends what is queued and stops the thread, waiting a bounded time
    /// (the exporter's own timeout bounds each call).
    pub fn shutdown(&mut self) {
        if self.queue.take().is_none() {
            return;
        }
        self.metrics.shutdown();
        if self.done.recv_timeout(self.flush_deadline).is_err() {
            log::warn!("the OTLP exporter did not finish in time; its last spans are lost");
        }
    }

    pub fn exported(&self) -> u64 {
        self.counters.exported.get()
    }

    pub fn dropped(&self, reason: &str) -> u64 {
        self.counters.dropped.with_label_values(&[reason]).get()
    }
}

impl Drop for Otlp {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The standard ratio sampler's rule on the trace id: the same id is
/// sampled the same way wherever it is judged.
fn sampled(id: TraceId, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let bytes = id.to_bytes();
    let mut low = [0u8; 8];
    low.copy_from_slice(&bytes[8..]);
    let x = u64::from_be_bytes(low) >> 1;
    (x as f64) < ratio * (1u64 << 63) as f64
}

/// The resource: `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` as the
/// SDK reads them, `service.name` defaulting to `ttft-trace`, and the clock
/// offset that lines the spans up with the JSONL.
fn resource(clock: Clock) -> Resource {
    let named = std::env::var_os("OTEL_SERVICE_NAME").is_some()
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="));
    let mut b = Resource::builder();
    if !named {
        b = b.with_service_name("ttft-trace");
    }
    b.with_attribute(KeyValue::new(
        "ttft_trace.clock.monotonic_to_unix_offset_ns",
        i64::try_from(clock.offset_ns).unwrap_or(i64::MAX),
    ))
    .build()
}

struct Worker {
    rx: Receiver<Vec<SpanData>>,
    counters: Counters,
    batch_spans: usize,
    flush_every: Duration,
}

impl Worker {
    fn run(
        self,
        protocol: Protocol,
        endpoint: Option<String>,
        resource: Resource,
        ready: mpsc::Sender<Result<(), String>>,
    ) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready.send(Err(e.to_string()));
                return;
            }
        };
        // The tonic channel and the hyper client are made inside the
        // runtime they will run on.
        let built = {
            let _in_rt = rt.enter();
            let b = opentelemetry_otlp::SpanExporter::builder();
            match protocol {
                Protocol::Grpc => match endpoint {
                    Some(e) => b.with_tonic().with_endpoint(e).build(),
                    None => b.with_tonic().build(),
                },
                Protocol::HttpProtobuf => {
                    let b = b
                        .with_http()
                        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
                    match endpoint {
                        Some(e) => b.with_endpoint(http_signal_url(&e, "v1/traces")).build(),
                        None => b.build(),
                    }
                }
            }
        };
        let mut exporter = match built {
            Ok(e) => e,
            Err(e) => {
                let _ = ready.send(Err(e.to_string()));
                return;
            }
        };
        exporter.set_resource(&resource);
        let _ = ready.send(Ok(()));
        let mut batch: Vec<SpanData> = Vec::new();
        let mut since = Instant::now();
        let mut failures = 0u64;
        let mut send = |batch: &mut Vec<SpanData>| {
            let n = batch.len() as u64;
            match rt.block_on(exporter.export(std::mem::take(batch))) {
                Ok(()) => self.counters.exported.inc_by(n),
                Err(e) => {
                    if failures == 0 {
                        log::warn!(
                            "OTLP export failed (its spans are dropped and counted; later \
                             failures are only counted): {e}"
                        );
                    }
                    failures += 1;
                    self.counters
                        .dropped
                        .with_label_values(&["export_failed"])
                        .inc_by(n);
                }
            }
        };
        loop {
            let wait = self.flush_every.saturating_sub(since.elapsed());
            let open = match self.rx.recv_timeout(wait) {
                Ok(spans) => {
                    batch.extend(spans);
                    true
                }
                Err(RecvTimeoutError::Timeout) => true,
                Err(RecvTimeoutError::Disconnected) => false,
            };
            while batch.len() < self.batch_spans {
                match self.rx.try_recv() {
                    Ok(spans) => batch.extend(spans),
                    Err(_) => break,
                }
            }
            let due = since.elapsed() >= self.flush_every;
            if !batch.is_empty() && (batch.len() >= self.batch_spans || due || !open) {
                send(&mut batch);
            }
            if due || batch.is_empty() {
                since = Instant::now();
            }
            if !open && batch.is_empty() {
                break;
            }
        }
        let _ = exporter.shutdown();
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope::builder("ttft-trace")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

fn int(key: &'static str, v: u64) -> KeyValue {
    KeyValue::new(key, i64::try_from(v).unwrap_or(i64::MAX))
}

fn span(
    trace_id: TraceId,
    id: SpanId,
    parent: SpanId,
    kind: SpanKind,
    name: &'static str,
    (start, end): (SystemTime, SystemTime),
    attributes: Vec<KeyValue>,
) -> SpanData {
    SpanData {
        span_context: SpanContext::new(
            trace_id,
            id,
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        ),
        parent_span_id: parent,
        parent_span_is_remote: false,
        span_kind: kind,
        name: Cow::Borrowed(name),
        start_time: start,
        end_time: end,
        attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: Status::Unset,
        instrumentation_scope: scope(),
    }
}

/// The request's spans: the server span first, then its children.
pub fn spans(
    j: &JudgedRequest,
    labels: &WorkloadLabels,
    root_pid: u32,
    clock: Clock,
    trace_id: TraceId,
    ids: &impl IdGenerator,
) -> Vec<SpanData> {
    let r = &j.record;
    let t0 = r.t_arrive_ns;
    let end = r.t_done_ns.or(r.t_first_token_ns).unwrap_or(t0).max(t0);
    let root_id = ids.new_span_id();
    let mut root = span(
        trace_id,
        root_id,
        SpanId::INVALID,
        SpanKind::Server,
        "HTTP",
        (clock.at(t0), clock.at(end)),
        request_attributes(j, labels, root_pid),
    );
    if r.http_status.is_some_and(|s| s >= 500) {
        root.status = Status::error("");
    }
    let mut events = Vec::new();
    if let Some(t) = r.t_first_token_ns {
        events.push(Event::new("first_token", clock.at(t), vec![], 0));
    }
    if let Some(t) = r.t_first_token_acked_ns {
        let attrs = r
            .srtt_ns
            .map(|s| vec![int("ttft_trace.srtt_ns", s)])
            .unwrap_or_default();
        events.push(Event::new("first_token_acked", clock.at(t), attrs, 0));
    }
    for &t in &j.evidence.retransmit_times_ns {
        events.push(Event::new("tcp.retransmit", clock.at(t), vec![], 0));
    }
    for s in &j.stalls.windows {
        events.push(Event::new(
            "stall",
            clock.at(s.t_start_ns),
            stall_attributes(s),
            0,
        ));
    }
    events.sort_by_key(|e| e.timestamp);
    root.events.events = events;
    let mut out = vec![root];
    if let (Some(q), Some(g), Some(e)) = (r.queue_ns, r.gpu_ns, r.egress_ns) {
        let (gpu_start, copy_done) = (t0 + q, t0 + q + g);
        let child = |name, from: u64, to: u64, attributes| {
            span(
                trace_id,
                ids.new_span_id(),
                root_id,
                SpanKind::Internal,
                name,
                (clock.at(from), clock.at(to)),
                attributes,
            )
        };
        out.push(child("queue", t0, gpu_start, vec![]));
        let mut gpu = Vec::new();
        gpu.extend(r.gpu_pid.map(|p| int("process.pid", u64::from(p))));
        gpu.extend(r.gpu_tid.map(|t| int("thread.id", u64::from(t))));
        gpu.extend(
            r.gpu_steps_waited
                .map(|s| int("ttft_trace.gpu.steps_waited", u64::from(s))),
        );
        out.push(child("gpu_episode", gpu_start, copy_done, gpu));
        out.push(child("egress", copy_done, copy_done + e, vec![]));
    }
    out
}

fn request_attributes(j: &JudgedRequest, labels: &WorkloadLabels, root_pid: u32) -> Vec<KeyValue> {
    let r = &j.record;
    let mut a = vec![
        KeyValue::new("network.transport", "tcp"),
        KeyValue::new("network.protocol.name", "http"),
        KeyValue::new("client.address", r.client_addr.clone()),
        int("client.port", u64::from(r.client_port)),
        KeyValue::new("server.address", r.server_addr.clone()),
        int("server.port", u64::from(r.server_port)),
        int("process.pid", u64::from(r.pid)),
        int("thread.id", u64::from(r.tid)),
        KeyValue::new("ttft_trace.connection", format!("{:#x}", r.sk)),
        int("ttft_trace.request_index", u64::from(r.request_index)),
        KeyValue::new("ttft_trace.outcome", r.outcome.name()),
        KeyValue::new("ttft_trace.slow", j.attribution.slow),
        KeyValue::new("ttft_trace.slo_violation", j.attribution.slo_violation),
        int("ttft_trace.chunks", u64::from(r.chunks)),
        int("ttft_trace.tcp_retransmits", j.tcp_retransmits as u64),
        int("ttft_trace.workload.pid", u64::from(root_pid)),
        KeyValue::new("ttft_trace.workload.comm", labels.comm.clone()),
    ];
    if let Some(s) = r.http_status {
        a.push(int("http.response.status_code", u64::from(s)));
    }
    for (key, v) in [
        ("ttft_trace.ttft_ns", r.ttft_ns),
        ("ttft_trace.queue_ns", r.queue_ns),
        ("ttft_trace.gpu_ns", r.gpu_ns),
        ("ttft_trace.egress_ns", r.egress_ns),
        ("ttft_trace.tpot_ns", r.tpot_ns),
        ("ttft_trace.e2e_ns", r.e2e_ns),
        (
            "ttft_trace.client_ttft_estimate_ns",
            r.client_ttft_estimate_ns,
        ),
    ] {
        a.extend(v.map(|v| int(key, v)));
    }
    a.extend(workload_place(labels));
    if let Some(t) = r.tls {
        // OpenTelemetry's `tls.*` conventions, and the handshake's figures.
        a.push(KeyValue::new("tls.protocol.name", "tls"));
        a.push(KeyValue::new("tls.protocol.version", t.version.as_str()));
        a.extend(t.resumed.map(|v| KeyValue::new("tls.resumed", v)));
        a.extend(
            t.handshake_ns
                .map(|ns| int("ttft_trace.tls.handshake_ns", ns)),
        );
        a.push(KeyValue::new("ttft_trace.tls.hello_retry", t.hello_retry));
        a.push(KeyValue::new("ttft_trace.tls.handshake_counted", t.counted));
    }
    if let Some(of) = r.retry_of {
        a.push(KeyValue::new(
            "ttft_trace.retry_of.connection",
            format!("{:#x}", of.conn),
        ));
        a.push(int(
            "ttft_trace.retry_of.request_index",
            u64::from(of.request_index),
        ));
    }
    a.extend(r.user_ttft_ns.map(|v| int("ttft_trace.user_ttft_ns", v)));
    let s = &j.stalls;
    a.push(int("ttft_trace.stalls.count", u64::from(s.count)));
    if s.count > 0 {
        a.push(int("ttft_trace.stalls.total_ns", s.total_ns));
        a.push(int("ttft_trace.stalls.longest_ns", s.longest_ns));
        a.push(int(
            "ttft_trace.stalls.windows_dropped",
            u64::from(s.windows_dropped),
        ));
    }
    a.extend(
        s.pace_ratio_permille
            .map(|p| int("ttft_trace.pace_ratio_permille", p)),
    );
    a.push(KeyValue::new("ttft_trace.degrading", s.degrading));
    a.extend(
        s.chunk_growth_permille
            .map(|g| int("ttft_trace.chunk_growth_permille", g)),
    );
    a.push(KeyValue::new("ttft_trace.chunks_growing", s.chunks_growing));
    a.extend(
        s.truncated
            .map(|t| KeyValue::new("ttft_trace.truncated", t.name())),
    );
    a.extend(
        s.finish_reason
            .clone()
            .map(|f| KeyValue::new("ttft_trace.finish_reason", f)),
    );
    if j.attribution.slow {
        a.push(KeyValue::new(
            "ttft_trace.causes",
            names(j.attribution.labels()),
        ));
        for c in &j.attribution.causes {
            a.push(int(cause_key(c.class.name()), c.explained_ns));
        }
        evidence_attributes(j, &mut a);
    }
    if let Some(g) = &j.evidence.gpu {
        json_attributes(
            "ttft_trace.gpu",
            &serde_json::to_value(g).unwrap_or_default(),
            &mut a,
        );
    }
    a
}

/// Cause names as an attribute value.
fn names(labels: Vec<&'static str>) -> Value {
    Value::Array(Array::String(
        labels.into_iter().map(StringValue::from).collect(),
    ))
}

/// A stall event's attributes: its duration, where it was seen (`send` or
/// `delivery`), its causes (the first, the
/// longest explained, as `cause`, with the time it explains), and the
/// request whose prefill interfered.
fn stall_attributes(s: &JudgedStall) -> Vec<KeyValue> {
    let labels = s.labels();
    let mut a = vec![
        int("ttft_trace.stall.duration_ns", s.duration_ns),
        KeyValue::new("ttft_trace.stall.seen_at", s.seen_at.name()),
        KeyValue::new("ttft_trace.stall.cause", labels[0]),
        int(
            "ttft_trace.stall.explained_ns",
            s.causes.first().map_or(0, |c| c.explained_ns),
        ),
        KeyValue::new("ttft_trace.stall.causes", names(labels)),
    ];
    if let Some(id) = s.interfering_request {
        a.push(KeyValue::new(
            "ttft_trace.stall.interfering.connection",
            format!("{:#x}", id.conn),
        ));
        a.push(int(
            "ttft_trace.stall.interfering.request_index",
            u64::from(id.request_index),
        ));
    }
    a
}

/// `ttft_trace.cause.<class>.explained_ns`, as static keys.
fn cause_key(class: &str) -> &'static str {
    match class {
        "queueing" => "ttft_trace.cause.queueing.explained_ns",
        "batching" => "ttft_trace.cause.batching.explained_ns",
        "cpu" => "ttft_trace.cause.cpu.explained_ns",
        "network" => "ttft_trace.cause.network.explained_ns",
        "gpu_memory" => "ttft_trace.cause.gpu_memory.explained_ns",
        "cold_start" => "ttft_trace.cause.cold_start.explained_ns",
        _ => "ttft_trace.cause.other.explained_ns",
    }
}

/// The kernel's evidence over a slow request: totals without times, so
/// attributes rather than events (the retransmits, which have times, are
/// events).
fn evidence_attributes(j: &JudgedRequest, a: &mut Vec<KeyValue>) {
    let e = &j.evidence;
    for (key, v) in [
        ("ttft_trace.evidence.runq_ns", e.runq_ns),
        ("ttft_trace.evidence.runq_max_ns", e.runq_max_ns),
        (
            "ttft_trace.evidence.cpu_stage_oncpu_ns",
            e.cpu_stage_oncpu_ns,
        ),
        (
            "ttft_trace.evidence.cpu_stage_blocked_ns",
            e.cpu_stage_blocked_ns,
        ),
        (
            "ttft_trace.evidence.cpu_stage_thread_max_ns",
            e.cpu_stage_thread_max_ns,
        ),
        (
            "ttft_trace.evidence.gpu_thread_blocked_ns",
            e.gpu_thread_blocked_ns,
        ),
        ("ttft_trace.evidence.retransmits", u64::from(e.retransmits)),
        ("ttft_trace.evidence.resets", u64::from(e.resets)),
        (
            "ttft_trace.evidence.large_copies",
            u64::from(e.large_copies),
        ),
        ("ttft_trace.evidence.large_copy_bytes", e.large_copy_bytes),
        (
            "ttft_trace.evidence.large_copy_queue_span_ns",
            e.large_copy_queue_span_ns,
        ),
    ] {
        a.push(int(key, v));
    }
}

/// A JSON object's scalar fields as `prefix.field` attributes (the NVML
/// readings, whose fields change with the NVML module).
fn json_attributes(prefix: &str, v: &serde_json::Value, a: &mut Vec<KeyValue>) {
    let Some(map) = v.as_object() else { return };
    for (k, v) in map {
        let key = format!("{prefix}.{k}");
        let value = match v {
            serde_json::Value::Bool(b) => Value::Bool(*b),
            serde_json::Value::Number(n) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => Value::I64(i),
                (None, Some(f)) => Value::F64(f),
                _ => continue,
            },
            serde_json::Value::String(s) => Value::String(s.clone().into()),
            serde_json::Value::Array(xs) => Value::Array(Array::String(
                xs.iter()
                    .map(|x| {
                        StringValue::from(x.as_str().map_or_else(|| x.to_string(), str::to_owned))
                    })
                    .collect(),
            )),
            _ => continue,
        };
        a.push(KeyValue::new(key, value));
    }
}

#[cfg(test)]
mod tests;

/// The workload's container, pod and namespace, under the semantic
/// conventions' names, those it has (spans and GenAI metrics alike).
fn workload_place(labels: &WorkloadLabels) -> impl Iterator<Item = KeyValue> + '_ {
    [
        ("container.name", &labels.container),
        ("k8s.pod.name", &labels.pod),
        ("k8s.namespace.name", &labels.namespace),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(key, v)| KeyValue::new(key, v.clone()))
}
