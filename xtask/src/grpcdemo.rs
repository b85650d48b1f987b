//! `cargo xtask demo --grpc`: the demo over gRPC. A streaming service on
//! grpcio (C core; tests/stacks/grpc_stream.py, each message after a step
//! of the stub CUDA runtime) in a cgroup of its own, `ttft-trace attach` on
//! it, and a client making concurrent calls on one channel, server
//! streaming and bidirectional in turn, two of each six cancelled after
//! their first message. Shows the tracer's report, what /metrics served,
//! and a line per HTTP/2 stream beside what the client itself measured.
//! It needs the gRPC venv (set up on first use, from PyPI).

use std::{
    collections::HashMap, net::TcpListener, path::Path, process::Command, thread, time::Duration,
};

use anyhow::{Context as _, Result};
use serde_json::Value;

use crate::{
    cgroup2::BenchCgroup,
    demo::{build_all, free_addr, print_metrics, scrape, signal, wait_listening},
    process::{cmd, repo_root},
    scale::{Killed, attach_serving},
    setup::cache,
};

/// Rounds of the client's six calls.
const ROUNDS: usize = 3;

pub fn demo_grpc() -> Result<()> {
    let root = repo_root()?;
    build_all(&root)?;
    let out = root.join("target/demo");
    std::fs::create_dir_all(&out)?;
    let jsonl = out.join("trace-grpc.jsonl");
    // The tracer appends: each demo starts a new file.
    let _ = std::fs::remove_file(&jsonl);
    let python = cache().join("grpc-venv/bin/python");
    let script = root.join("tests/stacks/grpc_stream.py");
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    // A cgroup of its own before it listens, as under a container runtime:
    // the tracer reads the client's frames at its ingress.
    let cgroup = BenchCgroup::new("ttft-trace-grpc-demo")?;
    let server = Killed(
        cgroup
            .command(&python)
            .arg(&script)
            .args(["serve", &port.to_string()])
            .env("STACK_CUDART", root.join("target/fixtures/libcudart.so.12"))
            .spawn()
            .context("starting tests/stacks/grpc_stream.py serve")?,
    );
    wait_listening(port)?;
    let pid = server.0.id();
    let metrics = free_addr()?;
    println!(
        "== ttft-trace attach --pid {pid}: a gRPC streaming service (grpcio) on port {port} =="
    );
    let mut tracer = attach_serving(
        &root,
        pid,
        metrics,
        &["--jsonl".into(), jsonl.display().to_string()],
        "following requests on port",
    )?;
    println!(
        "== load: {ROUNDS} x 6 concurrent calls on one channel (tests/stacks/grpc_stream.py \
         client): server streaming and bidirectional in turn, two of each six cancelled after \
         their first message =="
    );
    let mut calls = Vec::new();
    for round in 0..ROUNDS {
        let file = out.join(format!("grpc-client-{round}.jsonl"));
        cmd(Command::new(&python)
            .arg(&script)
            .args(["client", &port.to_string()])
            .arg(&file))?;
        calls.extend(read_lines(&file)?);
    }
    thread::sleep(Duration::from_millis(500));
    let body = scrape(metrics);
    signal(tracer.0.id(), "INT")?;
    tracer.0.wait()?;
    drop(server);
    print_metrics(metrics, &body.context("scraping /metrics")?);
    let records: Vec<Value> = read_lines(&jsonl)?
        .into_iter()
        .filter(|r| r["type"] == "request" && r["server_port"] == port)
        .collect();
    print_streams(&records, &calls);
    println!(
        "\nPer-stream JSON lines: {}\nThe client's own measurements: {}/grpc-client-*.jsonl",
        jsonl.display(),
        out.display()
    );
    Ok(())
}

fn read_lines(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).context("a JSON line"))
        .collect()
}

/// A line per stream, in the order they arrived, beside the client's own
/// TTFT (its first message read, less its call's start) where the call
/// is matched by its connection's turn and its stream id.
fn print_streams(records: &[Value], calls: &[Value]) {
    println!(
        "\n== HTTP/2 streams the tracer recorded ({} for {} calls) ==",
        records.len(),
        calls.len()
    );
    println!(
        "{:>6} {:>6} {:>7} {:>10} {:>10} {:>11} {:>6}  outcome",
        "conn", "stream", "status", "TTFT ms", "client ms", "estimate ms", "chunks"
    );
    let ms = |v: &Value| {
        v.as_f64()
            .map_or("-".to_string(), |ns| format!("{:.2}", ns / 1e6))
    };
    let mut sorted: Vec<&Value> = records.iter().collect();
    sorted.sort_by_key(|r| r["t_request_segment_ns"].as_u64());
    // Each round is one channel (one connection: a client port of its
    // own; the kernel may reuse a socket's address), its calls streams
    // 1, 3 …
    let mut conns: HashMap<String, usize> = HashMap::new();
    for r in sorted {
        let next = conns.len();
        let conn = *conns.entry(r["client_port"].to_string()).or_insert(next);
        let stream = r["http2_stream_id"].as_u64().unwrap_or(0);
        let client = calls
            .iter()
            .filter(|c| c["stream"] == stream)
            .nth(conn)
            .and_then(|c| Some(c["t_first"].as_u64()? - c["t_start"].as_u64()?))
            .map_or("-".to_string(), |ns| format!("{:.2}", ns as f64 / 1e6));
        let ended = match (&r["http2_ended_by"], &r["http2_error_code"]) {
            (Value::String(by), Value::Number(code)) => format!(" (by the {by}, code {code})"),
            _ => String::new(),
        };
        println!(
            "{conn:>6} {stream:>6} {:>7} {:>10} {client:>10} {:>11} {:>6}  {}{ended}",
            r["http_status"].to_string(),
            ms(&r["ttft_ns"]),
            ms(&r["client_ttft_estimate_ns"]),
            r["chunks"].to_string(),
            r["outcome"].as_str().unwrap_or("-"),
        );
    }
}
