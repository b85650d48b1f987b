//! Root-only: the daemon exports every request it traces as a trace over
//! OTLP/gRPC to a real receiver (the collector service generated from the
//! OpenTelemetry protocol definitions, `opentelemetry-proto`, served by
//! tonic here), and the spans agree with the JSONL to the nanosecond.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{KeyValue, any_value},
    trace::v1::Span,
};
use serde_json::Value;
use ttft_trace_tests::{
    demo::{DemoServer, loadgen},
    tracer::{Tracer, root_test},
};

#[derive(Clone, Default)]
struct Collector {
    got: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.got
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(req.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn free_addr() -> Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn int(attrs: &[KeyValue], key: &str) -> Option<i64> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .and_then(|v| match v {
            any_value::Value::IntValue(i) => Some(*i),
            _ => None,
        })
}

fn has(attrs: &[KeyValue], key: &str) -> bool {
    attrs.iter().any(|kv| kv.key == key)
}

#[test]
fn daemon_exports_each_request_as_a_trace_matching_the_jsonl() -> Result<()> {
    let Some(_g) = root_test("daemon_exports_each_request_as_a_trace_matching_the_jsonl") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let collector = Collector::default();
    let receiver = std::net::TcpListener::bind("127.0.0.1:0")?;
    receiver.set_nonblocking(true)?;
    let endpoint = format!("http://{}", receiver.local_addr()?);
    let c = collector.clone();
    rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(receiver).expect("listener");
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(c))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .expect("receiver runs");
    });

    let port = free_addr()?.port().to_string();
    let mut tracer = Tracer::start_daemon(
        &[
            "--no-nvml",
            "--rescan-ms",
            "200",
            "--only-port",
            &port,
            "--otlp-endpoint",
            &endpoint,
        ]
        .map(String::from),
    )?;
    let server = DemoServer::start(&["--output-tokens", "16", "--port", &port])?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    let clients = loadgen(
        server.port,
        &[
            "--concurrency",
            "2",
            "--requests",
            "12",
            "--output-tokens",
            "16",
            "--fault",
            "tokenizer_stall",
            "--fault-share",
            "0.25",
        ],
    )?;
    std::thread::sleep(Duration::from_millis(300));
    server.stop()?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    ensure!(out.success, "{}", out.stderr);
    let requests: Vec<&Value> = out
        .lines
        .iter()
        .filter(|l| l["type"] == "request")
        .collect();
    ensure!(requests.len() == clients.len(), "every request traced");

    let got = collector.got.lock().unwrap_or_else(|e| e.into_inner());
    let mut offset = None;
    let mut spans: Vec<&Span> = Vec::new();
    for rs in got.iter().flat_map(|r| &r.resource_spans) {
        let resource = rs.resource.as_ref().context("resource")?;
        offset = int(
            &resource.attributes,
            "ttft_trace.clock.monotonic_to_unix_offset_ns",
        )
        .or(offset);
        spans.extend(rs.scope_spans.iter().flat_map(|s| &s.spans));
    }
    let offset = i128::from(offset.context("the clock offset on the resource")?);
    let unix = |v: &Value| -> Option<u64> { u64::try_from(i128::from(v.as_u64()?) + offset).ok() };
    let roots: HashMap<(i64, i64), &Span> = spans
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .filter_map(|s| {
            Some((
                (
                    int(&s.attributes, "client.port")?,
                    int(&s.attributes, "ttft_trace.request_index")?,
                ),
                *s,
            ))
        })
        .collect();
    eprintln!(
        "requests traced {}, slow {}, spans received {}, server spans {}",
        requests.len(),
        requests.iter().filter(|r| r["slow"] == true).count(),
        spans.len(),
        roots.len()
    );
    ensure!(roots.len() == requests.len(), "one server span per request");
    let mut children_seen = 0;
    for r in &requests {
        let key = (
            r["client_port"].as_i64().context("port")?,
            r["request_index"].as_i64().context("index")?,
        );
        let root = roots
            .get(&key)
            .with_context(|| format!("no span for {r}"))?;
        ensure!(root.kind == 2, "server kind");
        ensure!(
            Some(root.start_time_unix_nano) == unix(&r["t_arrive_ns"]),
            "start {r}"
        );
        ensure!(
            Some(root.end_time_unix_nano) == unix(&r["t_done_ns"]),
            "end {r}"
        );
        let first_token = root.events.iter().find(|e| e.name == "first_token");
        ensure!(
            first_token.map(|e| e.time_unix_nano) == unix(&r["t_first_token_ns"]),
            "first token event {r}"
        );
        ensure!(int(&root.attributes, "ttft_trace.ttft_ns") == r["ttft_ns"].as_i64());
        ensure!(int(&root.attributes, "http.response.status_code") == r["http_status"].as_i64());
        ensure!(
            has(&root.attributes, "ttft_trace.causes") == (r["slow"] == true),
            "{r}"
        );
        let children: HashMap<&str, &Span> = spans
            .iter()
            .filter(|s| s.parent_span_id == root.span_id)
            .map(|s| (s.name.as_str(), *s))
            .collect();
        if let (Some(q), Some(g)) = (r["queue_ns"].as_u64(), r["gpu_ns"].as_u64()) {
            let t0 = r["t_arrive_ns"].as_u64().context("arrival")?;
            let gpu = children.get("gpu_episode").context("gpu_episode span")?;
            ensure!(gpu.trace_id == root.trace_id);
            ensure!(
                Some(gpu.start_time_unix_nano) == unix(&Value::from(t0 + q))
                    && Some(gpu.end_time_unix_nano) == unix(&Value::from(t0 + q + g)),
                "the GPU episode's times {r}"
            );
            ensure!(children.contains_key("queue") && children.contains_key("egress"));
            children_seen += 1;
        }
    }
    ensure!(
        children_seen > 0,
        "requests joined to their GPU work have children"
    );
    ensure!(
        spans.len() == requests.len() + 3 * children_seen,
        "no stray spans"
    );
    drop(got);
    rt.shutdown_background();
    Ok(())
}
