//! Root-only: per-request TTFT traced from the demo server's own sockets and
//! CUDA calls, compared with what a real client measured for the same
//! requests (joined by client port and request index on the connection).

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};

use anyhow::{Context as _, Result};
use serde_json::Value;
use ttft_trace_tests::{
    container::PodCgroup,
    demo::{ClientRequest, DemoServer, loadgen, server_stamps},
    faults::{self, PacketLoss},
    server_clock::{Deviations, Stamps, Tolerance, request_key},
    tracer::{TraceOutput, Tracer, root_test},
};

/// How the tracer sees TCP segments in a run: where the server runs, the
/// tracer's environment, and the log line that names the hook.
#[derive(Clone, Copy)]
struct Hook {
    name: &'static str,
    server: Placement,
    env: &'static [(&'static str, &'static str)],
    log: &'static str,
}

/// Where the demo server runs.
#[derive(Clone, Copy, PartialEq)]
enum Placement {
    /// In the test's cgroup.
    Here,
    /// In a cgroup of its own from its start (as under a container runtime
    /// or a systemd unit).
    OwnCgroup,
    /// Started in a cgroup of its own, moved into another once it listens:
    /// its listening socket stays the first one's, as systemd socket
    /// activation hands a server a socket of the socket unit's cgroup.
    ListenerElsewhere,
    /// Started in the root cgroup, moved into a cgroup of its own once it
    /// listens: its listening socket is the root cgroup's.
    ListenerInRoot,
}

/// The default where the server has a cgroup of its own: the segment
/// program on that cgroup's ingress.
const CGROUP: Hook = Hook {
    name: "cgroup ingress",
    server: Placement::OwnCgroup,
    env: &[],
    log: "segments: seen at the ingress of cgroup",
};
/// Host-wide on the raw `tcp_probe` (the default for a server in the root
/// cgroup, and the fallback).
const RAW: Hook = Hook {
    name: "raw tracepoint",
    server: Placement::Here,
    env: &[("TTFT_TRACE_SEGMENT_HOOK", "tcp_probe")],
    log: "segments: raw tracepoint tcp:tcp_probe",
};
/// The classic tracepoint (kernels without BTF).
const CLASSIC: Hook = Hook {
    name: "classic tracepoint",
    server: Placement::Here,
    env: &[("TTFT_TRACE_EVENT_HOOK", "tracepoints")],
    log: "segments: classic tracepoint tcp:tcp_probe",
};
const SEGMENT_HOOKS: [Hook; 3] = [CGROUP, RAW, CLASSIC];
/// The server's listening socket in another cgroup than the server: the
/// program on both.
const LISTENER_ELSEWHERE: Hook = Hook {
    name: "cgroup ingress, the listener's cgroup too",
    server: Placement::ListenerElsewhere,
    env: &[],
    log: "segments: seen at the ingress of cgroup",
};
/// The server's listening socket in the root cgroup: host-wide, from the
/// start.
const LISTENER_IN_ROOT: Hook = Hook {
    name: "raw tracepoint for a listener in the root cgroup",
    server: Placement::ListenerInRoot,
    env: &[],
    log: "host-wide (the listening socket of port",
};

impl Hook {
    /// Starts the demo server as this hook wants it.
    fn server(&self, args: &[&str]) -> Result<DemoServer> {
        match self.server {
            Placement::Here => DemoServer::start(args),
            Placement::OwnCgroup => DemoServer::start_in(args, Some(PodCgroup::new()?)),
            Placement::ListenerElsewhere | Placement::ListenerInRoot => {
                let mut server = if self.server == Placement::ListenerInRoot {
                    DemoServer::start_in_root(args)?
                } else {
                    DemoServer::start_in(args, Some(PodCgroup::new()?))?
                };
                let cgroup = PodCgroup::new()?;
                cgroup.adopt(server.pid)?;
                server.cgroups.push(cgroup);
                Ok(server)
            }
        }
    }

    /// Asserts the tracer saw segments with this hook.
    fn assert_used(&self, out: &TraceOutput) {
        assert!(
            out.stderr.contains(self.log),
            "segments not seen by the {}:\n{}",
            self.name,
            out.stderr
        );
    }
}

/// Packets dropped while the load generator runs.
#[derive(Clone, Copy)]
enum Fault {
    /// This percentage of the server's packets.
    ServerLoss(u32),
    /// Every client's ACK that would complete its handshake.
    HandshakeAcks,
}

/// Traces the demo server started with `server_args` while the load
/// generator runs with `load_args`.
fn run(
    server_args: &[&str],
    load_args: &[&str],
    wait: bool,
) -> Result<(TraceOutput, Vec<ClientRequest>)> {
    run_with_env(server_args, load_args, wait, None, CGROUP).map(|(out, clients, _)| (out, clients))
}

/// As [`run`], with `fault` while the load runs and segments seen by
/// `hook`, and the server's own stamps of each request.
fn run_with_env(
    server_args: &[&str],
    load_args: &[&str],
    wait: bool,
    fault: Option<Fault>,
    hook: Hook,
) -> Result<(TraceOutput, Vec<ClientRequest>, Vec<Stamps>)> {
    let server = hook.server(server_args)?;
    let mut args = vec![
        "--pid".to_string(),
        server.pid.to_string(),
        "--interval".into(),
        "60".into(),
    ];
    if wait {
        args.push("--wait".into());
    }
    let mut tracer = Tracer::start_with_env(&args, 0, hook.env)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    let guard = fault
        .map(|f| match f {
            Fault::ServerLoss(pct) => {
                PacketLoss::start_with(server.port, pct, faults::Direction::FromServer)
            }
            Fault::HandshakeAcks => PacketLoss::handshake_acks(server.port),
        })
        .transpose()?;
    let clients = loadgen(server.port, load_args)?;
    drop(guard);
    // Let the last responses' grace period pass, then stop tracing.
    std::thread::sleep(Duration::from_millis(300));
    let out = tracer.interrupt(Duration::from_secs(30))?;
    let truth = server.stop()?;
    let stamps = server_stamps(&truth)?;
    let _ = std::fs::remove_file(&truth);
    assert!(out.success, "{}", out.stderr);
    hook.assert_used(&out);
    Ok((out, clients, stamps))
}

fn requests(out: &TraceOutput) -> Vec<&Value> {
    out.lines
        .iter()
        .filter(|l| l["type"] == "request")
        .collect()
}

/// The traced requests by (client port, index from 1).
fn by_key<'a>(traced: &[&'a Value]) -> HashMap<(u64, u64), &'a Value> {
    traced.iter().map(|r| (request_key(r), *r)).collect()
}

/// Pairs each client request with the traced one (client port, index).
fn pair<'a>(
    traced: &[&'a Value],
    clients: &'a [ClientRequest],
) -> Vec<(&'a ClientRequest, &'a Value)> {
    let by_key = by_key(traced);
    clients
        .iter()
        .filter_map(|c| {
            by_key
                .get(&(u64::from(c.client_port), u64::from(c.req_on_conn)))
                .map(|t| (c, *t))
        })
        .collect()
}

fn p(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

/// How far the demo server's own stamps may be from the tracer's
/// (tests/demo/server.py, `--truth`): its stamp after the recv that returned
/// a request's first bytes is never before the traced arrival (dated inside
/// that recv) and at most `arrival_ms` after it; its stamp just before the
/// send of the first token is never after the traced first token (the
/// send's start in the kernel) and at most `first_token_ms` before it; the
/// median of each is at most `median_ms`. Between them lie only the thread's
/// way out of (into) the kernel and Python's, and its waits for a CPU and,
/// after the recv, for the GIL. One request at a time (concurrency 1) that
/// is microseconds: measured 08:40-08:50 UTC, 2026-12-05 (load average
/// 3.8-5.2 on 2 cores, two other builds beside), at most 0.014 ms.
const DEMO_CLOCK_ALONE: Tolerance = Tolerance {
    arrival_ms: 2.0,
    first_token_ms: 2.0,
    median_ms: 0.1,
};
/// Every request (concurrency 1, 4 and 16): a connection thread waits for
/// the GIL after its recv behind 15 others, tokenizers and the GPU worker,
/// beside the client, on 2 CPUs. Same runs: medians 0.004-0.005 ms
/// (arrival) and 0.006-0.013 ms (first token), P99 1.0-10.5 ms and
/// 0.09-0.56 ms, largest 46.2 ms and 12.5 ms (a thread preempted between
/// its stamp and its send). The medians catch a shift of every request.
const DEMO_CLOCK: Tolerance = Tolerance {
    arrival_ms: 100.0,
    first_token_ms: 100.0,
    median_ms: 0.5,
};

#[test]
fn traced_ttft_agrees_with_the_clients_own() -> Result<()> {
    let Some(_g) = root_test("traced_ttft_agrees_with_the_clients_own") else {
        return Ok(());
    };
    let (out, clients, stamps) = run_with_env(
        &["--output-tokens", "64"],
        &[
            "--concurrency",
            "1,4,16",
            "--requests",
            "32",
            "--output-tokens",
            "64",
        ],
        false,
        None,
        CGROUP,
    )?;
    let traced = requests(&out);
    assert_eq!(clients.len(), 96);
    // The server's own clock: its stamps after the read of each request's
    // first bytes and before the send of its first token; alone (one
    // request at a time), and all.
    assert_eq!(stamps.len(), clients.len(), "requests the server stamped");
    let alone: Vec<Stamps> = stamps
        .iter()
        .filter(|s| {
            clients.iter().any(|c| {
                c.concurrency == 1 && (u64::from(c.client_port), u64::from(c.req_on_conn)) == s.key
            })
        })
        .copied()
        .collect();
    let by_key = by_key(&traced);
    for (what, stamps, tol) in [
        ("one at a time", &alone, DEMO_CLOCK_ALONE),
        ("all", &stamps, DEMO_CLOCK),
    ] {
        let dev = Deviations::judge(stamps, &by_key, tol);
        eprintln!("the demo server's own clock, {what}: {}", dev.summary());
        assert!(dev.problems.is_empty(), "{}", dev.problems.join("\n"));
    }
    let pairs = pair(&traced, &clients);
    assert_eq!(
        pairs.len(),
        clients.len(),
        "every client request found in the trace"
    );
    eprintln!(
        "| concurrency | client TTFT P50 / P99 | traced TTFT P50 / P99 | max diff | P99 diff | max unread | client's max delay in reading | seen / sent |"
    );
    eprintln!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for c in [1u32, 4, 16] {
        let step: Vec<_> = pairs.iter().filter(|(cl, _)| cl.concurrency == c).collect();
        let mut client = Vec::new();
        let mut tracedv = Vec::new();
        let mut diff = Vec::new();
        let mut unread_max = 0.0f64;
        let mut late_max = 0.0f64;
        for (cl, tr) in &step {
            let ct = cl.ttft_s.context("client ttft")? * 1e3;
            let tt = tr["ttft_ns"].as_u64().context("traced ttft")? as f64 / 1e6;
            // The server's recv returns after the client's send began and its
            // send returns before the client reads: traced TTFT never exceeds
            // the client's (10 µs for the two clocks' reading order).
            assert!(tt <= ct + 0.010, "traced {tt} ms > client {ct} ms");
            assert!(cl.t_send.context("t_send")? <= tr["t_arrive_ns"].as_u64().context("arrive")?);
            assert_eq!(tr["outcome"], "ok");
            assert!(
                tr["queue_ns"].is_u64() && tr["gpu_ns"].is_u64() && tr["egress_ns"].is_u64(),
                "{tr}"
            );
            let sum = ["queue_ns", "gpu_ns", "egress_ns"]
                .iter()
                .map(|k| tr[k].as_u64().unwrap_or(0))
                .sum::<u64>();
            assert_eq!(
                sum,
                tr["ttft_ns"].as_u64().unwrap_or(0),
                "breakdown sums to TTFT: {tr}"
            );
            // Body sends: the tokens, plus the SSE terminator (`data: [DONE]`
            // and the last chunk) when it is a send of its own.
            // The request's wait in the server's socket before its first
            // read (from its first segment, `tcp_probe`): the client's TTFT
            // includes it, the server-side TTFT by definition does not. On a
            // new connection it is the server's accept and first read
            // (0.5-1.1 ms for the demo's asyncio loop here).
            let ta = tr["t_arrive_ns"].as_u64().context("arrive")?;
            let unread = match tr["t_request_segment_ns"].as_u64() {
                Some(seg) => {
                    assert!(seg <= ta, "segment after the read: {tr}");
                    (ta - seg) as f64 / 1e6
                }
                None if c == 1 => anyhow::bail!("no request segment at concurrency 1: {tr}"),
                None => 0.0,
            };
            let chunks = tr["chunks"].as_u64().unwrap_or(0);
            assert!(
                chunks == cl.chunks || chunks == cl.chunks + 1,
                "chunks {chunks} vs {}",
                cl.chunks
            );
            // On the client's own clock (CLOCK_MONOTONIC, the tracer's):
            // its start, from its send stamp to the request's segment, is
            // its own (the tracer measures it apart); and it cannot read
            // the first token before the server sent it.
            let start = client_start_ms(cl.t_send.context("t_send")?, tr);
            if let (Some(read), Some(ft)) = (cl.t_first_token, tr["t_first_token_ns"].as_u64()) {
                assert!(read >= ft, "first token read at {read}, sent at {ft}: {tr}");
            }
            // The client's own delay in reading its first token: from the
            // kernel's receive timestamp of that data in its socket to its
            // read (its threads share one GIL and two CPUs with the
            // server). The data cannot arrive before the server sent it
            // (50 µs for the realtime clock's conversion).
            let late = match (cl.t_first_token, cl.t_first_token_arrived) {
                (Some(read), Some(arrived)) => {
                    if let Some(ft) = tr["t_first_token_ns"].as_u64() {
                        assert!(
                            arrived + 50_000 >= ft,
                            "first token arrived at {arrived}, sent at {ft}: {tr}"
                        );
                    }
                    read.saturating_sub(arrived) as f64 / 1e6
                }
                _ => 0.0,
            };
            client.push(ct);
            tracedv.push(tt);
            diff.push(ct - tt - unread - start - late);
            unread_max = unread_max.max(unread);
            late_max = late_max.max(late);
        }
        let max = diff.iter().copied().fold(0.0, f64::max);
        let client_p99 = p(client.clone(), 0.99);
        let p99 = p(diff.clone(), 0.99);
        eprintln!(
            "| {c} | {:.2} / {:.2} ms | {:.2} / {:.2} ms | {:.3} ms | {:.3} ms | {:.3} ms | {late_max:.3} ms | {} / {} |",
            p(client.clone(), 0.5),
            client_p99,
            p(tracedv.clone(), 0.5),
            p(tracedv, 0.99),
            max,
            p99,
            unread_max,
            step.len(),
            step.len()
        );
        // On loopback the difference, less the request's unread wait, the
        // client's start and the client's own delay in reading (from its
        // socket's receive timestamp), is the token's way from the server's
        // send to the client's socket: near zero. Bounds: the P90 under 1 ms
        // at concurrency 1 and 2 ms at 4 and 16, the worst of 32 under 5 ms
        // (5 % of the client's P99 TTFT at 4 and 16, at least 5 ms). Before
        // the client's delay in reading was measured, it was the bulk of the
        // difference: 0.21-0.33 ms at 1 and 0.45-2.14 ms at 4 and 16 in 5
        // runs, and a CI run (2026-12-03) failed on a P90 of 7.8 ms at 16
        // (16 Python client threads, one GIL, beside the server on 2 cores).
        // (Before the unread wait was subtracted, the raw difference
        // reached 34 ms at 16: it was the server's, not the client's.)
        let p90 = p(diff.clone(), 0.9);
        let (bound, worst) = if c == 1 {
            (1.0, 5.0)
        } else {
            (2.0, (0.05 * client_p99).max(5.0))
        };
        assert!(
            p90 < bound,
            "concurrency {c}: P90 difference {p90} ms >= {bound} ms"
        );
        assert!(
            p99 < worst,
            "concurrency {c}: P99 difference {p99} ms >= {worst} ms"
        );
    }
    let keepalive = traced
        .iter()
        .filter(|r| r["request_index"].as_u64() >= Some(2))
        .count();
    assert!(keepalive > 0, "several requests per connection");
    Ok(())
}

#[test]
fn cut_streams_and_the_two_process_server() -> Result<()> {
    let Some(_g) = root_test("cut_streams_and_the_two_process_server") else {
        return Ok(());
    };
    // A client that closes mid-stream, on a server whose GPU worker is a
    // separate process (as vLLM's engine core).
    let (out, clients) = run(
        &["--gpu-worker-process", "--output-tokens", "64"],
        &[
            "--concurrency",
            "2",
            "--requests",
            "12",
            "--output-tokens",
            "64",
            "--cut-after-chunks",
            "5",
            "--cut-share",
            "0.5",
        ],
        false,
    )?;
    let traced = requests(&out);
    let cut = clients.iter().filter(|c| c.outcome == "cut").count();
    assert!(cut > 0, "some requests were cut");
    let pairs = pair(&traced, &clients);
    assert_eq!(pairs.len(), clients.len());
    for (c, t) in &pairs {
        let want = if c.outcome == "cut" {
            "closed_mid_response"
        } else {
            "ok"
        };
        assert_eq!(t["outcome"], want, "{t}");
        assert!(t["ttft_ns"].is_u64(), "TTFT even when cut later: {t}");
        // The GPU work is in the other process.
        assert_ne!(t["gpu_pid"], t["pid"], "{t}");
        assert!(t["gpu_ns"].is_u64(), "{t}");
    }
    Ok(())
}

#[test]
fn a_gpu_worker_started_after_attach_is_followed() -> Result<()> {
    let Some(_g) = root_test("a_gpu_worker_started_after_attach_is_followed") else {
        return Ok(());
    };
    // The engine process (and its CUDA library) appears with the first request.
    let (out, clients) = run(
        &[
            "--gpu-worker-process",
            "--lazy-load",
            "--load-gb",
            "1",
            "--output-tokens",
            "32",
        ],
        &[
            "--concurrency",
            "1",
            "--requests",
            "4",
            "--output-tokens",
            "32",
        ],
        true,
    )?;
    let traced = requests(&out);
    let pairs = pair(&traced, &clients);
    assert_eq!(pairs.len(), 4);
    assert!(out.stderr.contains("libcudart.so.12"), "{}", out.stderr);
    // The first request is what starts the engine: its GPU work races with
    // the probes being attached to the engine's new library (the 10 ms
    // --wait poll, then one uprobe pair per symbol), so only the requests
    // that arrived after the attach must be joined to the engine's work.
    let attached_ns = out
        .attach_lines()
        .iter()
        .map(|a| a.t_ns)
        .max()
        .context("attach time")?;
    let mut after_attach = 0;
    let episode_pids: Vec<u64> = out
        .lines
        .iter()
        .filter(|l| l["type"] == "episode")
        .filter_map(|l| l["pid"].as_u64())
        .collect();
    let context = format!(
        "episode pids {episode_pids:?}; totals {:?}; tracer stderr:\n{}",
        out.totals(),
        out.stderr
    );
    for (_, t) in pairs {
        assert_eq!(t["outcome"], "ok");
        let joined = t["gpu_pid"].is_u64() && t["gpu_pid"] != t["pid"];
        if t["t_arrive_ns"].as_u64().context("arrive")? > attached_ns {
            after_attach += 1;
            assert!(joined, "{t}\n{context}");
        } else {
            eprintln!("request arrived before the attach: joined to the engine: {joined}");
        }
    }
    assert!(
        after_attach >= 2,
        "{after_attach} requests after the attach"
    );
    Ok(())
}

/// The client's start, in ms: from its send stamp `sent` (CLOCK_MONOTONIC,
/// the tracer's clock) to the request's first segment at the server, which
/// cannot come before it; 0 without a segment.
fn client_start_ms(sent: u64, traced: &Value) -> f64 {
    match traced["t_request_segment_ns"].as_u64() {
        Some(seg) => {
            assert!(
                seg >= sent,
                "segment before the client's send {sent}: {traced}"
            );
            (seg - sent) as f64 / 1e6
        }
        None => 0.0,
    }
}

/// Accuracy of the client-TTFT estimate (first token acknowledged − request
/// segment arrived) against the client's own TTFT (less its start: its send
/// stamp to the request's segment), without and with 20 % of
/// the server's packets lost. The estimate stands for the client's two
/// one-way trips with the server's (request in, ACK out) and for the
/// client's read with its ACK: within 2 ms + 2 % of the client's TTFT per
/// request. A client that waited for a CPU after its kernel acknowledged
/// the token reads it later than any wire event shows: the client's own
/// run-queue delay across that read (its schedstat) is allowed on top, on
/// the client's side only, and at most 1 request in 12 may be later still
/// (within 20 ms): its threads also wait for each other's GIL, which no
/// counter shows (CI saw a client 5.5 ms behind its ACK once, on two busy
/// cores, its run-queue wait nil).
#[test]
fn client_ttft_estimate_agrees_with_the_clients_own() -> Result<()> {
    let Some(_g) = root_test("client_ttft_estimate_agrees_with_the_clients_own") else {
        return Ok(());
    };
    let load = [
        "--concurrency",
        "2",
        "--requests",
        "24",
        "--output-tokens",
        "32",
    ];
    eprintln!(
        "| segments | loss | requests with an estimate | client TTFT P50 / max | estimate − client median / max abs | server TTFT max | client run-queue max |"
    );
    eprintln!("| --- | --- | --- | --- | --- | --- | --- |");
    // The default segment program with and without loss; the host-wide
    // ones (the fallbacks) without: the loss run tests the retransmit
    // handling, which all share.
    for (hook, loss) in [
        (CGROUP, None),
        (CGROUP, Some(20)),
        (RAW, None),
        (CLASSIC, None),
    ] {
        let fault = loss.map(Fault::ServerLoss);
        let (out, clients, stamps) =
            run_with_env(&["--output-tokens", "32"], &load, false, fault, hook)?;
        // The server's own clock, on every hook.
        assert_eq!(stamps.len(), clients.len(), "requests the server stamped");
        let dev = Deviations::judge(&stamps, &by_key(&requests(&out)), DEMO_CLOCK);
        eprintln!(
            "{}, {}% loss, the demo server's own clock: {}",
            hook.name,
            loss.unwrap_or(0),
            dev.summary()
        );
        assert!(dev.problems.is_empty(), "{}", dev.problems.join("\n"));
        judge_estimates(
            &format!("{} | {}%", hook.name, loss.unwrap_or(0)),
            &out,
            &clients,
        )?;
    }
    Ok(())
}

/// Checks the client-TTFT estimates of one run against the clients' own
/// (see [`client_ttft_estimate_agrees_with_the_clients_own`]) and prints
/// its row, which begins with `label`.
fn judge_estimates(label: &str, out: &TraceOutput, clients: &[ClientRequest]) -> Result<()> {
    let traced = requests(out);
    let pairs = pair(&traced, clients);
    assert_eq!(pairs.len(), clients.len(), "every client request traced");
    let mut client = Vec::new();
    let mut err = Vec::new();
    let mut server = Vec::new();
    let mut runq_max: f64 = 0.0;
    let mut late = Vec::new();
    for (c, t) in &pairs {
        let ct = c.ttft_s.context("client ttft")? * 1e3;
        server.push(t["ttft_ns"].as_u64().context("ttft")? as f64 / 1e6);
        let Some(est) = t["client_ttft_estimate_ns"].as_u64() else {
            continue;
        };
        let est = est as f64 / 1e6;
        // The estimate begins at the request's segment; the client's
        // own start, from its send stamp (CLOCK_MONOTONIC, the tracer's
        // clock) to that segment, is taken out as in the other client
        // comparisons (CI saw 3.8 ms of it in one request).
        let start = client_start_ms(c.t_send.context("t_send")?, t);
        let ct = ct - start;
        let bound = 2.0 + 0.02 * ct;
        let runq = c.first_token_runq_ns.unwrap_or(0) as f64 / 1e6;
        let what = || {
            format!(
                "estimate {est:.3} ms vs client {ct:.3} ms less its start {start:.3} ms \
                 (bound {bound:.3}, the client's run-queue delay {runq:.3} ms): {t}"
            )
        };
        // The estimate never runs ahead of the client's read.
        assert!(est - ct <= bound, "{}", what());
        // The client may read late for reasons of its own beyond its
        // run-queue wait (its two threads share one GIL): counted
        // below, each within 20 ms.
        if ct - est > bound + runq {
            assert!(ct - est <= 20.0, "{}", what());
            eprintln!("client late: {}", what());
            late.push(ct - est);
        }
        client.push(ct);
        err.push(est - ct);
        runq_max = runq_max.max(runq);
    }
    // A late read of the client's own is rare: at most 1 in 12 (a CI
    // run saw one 5.5 ms late under loss, the client's run-queue wait
    // nil; 3.1 and 5.2 ms here in 2 of 3 runs of the loss case, while
    // the machine was slow); an estimate that missed the client's wait
    // on the network would be late in many.
    assert!(
        late.len() * 12 <= err.len(),
        "the client read later than the estimate beyond the bound in {} of {} requests: \
         {late:?} ms",
        late.len(),
        err.len()
    );
    // Each request's first segment and its first token's ACK are seen,
    // but an ACK that is the connection's last segment shows only at the
    // next one: allow a few without an estimate.
    assert!(
        err.len() * 10 >= pairs.len() * 9,
        "estimates for {} of {} requests",
        err.len(),
        pairs.len()
    );
    let abs_max = err.iter().map(|e| e.abs()).fold(0.0, f64::max);
    eprintln!(
        "| {label} | {}/{} | {:.2} / {:.2} ms | {:+.3} / {:.3} ms | {:.2} ms | {runq_max:.3} ms |",
        err.len(),
        pairs.len(),
        p(client.clone(), 0.5),
        client.iter().copied().fold(0.0, f64::max),
        p(err.clone(), 0.5),
        abs_max,
        server.iter().copied().fold(0.0, f64::max),
    );
    Ok(())
}

/// The client's ACK that completes its handshake lost (dropped on every
/// connection; a connection per request): its request's first data segment
/// completes the handshake instead, which `tcp:tcp_probe` does not see.
/// Every request must still have its segment (the handshake's: note
/// `request_segment_at_handshake`), never before the client's send, and a
/// client-TTFT estimate as good as without the loss. Before, none had
/// either; 20 % loss of the server's packets made it happen now and then
/// (a lost SYN-ACK, then the client's ACK overtaken by its request): a
/// first token retransmitted for 200 ms went unnamed.
#[test]
fn a_lost_handshake_ack_still_dates_the_request() -> Result<()> {
    let Some(_g) = root_test("a_lost_handshake_ack_still_dates_the_request") else {
        return Ok(());
    };
    let (out, clients, _) = run_with_env(
        &["--close-after-response", "--output-tokens", "16"],
        &[
            "--concurrency",
            "2",
            "--requests",
            "16",
            "--output-tokens",
            "16",
        ],
        false,
        Some(Fault::HandshakeAcks),
        CGROUP,
    )?;
    assert!(
        clients
            .iter()
            .all(|c| c.outcome == "ok" && c.req_on_conn == 1),
        "a connection per request, each ok"
    );
    let traced = requests(&out);
    for (c, t) in pair(&traced, &clients) {
        let notes = t["notes"].as_array().context("notes")?;
        assert!(
            notes.iter().any(|n| n == "request_segment_at_handshake"),
            "the request's data came with the handshake: {t}"
        );
        // Never before the client's send (the check is client_start_ms's).
        client_start_ms(c.t_send.context("t_send")?, t);
        assert!(t["t_request_segment_ns"].is_u64(), "{t}");
    }
    eprintln!(
        "| segments | loss | requests with an estimate | client TTFT P50 / max | estimate − client median / max abs | server TTFT max | client run-queue max |"
    );
    eprintln!("| --- | --- | --- | --- | --- | --- | --- |");
    judge_estimates("cgroup ingress | handshake ACKs", &out, &clients)?;
    // The self-check tells this (data with the handshake, which no hook
    // sees) from a listener outside the cgroup: no fallback.
    assert!(
        !out.stderr.contains("tracepoint tcp:tcp_probe"),
        "{}",
        out.stderr
    );
    Ok(())
}

/// A server that closes after every response (`Connection: close`, then
/// `shutdown()` and `close()`) and writes the chunked terminator in two sends
/// (`0\r\n`, then `\r\n`), as issue 13's server did: every response is whole
/// (`ok`, E2E and TPOT present), and the first token's ACK that comes after
/// the close still counts.
#[test]
fn a_server_that_closes_after_every_response() -> Result<()> {
    let Some(_g) = root_test("a_server_that_closes_after_every_response") else {
        return Ok(());
    };
    let (out, clients) = run(
        &[
            "--close-after-response",
            "--split-terminator",
            "--output-tokens",
            "8",
        ],
        &[
            "--concurrency",
            "2",
            "--requests",
            "16",
            "--output-tokens",
            "8",
        ],
        false,
    )?;
    assert!(clients.iter().all(|c| c.outcome == "ok"));
    assert!(
        clients.iter().all(|c| c.req_on_conn == 1),
        "one connection per request"
    );
    let traced = requests(&out);
    let pairs = pair(&traced, &clients);
    assert_eq!(pairs.len(), clients.len(), "every client request traced");
    let mut err = Vec::new();
    let mut by_close = 0;
    for (c, t) in &pairs {
        assert_eq!(t["outcome"], "ok", "{t}");
        assert_eq!(t["framing"], "http1", "{t}");
        assert!(t["e2e_ns"].is_u64() && t["tpot_ns"].is_u64(), "{t}");
        // 8 tokens and `data: [DONE]`; the two sends of the terminator are
        // no chunks.
        assert_eq!(t["chunks"], 9, "{t}");
        let notes = t["notes"].as_array().context("notes")?;
        by_close += usize::from(notes.iter().any(|n| n == "first_token_acked_by_close"));
        if let Some(est) = t["client_ttft_estimate_ns"].as_u64() {
            let e = est as f64 / 1e6 - c.ttft_s.context("client ttft")? * 1e3;
            if e.abs() > 5.0 {
                eprintln!("estimate off by {e:.3} ms: client {c:?}, traced {t}");
            }
            err.push(e);
        } else {
            eprintln!("no estimate: {t}");
        }
    }
    let abs_max = err.iter().map(|e| e.abs()).fold(0.0, f64::max);
    eprintln!(
        "close after every response: {} of {} with an estimate ({by_close} by the close), \
         estimate - client median {:+.3} ms, max abs {abs_max:.3} ms",
        err.len(),
        pairs.len(),
        if err.is_empty() {
            0.0
        } else {
            p(err.clone(), 0.5)
        },
    );
    // On loopback the estimate is the client's own TTFT within a few tens
    // of µs; 5 ms leaves room for a loaded machine, not for another
    // connection's ACK (issue: the kernel reuses a closed socket's address).
    let close = err.iter().filter(|e| e.abs() < 5.0).count();
    assert!(
        close * 10 >= pairs.len() * 9,
        "estimates within 5 ms of the client's for {close} of {} requests ({} with one)",
        pairs.len(),
        err.len(),
    );
    Ok(())
}

/// One streamed completion on `conn`, read to the end of its chunked body.
fn stream_one(conn: &mut TcpStream) -> Result<()> {
    let body = r#"{"prompt":"x","max_tokens":4,"stream":true}"#;
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut data = Vec::new();
    let mut buf = [0u8; 65536];
    while !data.ends_with(b"0\r\n\r\n") {
        let n = conn.read(&mut buf)?;
        anyhow::ensure!(n > 0, "the server closed the connection");
        data.extend_from_slice(&buf[..n]);
    }
    Ok(())
}

/// A server whose listening socket was made outside its cgroup (it
/// listened, then moved; systemd socket activation hands a server a socket
/// of the socket unit's cgroup): its connections are the listener's
/// cgroup's, and the tracer asks the kernel (sock_diag) which one that is.
#[test]
fn a_listener_in_another_cgroup_has_its_segments_seen_there() -> Result<()> {
    let Some(_g) = root_test("a_listener_in_another_cgroup_has_its_segments_seen_there") else {
        return Ok(());
    };
    let load = [
        "--concurrency",
        "2",
        "--requests",
        "8",
        "--output-tokens",
        "8",
    ];
    // Made in a cgroup of its own: the program on that cgroup and the
    // server's; every request's segments seen, the first ones too.
    let (out, clients, _) = run_with_env(
        &["--output-tokens", "8"],
        &load,
        false,
        None,
        LISTENER_ELSEWHERE,
    )?;
    let scoped = out.stderr.matches(LISTENER_ELSEWHERE.log).count();
    assert_eq!(
        scoped, 2,
        "the server's cgroup and its listener's:\n{}",
        out.stderr
    );
    assert!(
        !out.stderr.contains("tracepoint tcp:tcp_probe"),
        "{}",
        out.stderr
    );
    every_segment_seen(&out, clients.len());
    // Made in the root cgroup: every segment of the host runs the program
    // there, so host-wide from the start, saying why.
    let (out, clients, _) = run_with_env(
        &["--output-tokens", "8"],
        &load,
        false,
        None,
        LISTENER_IN_ROOT,
    )?;
    LISTENER_IN_ROOT.assert_used(&out);
    every_segment_seen(&out, clients.len());
    Ok(())
}

/// Every one of `sent` requests traced, each with its request segment and
/// a client estimate.
fn every_segment_seen(out: &TraceOutput, sent: usize) {
    let traced = requests(out);
    assert_eq!(traced.len(), sent, "every request traced");
    for r in traced {
        assert!(r["t_request_segment_ns"].is_u64(), "{r}");
        assert!(r["client_ttft_estimate_ns"].is_u64(), "{r}");
    }
}

/// A keep-alive connection opened before the tracer started (a gateway's
/// pool lives for hours): it is followed from its next request on.
#[test]
fn a_connection_opened_before_tracing_is_adopted() -> Result<()> {
    let Some(_g) = root_test("a_connection_opened_before_tracing_is_adopted") else {
        return Ok(());
    };
    // Adoption reads the socket's ports and addresses: from the raw
    // tracepoint's socket, or the classic tracepoint's record.
    for hook in SEGMENT_HOOKS {
        adopted_with(hook)?;
    }
    Ok(())
}

fn adopted_with(hook: Hook) -> Result<()> {
    let server = hook.server(&["--output-tokens", "4"])?;
    let mut conn = TcpStream::connect(("127.0.0.1", server.port))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let port = conn.local_addr()?.port();
    stream_one(&mut conn)?;
    let args = vec![
        "--pid".to_string(),
        server.pid.to_string(),
        "--interval".into(),
        "60".into(),
    ];
    let mut tracer = Tracer::start_with_env(&args, 0, hook.env)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    for _ in 0..3 {
        stream_one(&mut conn)?;
    }
    std::thread::sleep(Duration::from_millis(300));
    let out = tracer.interrupt(Duration::from_secs(30))?;
    drop(conn);
    server.stop()?;
    assert!(out.success, "{}", out.stderr);
    hook.assert_used(&out);
    let mine: Vec<&Value> = requests(&out)
        .into_iter()
        .filter(|r| r["client_port"].as_u64() == Some(u64::from(port)))
        .collect();
    let index: Vec<u64> = mine
        .iter()
        .filter_map(|r| r["request_index"].as_u64())
        .collect();
    assert_eq!(index, [0, 1, 2], "{mine:#?}");
    for r in &mine {
        assert_eq!(
            (&r["outcome"], &r["framing"]),
            (&"ok".into(), &"http1".into()),
            "{r}"
        );
        assert!(r["ttft_ns"].is_u64() && r["e2e_ns"].is_u64(), "{r}");
    }
    let adopted: u64 = out
        .totals()
        .context("totals")?
        .request_stats
        .iter()
        .filter_map(|w| w.stats.get("connections_adopted"))
        .sum();
    assert_eq!(adopted, 1, "the one connection opened before tracing");
    eprintln!(
        "{}: client estimates on the adopted connection: {:?}",
        hook.name,
        mine.iter()
            .map(|r| r["client_ttft_estimate_ns"].clone())
            .collect::<Vec<_>>()
    );
    Ok(())
}
