//! The HTTP/2 bench (`cargo xtask bench --only h2`, and part of the full
//! `cargo xtask bench`): `ttft-trace attach` on a gRPC server (tonic,
//! tests/stacks/tonic.rs with a pace: each call streams its messages one
//! every `pace_ms`, from a task of its own) in a cgroup of its own (the
//! client's frames are read at its ingress), and `loadgen grpc` holding
//! `connections` HTTP/2 connections with `streams` calls in flight on each,
//! every call issued again once the one before ended (see [`FULL`]).
//!
//! Reported: the messages the client received a second; the calls it
//! completed against the streams the tracer reports `ok` with a first token;
//! the tracer's peak RSS (`VmHWM`) and CPU share; events lost in the kernel,
//! HTTP/2 frames not reported (past a call's 16 summaries) and walks that
//! lost their place. Judged: the peak RSS against the scale bench's bound,
//! no event lost, every completed call traced.

use std::{
    net::TcpListener,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use crate::{
    bounds::{self, Verdicts},
    cgroup2::BenchCgroup,
    demo::{free_addr, signal, wait_listening},
    process::output,
    scale::{Killed, attach_serving, counters, cpu_ticks, release_bins, status_kib},
};

/// One load.
pub struct Plan {
    pub connections: usize,
    pub streams: usize,
    pub pace_ms: u64,
    /// Messages per call.
    pub msgs: u32,
    pub seconds: f64,
}

/// 1 000 concurrent calls over 10 connections, a message every 40 ms each
/// (25 000 messages a second offered), calls of 25 messages (one second),
/// for 20 s.
pub const FULL: Plan = Plan {
    connections: 10,
    streams: 100,
    pace_ms: 40,
    msgs: 25,
    seconds: 20.0,
};

/// Runs the plan; returns the figures and their verdicts.
pub fn run(root: &Path, plan: &Plan) -> Result<(Value, Verdicts)> {
    let hz = release_bins(root, &["loadgen", "stack-tonic"])?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let cgroup = BenchCgroup::new("ttft-trace-h2-bench")?;
    // In the cgroup before it listens: its listening socket, and so its
    // connections, are the cgroup's (made outside it, they would send the
    // tracer's segments host-wide, with no payload to walk).
    let server = Killed(
        cgroup
            .command(root.join("target/release/stack-tonic"))
            .arg(port.to_string())
            .arg(root.join("target/fixtures/libcudart.so.12"))
            .arg(plan.pace_ms.to_string())
            .arg(plan.msgs.to_string())
            .stdout(Stdio::null())
            .spawn()
            .context("starting stack-tonic")?,
    );
    wait_listening(port)?;
    let metrics = free_addr()?;
    let tracer = attach_serving(
        root,
        server.0.id(),
        metrics,
        &[],
        "following requests on port",
    )?;
    let tracer_pid = tracer.0.id();
    thread::sleep(Duration::from_secs(1));
    let idle_kib = status_kib(tracer_pid, "VmRSS:")?;
    let before = counters(metrics)?;
    let cpu_before = cpu_ticks(tracer_pid)?;
    let started = Instant::now();
    let client = output(
        Command::new(root.join("target/release/loadgen"))
            .args(["grpc", "--addr", &format!("127.0.0.1:{port}")])
            .args(["--connections", &plan.connections.to_string()])
            .args(["--streams", &plan.streams.to_string()])
            .args(["--seconds", &plan.seconds.to_string()]),
    )?;
    let secs = started.elapsed().as_secs_f64();
    let cpu = (cpu_ticks(tracer_pid)? - cpu_before) as f64 / hz / secs * 100.0;
    let done: Value = serde_json::from_str(client.lines().last().unwrap_or(""))
        .with_context(|| format!("loadgen grpc's summary: {client:?}"))?;
    let calls = done["calls"].as_u64().context("loadgen: calls")?;
    // A stream's record waits for the ACK of its first token: poll until
    // the tracer has them all, or stops counting.
    let mut after = counters(metrics)?;
    let settle = Instant::now() + Duration::from_secs(15);
    while after.requests_all - before.requests_all < calls && Instant::now() < settle {
        thread::sleep(Duration::from_millis(500));
        after = counters(metrics)?;
    }
    let hwm_kib = status_kib(tracer_pid, "VmHWM:")?;
    signal(server.0.id(), "TERM")?;
    drop(server);
    drop(tracer);
    let traced_ok = after.requests_ok - before.requests_ok;
    let traced = after.requests_all - before.requests_all;
    let first_tokens = after.first_tokens - before.first_tokens;
    let lost = after.events_lost - before.events_lost;
    let frames_dropped = after.h2_frames_dropped - before.h2_frames_dropped;
    let walks_lost = after.h2_walks_lost - before.h2_walks_lost;
    let evicted = after.evictions - before.evictions;
    let rate = done["messages_per_s"].as_f64().unwrap_or(0.0);
    println!(
        "h2: {} connections x {} calls in flight, {rate:.0} messages/s received \
         ({:.0} offered); {calls} calls completed, the tracer reports {traced} streams \
         ({traced_ok} ok, {first_tokens} with a first token); tracer RSS {idle_kib} KiB \
         attached, peak {hwm_kib} KiB, CPU {cpu:.1} % of a core; {lost} events lost, \
         {frames_dropped} frames not reported, {walks_lost} walks lost, {evicted} evictions",
        plan.connections,
        plan.streams,
        (plan.connections * plan.streams) as f64 * 1000.0 / plan.pace_ms as f64,
    );
    let mut verdicts = Verdicts::default();
    verdicts.judge(hwm_kib as f64, bounds::SCALE_RSS_KIB, |limit| {
        format!("h2: the tracer's peak RSS is {hwm_kib} KiB (limit {limit:.0} KiB)")
    });
    verdicts.require(lost == 0, || format!("h2: {lost} events lost"));
    verdicts.require(
        traced_ok == calls && first_tokens >= calls && done["errors"] == 0,
        || {
            format!(
                "h2: {calls} calls completed ({} errors), the tracer reports {traced_ok} ok, \
                 {first_tokens} with a first token",
                done["errors"]
            )
        },
    );
    let result = json!({
        "plan": {"connections": plan.connections, "streams_per_connection": plan.streams,
                 "pace_ms": plan.pace_ms, "messages_per_call": plan.msgs,
                 "seconds": plan.seconds},
        "messages_per_s": rate, "calls_completed": calls,
        "streams_traced": traced, "streams_traced_ok": traced_ok,
        "streams_with_first_token": first_tokens,
        "tracer_rss_kib_attached": idle_kib, "tracer_rss_kib_peak": hwm_kib,
        "tracer_cpu_percent_of_core": cpu, "events_lost": lost,
        "http2_frames_dropped": frames_dropped, "http2_walks_lost": walks_lost,
        "table_evictions": evicted, "loadgen": done,
    });
    Ok((result, verdicts))
}
