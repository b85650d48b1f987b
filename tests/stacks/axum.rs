//! The axum (hyper) stack of tests/tests/stacks.rs: the same streamed
//! completions as tests/stacks/apps.py, with hyper doing all of the HTTP.
//! The GPU steps call the stub CUDA runtime of tests/fixtures (dlopen).
//!
//!   stack-axum PORT CUDART WRITES_LOG
//!
//! hyper writes the body pieces queued when its connection task runs in one
//! send, so how many sends carry a response's body depends on the machine's
//! timing: the server counts its own (`writes`) as the ground truth of the
//! tracer's `chunks`, in WRITES_LOG.

mod axum_writes;

use std::{
    convert::Infallible,
    path::Path,
    sync::{Arc, Mutex},
};

use anyhow::{Result, bail};
use axum::{
    Router,
    body::{Body, Bytes},
    http::{Uri, header},
    response::Response,
    routing::post,
};
use tokio_stream::wrappers::ReceiverStream;
use ttft_trace_tests::stub_gpu::StubGpu;

const PREFILL_NS: u64 = 20_000_000;
const DECODE_NS: u64 = 5_000_000;

/// Token `i` of `n` (the last gives its finish reason, as OpenAI's API does).
/// The fields in the order OpenAI's API, vLLM and TGI's router write them,
/// `choices` last (serde_json's map would sort them, its finish reason then
/// ~80 bytes before the event's end).
fn chunk(path: &str, i: u64, n: u64) -> Bytes {
    let word = serde_json::json!(format!(" tok{i}"));
    let finish = serde_json::json!((i + 1 == n).then_some("length"));
    let body = match path {
        "/v1/chat/completions" => format!(
            r#"{{"id":"chatcmpl-stack","object":"chat.completion.chunk","created":0,"model":"stack","choices":[{{"index":0,"delta":{{"content":{word}}},"finish_reason":{finish}}}]}}"#
        ),
        "/v1/completions" => format!(
            r#"{{"id":"cmpl-stack","object":"text_completion","created":0,"model":"stack","choices":[{{"index":0,"text":{word},"finish_reason":{finish}}}]}}"#
        ),
        _ => {
            return Bytes::from(format!(
                "{}\n",
                serde_json::json!({"model": "stack", "response": word, "done": false})
            ));
        }
    };
    Bytes::from(format!("data: {body}\n\n"))
}

fn last(path: &str) -> Bytes {
    if path == "/api/generate" {
        Bytes::from(format!(
            "{}\n",
            serde_json::json!({"model": "stack", "response": "", "done": true})
        ))
    } else {
        Bytes::from_static(b"data: [DONE]\n\n")
    }
}

async fn complete(gpu: Arc<Mutex<StubGpu>>, uri: Uri, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let n = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["max_tokens"].as_u64())
        .unwrap_or(8)
        .max(1);
    let content_type = if path == "/api/generate" {
        "application/x-ndjson"
    } else {
        "text/event-stream"
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(4);
    tokio::task::spawn_blocking(move || {
        for i in 0..n {
            let step = gpu
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .step(if i == 0 { PREFILL_NS } else { DECODE_NS });
            if let Err(e) = step {
                eprintln!("stack-axum: {e}");
                return;
            }
            if tx.blocking_send(Ok(chunk(&path, i, n))).is_err() {
                return;
            }
        }
        let _ = tx.blocking_send(Ok(last(&path)));
    });
    let mut resp = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    resp
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(port), Some(cudart), Some(log)) = (args.next(), args.next(), args.next()) else {
        bail!("usage: stack-axum PORT CUDART WRITES_LOG");
    };
    let gpu = Arc::new(Mutex::new(StubGpu::load(Path::new(&cudart))?));
    let log = axum_writes::Log::create(Path::new(&log))?;
    let route =
        |gpu: Arc<Mutex<StubGpu>>| post(move |uri: Uri, body: Bytes| complete(gpu, uri, body));
    let app = Router::new()
        .route("/v1/chat/completions", route(gpu.clone()))
        .route("/v1/completions", route(gpu.clone()))
        .route("/api/generate", route(gpu));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async move {
            let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
            axum::serve(axum_writes::CountingListener::new(listener, log), app).await?;
            Ok(())
        })
}
