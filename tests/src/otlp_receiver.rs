//! The OTLP receiver of every test that exports to one: the collector's
//! trace and metrics services generated from the OpenTelemetry protocol
//! definitions (`opentelemetry-proto`), served over gRPC by tonic or over
//! HTTP (binary protobuf) by axum on loopback, each on a runtime of its
//! own.
//!
//! `ttft-trace`'s own unit tests include this file by path (they cannot
//! depend on this crate, which depends on theirs), so it names nothing of
//! either crate: only the protocol, tonic, axum, prost and tokio.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use opentelemetry_proto::tonic::{
    collector::{
        metrics::v1::{
            ExportMetricsServiceRequest, ExportMetricsServiceResponse,
            metrics_service_server::{MetricsService, MetricsServiceServer},
        },
        trace::v1::{
            ExportTraceServiceRequest, ExportTraceServiceResponse,
            trace_service_server::{TraceService, TraceServiceServer},
        },
    },
    metrics::v1::{HistogramDataPoint, Metric, metric::Data},
};

/// What the receiver's trace and metrics services received.
#[derive(Clone, Default)]
pub struct Collector {
    pub got: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
    pub metrics: Arc<Mutex<Vec<ExportMetricsServiceRequest>>>,
    /// While set, trace exports are accepted but not answered (a collector
    /// that hangs); once cleared, those held are refused (`internal`, which
    /// the exporter does not retry).
    hold: Arc<AtomicBool>,
    /// Spans of the trace exports held (and then refused) so far.
    held: Arc<AtomicUsize>,
}

/// The list behind `m`, even if a test thread panicked holding it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        if self.hold.load(Ordering::SeqCst) {
            self.held
                .fetch_add(span_count(req.get_ref()), Ordering::SeqCst);
            while self.hold.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            return Err(tonic::Status::internal("held, then refused"));
        }
        lock(&self.got).push(req.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[tonic::async_trait]
impl MetricsService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        lock(&self.metrics).push(req.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

impl Collector {
    /// The trace export requests received so far.
    pub fn traces(&self) -> MutexGuard<'_, Vec<ExportTraceServiceRequest>> {
        lock(&self.got)
    }

    /// The metrics export requests received so far.
    pub fn metric_exports(&self) -> MutexGuard<'_, Vec<ExportMetricsServiceRequest>> {
        lock(&self.metrics)
    }

    /// Spans received so far.
    pub fn spans(&self) -> usize {
        self.traces().iter().map(span_count).sum()
    }

    /// From now on, trace exports are held unanswered (`true`), or those
    /// held are refused and later ones accepted again (`false`).
    pub fn hold_traces(&self, hold: bool) {
        self.hold.store(hold, Ordering::SeqCst);
    }

    /// Spans of the trace exports held so far.
    pub fn held_spans(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Every export of the metric `name` received so far, oldest first.
    pub fn metrics_named(&self, name: &str) -> Vec<Metric> {
        self.metric_exports()
            .iter()
            .flat_map(|r| &r.resource_metrics)
            .flat_map(|rm| &rm.scope_metrics)
            .flat_map(|sm| &sm.metrics)
            .filter(|m| m.name == name)
            .cloned()
            .collect()
    }

    /// The histogram `name` as the last export carried it: its bucket
    /// bounds and, per attribute set, the last (cumulative) data point.
    pub fn histogram(&self, name: &str) -> Option<(Vec<f64>, Vec<HistogramDataPoint>)> {
        let mut bounds = None;
        let mut points = BTreeMap::new();
        for m in &self.metrics_named(name) {
            let Some(Data::Histogram(h)) = &m.data else {
                continue;
            };
            for p in &h.data_points {
                bounds = Some(p.explicit_bounds.clone());
                points.insert(format!("{:?}", p.attributes), p.clone());
            }
        }
        Some((bounds?, points.into_values().collect()))
    }
}

/// The spans of one trace export request.
fn span_count(r: &ExportTraceServiceRequest) -> usize {
    r.resource_spans
        .iter()
        .flat_map(|rs| &rs.scope_spans)
        .map(|ss| ss.spans.len())
        .sum()
}

/// An OTLP/gRPC receiver on `addr`, on a runtime of its own: dropping the
/// runtime stops it hard, its connections closed (as a collector that
/// dies).
pub fn serve(addr: SocketAddr, collector: &Collector) -> std::io::Result<tokio::runtime::Runtime> {
    let rt = runtime()?;
    let listener = bound(addr)?;
    let c = collector.clone();
    rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(c.clone()))
            .add_service(MetricsServiceServer::new(c))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .expect("receiver runs");
    });
    Ok(rt)
}

/// An OTLP/HTTP receiver on `addr` (binary protobuf on `/v1/traces` and
/// `/v1/metrics`), on a runtime of its own.
pub fn serve_http(
    addr: SocketAddr,
    collector: &Collector,
) -> std::io::Result<tokio::runtime::Runtime> {
    use prost::Message as _;
    let rt = runtime()?;
    let listener = bound(addr)?;
    let protobuf = |body: Vec<u8>| {
        (
            [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")],
            body,
        )
    };
    let traces = collector.clone();
    let export = move |body: axum::body::Bytes| async move {
        let req = ExportTraceServiceRequest::decode(body).expect("an OTLP request");
        traces.traces().push(req);
        let resp = ExportTraceServiceResponse {
            partial_success: None,
        };
        protobuf(resp.encode_to_vec())
    };
    let metrics = collector.clone();
    let export_metrics = move |body: axum::body::Bytes| async move {
        let req = ExportMetricsServiceRequest::decode(body).expect("an OTLP metrics request");
        metrics.metric_exports().push(req);
        let resp = ExportMetricsServiceResponse {
            partial_success: None,
        };
        protobuf(resp.encode_to_vec())
    };
    rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(export))
            .route("/v1/metrics", axum::routing::post(export_metrics));
        axum::serve(listener, app).await.expect("receiver runs");
    });
    Ok(rt)
}

/// A loopback port free now, for a receiver.
pub fn free_addr() -> std::io::Result<SocketAddr> {
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// A listener on `addr`, ready for tokio.
fn bound(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}
