//! Root-only: real HTTP server stacks (installed by `cargo xtask setup`, not
//! written here) serving a streamed completions endpoint under `ttft-trace
//! attach`, driven by real clients (the `openai` Python client, `httpx`,
//! `curl`: tests/stacks/client.py). Per stack: every request sent is found in
//! the trace (client port and request index on the connection), each
//! complete response is `ok` with E2E and TPOT, and the traced TTFT agrees
//! with the client's own. Prints one markdown table (docs/measurements.md, "Real HTTP
//! stacks under the tracer"). `TTFT_STACKS=a,b` runs only those stacks.
//! Under loss: the first token's (`network_loss_on_real_stacks`), and loss
//! mid-stream, found between the chunks' ACKs (`midstream_loss_on_real_stacks`).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    sync::RwLock,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use serde::Deserialize;
use serde_json::Value;
use ttft_trace_tests::{
    container::{PodCgroup, place_in_root_cgroup},
    demo::{read_jsonl, server_stamps},
    faults::{self, PacketLoss},
    fixtures,
    prometheus::free_port,
    server_clock::{Deviations, Tolerance, app_stamps, request_key},
    stacks::{
        CLIENT_READ_P50_MS, CLIENT_READ_P99_MS, Group, stacks_dir, venv_python, venv_ready,
        wait_listening,
    },
    stalls::{StallMonitor, Stalls},
    tracer::{ATTACHED, Tracer, root_test},
};

/// Requests per stack (a third per client kind) and tokens per response.
const REQUESTS: usize = 12;
const TOKENS: u64 = 8;
/// Under loss, curl requests per stack in batches of [`LOSS_BATCH`] until
/// [`LOSS_LEAST_SLOW`] came slow, [`LOSS_MAX_REQUESTS`] at most. Only a
/// first token lost twice (its fast retransmit too) or held back by Nagle
/// waits for a retransmit timeout: 1 to 10 of 30 requests came slow (run
/// of 10:16 UTC, 2026-12-01), too few on some stacks for a fixed count.
const LOSS_BATCH: usize = 15;
const LOSS_LEAST_SLOW: usize = 3;
const LOSS_MAX_REQUESTS: usize = 90;
/// Client TTFT minus traced TTFT, over the compared requests, less the two
/// parts the tracer measures apart (the request's unread wait in the
/// server's socket, and, where the client stamps its send on the tracer's
/// clock, its own start up to the request's first segment): the client's
/// time to read its first token on loopback (openai's client parses each
/// chunk into pydantic objects first), and curl's to send. At P99 (the
/// largest of 9), less the CPUs' stalls between the first token's send and
/// the client's read ([`Stalls`]) or the client's own holds there (its waits
/// for a CPU, its garbage collector: [`ClientRecord::held_ms`]): CI saw an
/// `openai` read 25.7 ms after the client's ACK on tornado (the CI run of
/// 473bf02), the server's own gaps between tokens stretched to 16 ms at the
/// same time.
const P50_TOLERANCE_MS: f64 = CLIENT_READ_P50_MS;
const P99_TOLERANCE_MS: f64 = CLIENT_READ_P99_MS;
/// The tracer's client TTFT estimate (`client_ttft_estimate_ns`: the
/// client's ACK of the first token minus the request's segment) against the
/// client's own TTFT less its start (both then begin at the segment), per
/// compared request: on loopback the two differ by the client's time to
/// read (as above; the estimate reads late the other way when a client
/// delays its ACK). Measured at 00:48 UTC, 2026-12-02: every request of
/// every stack had an estimate, client − start − estimate P50 0.18-0.87
/// ms, the largest 3.2 ms (uvicorn-httptools, httpx); with the start left
/// in (00:46), three stacks had one openai request each 5.4-8.8 ms over.
/// Another connection's ACK (the bug of reused socket addresses) was 88 ms
/// off. The client's side, less the CPUs' stalls or the client's holds, as
/// above.
const ESTIMATE_TOLERANCE_MS: f64 = 5.0;
/// Requests of a stack allowed without an estimate, and compared requests
/// allowed further than [`ESTIMATE_TOLERANCE_MS`] from the client's TTFT:
/// none was seen, one leaves room for a scheduling hiccup of a client on
/// this shared machine (8.6 ms seen in the TTFT itself).
const ESTIMATE_MISSES: usize = 1;

/// The tracer's log lines for its segment hook: on the server's cgroup
/// (what every stack here should get), or host-wide (its fallback).
const SCOPED_HOOK: &str = "segments: seen at the ingress of cgroup";
const HOST_WIDE_HOOK: &str = "tracepoint tcp:tcp_probe";

const STACKS: [&str; 9] = [
    "uvicorn-h11",
    "uvicorn-httptools",
    "hypercorn",
    "aiohttp",
    "gunicorn-sync",
    "tornado",
    "axum",
    "libmicrohttpd",
    "nginx+demo",
];

/// How far each stack's own stamps may be from the tracer's, per request
/// (ttft_trace_tests::server_clock): the read stamp is never before the
/// traced arrival, the traced first token never before the send stamp, and
/// neither more than these apart. Where each stack stamps:
/// - Python stacks (tests/stacks/apps.py): the handler's first line, after
///   the stack read and parsed the request (and, on the event loops, ran
///   the handler's task), and just before the handler hands the stack its
///   first token; so the arrival bound holds the stack's parsing and
///   scheduling, the first-token bound its way to the send.
/// - axum: its listener's stream (tests/stacks/axum_writes.rs), right after
///   the read that returned the request's first bytes and right before the
///   write that carried its first body bytes: the socket calls themselves.
/// - libmicrohttpd (tests/stacks/mhd.c): when it first hands the request to
///   the handler (head read and parsed) and just before the reader returns
///   the first token.
/// - nginx+demo: nginx stamps nothing; the demo behind it does
///   (tests/demo/server.py, its read and its send), on its upstream
///   connections, one request at a time.
///
/// Measured 09:01-09:10 UTC, 2026-12-05 (load average about 4 on 2 cores,
/// two other builds beside; see docs/measurements.md).
fn clock_tolerance(stack: &str) -> Tolerance {
    match stack {
        "axum" | "libmicrohttpd" => Tolerance {
            arrival_ms: 20.0,
            first_token_ms: 20.0,
            median_ms: 0.5,
        },
        "nginx+demo" => Tolerance {
            arrival_ms: 20.0,
            first_token_ms: 20.0,
            median_ms: 0.5,
        },
        _ => Tolerance {
            arrival_ms: 50.0,
            first_token_ms: 50.0,
            median_ms: 2.0,
        },
    }
}

/// The command that serves `stack` on `port` (and `upstream`, behind a
/// proxy; axum logs its own count of body sends to `writes_log`), or why it
/// cannot run here.
fn server(
    stack: &str,
    port: u16,
    upstream: u16,
    cudart: &Path,
    writes_log: &Path,
) -> Result<Command, String> {
    // The clients of every stack, and the Python stacks.
    venv_ready()?;
    match stack {
        "axum" => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_stack-axum"));
            c.arg(port.to_string()).arg(cudart).arg(writes_log);
            return Ok(c);
        }
        "libmicrohttpd" => {
            let mut c = Command::new(build_mhd()?);
            c.arg(port.to_string()).arg(cudart);
            return Ok(c);
        }
        _ => {}
    }
    let py = venv_python();
    let mut c = Command::new(&py);
    let p = port.to_string();
    let bind = format!("127.0.0.1:{port}");
    match stack {
        "uvicorn-h11" | "uvicorn-httptools" => {
            let http = stack.trim_start_matches("uvicorn-");
            // asyncio's loop by name: uvloop is installed (the TLS test's).
            c.args(["-m", "uvicorn", "apps:asgi", "--http", http, "--port", &p])
                .args(["--loop", "asyncio"])
                .args(["--no-access-log", "--log-level", "warning"]);
        }
        "hypercorn" => {
            c.args(["-m", "hypercorn", "apps:asgi", "--bind", &bind])
                .args(["--log-level", "warning"]);
        }
        "gunicorn-sync" => {
            // --preload: the app (and the CUDA runtime) is loaded in the
            // master, so the tracer finds it there at attach.
            c.args([
                "-m",
                "gunicorn",
                "--preload",
                "-w",
                "2",
                "-k",
                "sync",
                "-b",
                &bind,
            ])
            .args(["--log-level", "warning", "apps:wsgi"]);
        }
        "aiohttp" | "tornado" => {
            c.args(["apps.py", stack, &p]);
        }
        "nginx+demo" => {
            if !Path::new("/usr/sbin/nginx").is_file() {
                return Err("nginx is not installed: run `cargo xtask setup`".into());
            }
            c = Command::new(stacks_dir().join("nginx_demo.sh"));
            c.arg(&p).arg(upstream.to_string()).arg(cudart);
        }
        other => return Err(format!("unknown stack {other}")),
    }
    c.current_dir(stacks_dir())
        .env("STACK_CUDART", cudart)
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    Ok(c)
}

/// Builds tests/stacks/mhd.c against the system's libmicrohttpd.
fn build_mhd() -> Result<PathBuf, String> {
    if !Path::new("/usr/include/microhttpd.h").is_file() {
        return Err("libmicrohttpd-dev is not installed: run `cargo xtask setup`".into());
    }
    let bin = fixtures::fixture_dir().join("stack-mhd");
    let out = Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&bin)
        .arg(stacks_dir().join("mhd.c"))
        .args(["-lmicrohttpd", "-ldl", "-lpthread"])
        .output()
        .map_err(|e| format!("running cc: {e}"))?;
    // A build failure with the library installed is a failure, not a skip.
    assert!(
        out.status.success(),
        "cc tests/stacks/mhd.c: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(bin)
}

/// One request as tests/stacks/client.py measured it.
#[derive(Debug, Deserialize)]
struct ClientRecord {
    client: String,
    path: String,
    client_port: u16,
    req_on_conn: u64,
    ttft_s: Option<f64>,
    /// The client's own CLOCK_MONOTONIC stamps (the tracer's clock), where
    /// it gives them (openai, httpx; curl stamps the time of day).
    t_send: Option<u64>,
    t_first_token: Option<u64>,
    chunks: u64,
    outcome: String,
    warmup: bool,
    /// What held the client's read of its first token back (openai, httpx;
    /// tests/stacks/client.py's `Pauses`): its thread's waits for a CPU from
    /// the start of the socket read that returned the token to its stamp,
    /// and its garbage collector's pauses.
    #[serde(default)]
    queued_ns: Option<u64>,
    #[serde(default)]
    gc_pauses: Vec<(u64, u64)>,
}

impl ClientRecord {
    /// How long the client's own process held its read of a first token
    /// sent at `sent` and stamped at `read` back, in ms.
    fn held_ms(&self, sent: u64, read: u64) -> f64 {
        let gc: u64 = self
            .gc_pauses
            .iter()
            .map(|&(a, b)| b.min(read).saturating_sub(a.max(sent)))
            .sum();
        (gc + self.queued_ns.unwrap_or(0)) as f64 / 1e6
    }
}

/// What one stack's run measured.
struct Row {
    stack: String,
    sent: usize,
    matched: usize,
    ok: usize,
    client: (f64, f64),
    traced: (f64, f64),
    diff: (f64, f64),
    /// The largest difference, and the client that measured it.
    worst: (f64, String),
    /// openai requests the client closed at `[DONE]`, before the server
    /// wrote the chunked terminator, which it then never wrote.
    closed_at_done: usize,
    /// Requests joined to the GPU episode of their first token.
    gpu: usize,
    /// Requests with a client TTFT estimate, of those matched.
    estimated: usize,
    /// Client TTFT minus the tracer's estimate of it, P50 / P99 of the
    /// compared requests, and the largest by magnitude (signed).
    est_diff: (f64, f64, f64),
    /// Compared requests with an estimate within ESTIMATE_TOLERANCE_MS.
    est_close: (usize, usize),
    e2e_tpot: usize,
    chunks: (u64, u64),
    /// Compared requests whose client read came after a stall of the CPUs
    /// or was held by the client's own process (waiting for a CPU, its
    /// garbage collector), and the longest such hold allowed, in ms.
    held: (usize, f64),
    notes: String,
}

fn p(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * q).round() as usize]
}

/// How one stack is driven.
struct Load<'a> {
    clients: &'a str,
    requests: usize,
    /// Percent of the server's packets dropped on their way to the client.
    loss: Option<u32>,
    /// Its SYN-ACKs spared ([`PacketLoss::from_server_after_handshake`]).
    loss_spares_handshake: bool,
    /// Tokens per response.
    tokens: u64,
    /// Pulses of loss while the clients run: every server packet but the
    /// SYN-ACKs dropped (99 %) for [`PULSE_ON`], then none for [`PULSE_OFF`].
    loss_pulses: bool,
    /// Extra tracer arguments.
    tracer: &'a [&'a str],
    /// Run `requests` more (a new batch of the client) until this many are
    /// slow by the client's own TTFT; `None`: one batch.
    until_slow: Option<UntilSlow>,
    /// Run the server where it was started (this machine's root cgroup, as
    /// a server started from a shell often is), so that the tracer takes
    /// its host-wide segment hook; otherwise in a cgroup of its own.
    in_root_cgroup: bool,
}

/// Enough slow requests for a recall to mean something, at a bounded cost.
struct UntilSlow {
    /// Slow requests wanted.
    least: usize,
    /// Slow: a client TTFT over this.
    over_s: f64,
    /// Requests sent at most, whatever came slow.
    max_requests: usize,
}

impl UntilSlow {
    fn is_slow(&self, c: &ClientRecord) -> bool {
        c.ttft_s.is_some_and(|s| s > self.over_s)
    }
}

const MATRIX: Load = Load {
    clients: "openai,httpx,curl",
    requests: REQUESTS,
    loss: None,
    loss_spares_handshake: false,
    tokens: TOKENS,
    loss_pulses: false,
    tracer: &[],
    until_slow: None,
    in_root_cgroup: false,
};

/// One stack's traced run: what the clients measured, and the traced
/// requests on the stack's port by (client port, request index from 1).
struct Run {
    clients: Vec<ClientRecord>,
    traced: HashMap<(u64, u64), Value>,
    /// The traced arrival and first token against the server's own stamps.
    clock: Deviations,
    upstream_note: String,
    /// Behind a proxy, the chunks of the demo's own response (one send per
    /// chunk) by the proxied request's key: the proxy joins chunks that
    /// arrive together, so the client's side may count fewer.
    upstream_chunks: HashMap<(u64, u64), u64>,
    /// The server's own count of its sends that carried body, by request
    /// key, where it keeps one (axum: tests/stacks/axum_writes.rs).
    server_writes: HashMap<(u64, u64), u64>,
    /// When the CPUs stood still during the clients' run.
    stalls: Stalls,
    /// The tracer's totals (what it dropped or could not route) and last
    /// lines, printed when a stack fails.
    tracer_tail: String,
    /// The loss pulses (`Load::loss_pulses`), on CLOCK_MONOTONIC.
    pulses: Vec<(u64, u64)>,
}

/// Runs `stack` under the tracer with `load`; `None` when it is not
/// installed here (a failure under TTFT_TRACE_REQUIRE_FIXTURES).
fn traced_run(stack: &str, cudart: &Path, load: &Load) -> Result<Option<Run>> {
    let port = free_port()?;
    let upstream = free_port()?;
    let proxied = stack.starts_with("nginx");
    let writes_log = fixtures::temp_path("stack-writes", "jsonl");
    let stamps_log = fixtures::temp_path("stack-stamps", "jsonl");
    let cmd = match server(stack, port, upstream, cudart, &writes_log) {
        Ok(c) => c,
        Err(why) => {
            ttft_trace_tests::skip_or_fail(stack, &why);
            return Ok(None);
        }
    };
    // In a cgroup of its own, as under a container runtime or a systemd
    // unit: the tracer's default segment hook, on that cgroup's ingress.
    // Declared first, so it is removed after the group is gone.
    let cgroup = if load.in_root_cgroup {
        None
    } else {
        Some(PodCgroup::new()?)
    };
    let mut cmd = cmd;
    cmd.env("STACK_STAMPS", &stamps_log);
    match &cgroup {
        Some(cgroup) => cgroup.place(&mut cmd)?,
        None => place_in_root_cgroup(&mut cmd)?,
    }
    let mut group = Group::spawn(cmd)?;
    wait_listening(port, || group.0.try_wait())?;
    if proxied {
        wait_listening(upstream, || group.0.try_wait())?;
    }
    let mut args = vec![
        "--pid".to_string(),
        group.pid().to_string(),
        "--interval".into(),
        "60".into(),
        "--no-nvml".into(),
    ];
    args.extend(load.tracer.iter().map(|a| a.to_string()));
    let mut tracer = Tracer::start(&args, 0)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    // The stub runtime and its driver.
    tracer.wait_for_stderr(ATTACHED, 2, Duration::from_secs(30))?;
    let port_s = port.to_string();
    ensure!(
        tracer
            .stderr_lines
            .iter()
            .any(|l| l.contains("following requests on port")
                && l.split(|ch: char| !ch.is_ascii_digit())
                    .any(|w| w == port_s)),
        "{stack}: port {port} not followed: {:?}",
        tracer.stderr_lines
    );
    let loss = load
        .loss
        .map(|pct| {
            if load.loss_spares_handshake {
                PacketLoss::from_server_after_handshake(port, pct)
            } else {
                PacketLoss::start_with(port, pct, faults::Direction::FromServer)
            }
        })
        .transpose()?;
    let pulsing = load.loss_pulses.then(|| LossPulses::start(port));
    let mut clients: Vec<ClientRecord> = Vec::new();
    let monitor = StallMonitor::start()?;
    loop {
        let out = fixtures::temp_path("stack-client", "jsonl");
        let status = Command::new(venv_python())
            .arg(stacks_dir().join("client.py"))
            .args(["--url", &format!("http://127.0.0.1:{port}")])
            .args(["--requests", &load.requests.to_string()])
            .args(["--clients", load.clients])
            .args(["--tokens", &load.tokens.to_string(), "--out"])
            .arg(&out)
            .args(proxied.then_some("--no-ndjson"))
            .status()
            .context("running tests/stacks/client.py")?;
        ensure!(status.success(), "{stack}: client failed: {status}");
        clients.extend(read_jsonl::<ClientRecord>(&out)?);
        let _ = std::fs::remove_file(&out);
        let Some(u) = &load.until_slow else {
            break;
        };
        let slow = clients.iter().filter(|c| u.is_slow(c)).count();
        if slow >= u.least || clients.len() >= u.max_requests {
            break;
        }
    }
    drop(loss);
    let pulses = pulsing
        .map(LossPulses::stop)
        .transpose()?
        .unwrap_or_default();
    let stalls = monitor.finish();
    // The last response's close and the server's own grace, then stop.
    thread::sleep(Duration::from_millis(300));
    let trace = tracer.interrupt(Duration::from_secs(30))?;
    drop(group);
    drop(cgroup);
    ensure!(trace.success, "{}", trace.stderr);
    let scoped = trace.stderr.contains(SCOPED_HOOK) && !trace.stderr.contains(HOST_WIDE_HOOK);
    ensure!(
        scoped != load.in_root_cgroup,
        "{stack}: segments not seen {}:\n{}",
        if load.in_root_cgroup {
            "host-wide"
        } else {
            "at the server's cgroup ingress alone"
        },
        trace.stderr
    );
    let server_writes = server_writes(&writes_log)?;
    let on_port = |p: u16| {
        trace
            .lines
            .iter()
            .filter(move |l| l["type"] == "request" && l["server_port"].as_u64() == Some(p.into()))
    };
    let traced = by_port_order(on_port(port));
    // Behind the proxy, the demo's own requests come from nginx's pool of
    // upstream connections: each one traced, on fewer connections than
    // requests (kept alive).
    let mut upstream_chunks = HashMap::new();
    let upstream_note = if proxied {
        let mut behind: Vec<&Value> = on_port(upstream).collect();
        let conns = behind
            .iter()
            .filter(|r| r["request_index"].as_u64() == Some(0))
            .count();
        ensure!(
            behind.len() == clients.len() && conns < behind.len(),
            "{stack}: {} upstream requests on {conns} connections for {} sent",
            behind.len(),
            clients.len()
        );
        for r in &behind {
            ensure!(
                r["outcome"] == "ok" && r["ttft_ns"].is_u64(),
                "upstream: {r}"
            );
        }
        // The clients ask one at a time: the n-th request to arrive at the
        // proxy is the n-th to arrive at the demo.
        let mut front: Vec<(&(u64, u64), &Value)> = traced.iter().collect();
        ensure!(
            front.len() == behind.len(),
            "{stack}: {} requests at the proxy, {} behind it",
            front.len(),
            behind.len()
        );
        front.sort_by_key(|(_, r)| arrival(r));
        behind.sort_by_key(|r| arrival(r));
        for ((key, _), b) in front.iter().zip(&behind) {
            upstream_chunks.insert(**key, b["chunks"].as_u64().unwrap_or(0));
        }
        format!("upstream: {} requests on {conns} connections", behind.len())
    } else {
        String::new()
    };
    // The server's own stamps of each request: the app's; behind the
    // proxy, the demo's, on its upstream connections.
    let clock = if proxied {
        let behind: HashMap<(u64, u64), &Value> =
            on_port(upstream).map(|r| (request_key(r), r)).collect();
        let stamps = if stamps_log.exists() {
            server_stamps(&stamps_log)?
        } else {
            Vec::new()
        };
        Deviations::judge(&stamps, &behind, clock_tolerance(stack))
    } else {
        Deviations::judge(&app_stamps(&stamps_log)?, &traced, clock_tolerance(stack))
    };
    let _ = std::fs::remove_file(&stamps_log);
    let totals = trace.lines.iter().filter(|l| l["type"] == "totals");
    let tail = trace.stderr.lines().rev().take(4).collect::<Vec<_>>();
    let tracer_tail = totals
        .map(Value::to_string)
        .chain(tail.into_iter().rev().map(str::to_string))
        .collect::<Vec<_>>()
        .join("\n");
    Ok(Some(Run {
        clients,
        traced,
        clock,
        upstream_note,
        upstream_chunks,
        server_writes,
        stalls,
        tracer_tail,
        pulses,
    }))
}

/// Loss pulses for mid-stream loss ([`Load::loss_pulses`]).
const PULSE_ON: Duration = Duration::from_millis(300);
const PULSE_OFF: Duration = Duration::from_millis(1200);

/// A thread that drops the server's packets in pulses until stopped.
struct LossPulses {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: thread::JoinHandle<Result<Vec<(u64, u64)>>>,
}

impl LossPulses {
    fn start(port: u16) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = thread::spawn(move || {
            let mut pulses = Vec::new();
            loop {
                thread::sleep(PULSE_OFF);
                if stopped.load(Relaxed) {
                    return Ok(pulses);
                }
                let loss = PacketLoss::from_server_after_handshake(port, 99)?;
                let from = fixtures::monotonic_ns();
                thread::sleep(PULSE_ON);
                let to = fixtures::monotonic_ns();
                loss.stop()?;
                pulses.push((from, to));
            }
        });
        Self { stop, thread }
    }

    fn stop(self) -> Result<Vec<(u64, u64)>> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the loss pulses' thread panicked"))?
    }
}

fn arrival(r: &Value) -> u64 {
    r["t_arrive_ns"].as_u64().unwrap_or(0)
}

/// The traced requests keyed as the client counts its own: by client port
/// and order of arrival from 1. The tracer's `request_index` starts again
/// with each connection, and the kernel may give a client port to a new
/// connection at once where the server closed the last (no TIME_WAIT on
/// the client's side): under loss on gunicorn's sync workers, a client's
/// second request on a port was keyed as the first and missed ("not
/// traced", the flake of 2026-12-05 and 2026-12-07).
fn by_port_order<'a>(records: impl Iterator<Item = &'a Value>) -> HashMap<(u64, u64), Value> {
    let mut by_port: HashMap<u64, Vec<&Value>> = HashMap::new();
    for r in records {
        let port = r["client_port"].as_u64().unwrap_or(0);
        by_port.entry(port).or_default().push(r);
    }
    let mut keyed = HashMap::new();
    for (port, mut rs) in by_port {
        rs.sort_by_key(|r| arrival(r));
        for (i, r) in rs.into_iter().enumerate() {
            keyed.insert((port, i as u64 + 1), r.clone());
        }
    }
    keyed
}

/// The last count of each request in a server's writes log (none when the
/// server keeps no log), by (client port, request index from 1).
fn server_writes(log: &Path) -> Result<HashMap<(u64, u64), u64>> {
    #[derive(Deserialize)]
    struct Count {
        client_port: u64,
        request_index: u64,
        writes: u64,
    }
    if !log.exists() {
        return Ok(HashMap::new());
    }
    let counts = read_jsonl::<Count>(log)?;
    let _ = std::fs::remove_file(log);
    let mut last = HashMap::new();
    for c in counts {
        let n = last.entry((c.client_port, c.request_index)).or_insert(0);
        *n = c.writes.max(*n);
    }
    Ok(last)
}

fn judge(stack: &str, run: Run) -> Result<()> {
    let Run {
        clients,
        traced,
        clock,
        upstream_note,
        upstream_chunks,
        server_writes,
        stalls,
        ..
    } = run;
    ensure!(
        clients.len() == REQUESTS,
        "{stack}: {} records",
        clients.len()
    );
    for c in &clients {
        ensure!(
            c.outcome == "ok" && c.chunks == TOKENS,
            "{stack}: the client's own request failed: {c:?}"
        );
    }
    let mut row = Row {
        stack: stack.to_string(),
        sent: clients.len(),
        matched: 0,
        ok: 0,
        client: (0.0, 0.0),
        traced: (0.0, 0.0),
        diff: (0.0, 0.0),
        worst: (0.0, String::new()),
        closed_at_done: 0,
        gpu: 0,
        estimated: 0,
        est_diff: (0.0, 0.0, 0.0),
        est_close: (0, 0),
        e2e_tpot: 0,
        chunks: (u64::MAX, 0),
        held: (0, 0.0),
        notes: String::new(),
    };
    let (mut client, mut tracedv, mut diff) = (Vec::new(), Vec::new(), Vec::new());
    let mut diff_less_held = Vec::new();
    let mut est_diff = Vec::new();
    let mut problems = Vec::new();
    let mut finish_read = 0;
    let mut notes: Vec<String> = vec![upstream_note]
        .into_iter()
        .filter(|n| !n.is_empty())
        .collect();
    for c in &clients {
        let Some(t) = traced.get(&(u64::from(c.client_port), c.req_on_conn)) else {
            problems.push(format!(
                "{} {} (port {}, #{}) not in the trace",
                c.client, c.path, c.client_port, c.req_on_conn
            ));
            continue;
        };
        row.matched += 1;
        let chunks = t["chunks"].as_u64().unwrap_or(0);
        // The openai client stops reading at `data: [DONE]` and closes, at
        // times before the chunked terminator is written: a server that
        // then leaves it unwritten (libmicrohttpd, nginx) ended no response
        // by its framing. Counted apart, with every token seen.
        let closed_at_done =
            c.client == "openai" && t["outcome"] == "closed_mid_response" && chunks >= TOKENS;
        if t["outcome"] == "ok" {
            row.ok += 1;
        } else if closed_at_done {
            row.closed_at_done += 1;
        } else {
            problems.push(format!("{} {}: {t}", c.client, c.path));
        }
        if t["gpu_ns"].is_u64() {
            row.gpu += 1;
        } else {
            problems.push(format!("not joined to its GPU episode: {t}"));
        }
        if t["t_done_ns"].is_u64() && t["tpot_ns"].is_u64() {
            row.e2e_tpot += 1;
        } else if !closed_at_done {
            problems.push(format!("no E2E/TPOT: {t}"));
        }
        row.chunks = (row.chunks.0.min(chunks), row.chunks.1.max(chunks));
        // The tokens, plus `[DONE]` / the NDJSON done line, plus the demo's
        // role-only chunk on chat; behind a proxy, the demo's and at most
        // as many on the client's side. hyper (axum) writes the body pieces
        // queued when its connection task runs in one send (CI saw 7 sends
        // on a busy machine): exactly its own count of them.
        let sent = TOKENS..=TOKENS + 2;
        let key = (u64::from(c.client_port), c.req_on_conn);
        match (upstream_chunks.get(&key), server_writes.get(&key)) {
            (Some(up), _) if !sent.contains(up) => {
                problems.push(format!("{up} chunks behind the proxy: {t}"));
            }
            (Some(&up), _) if !(1..=up).contains(&chunks) => {
                problems.push(format!("{chunks} chunks of {up} behind the proxy: {t}"));
            }
            (None, Some(&wrote)) if chunks != wrote => {
                problems.push(format!(
                    "{chunks} chunks, the server's own count of its body sends {wrote}: {t}"
                ));
            }
            (None, None) if stack == "axum" => {
                problems.push(format!("no count of the server's own: {t}"));
            }
            (None, None) if !sent.contains(&chunks) => {
                problems.push(format!("{chunks} chunks: {t}"));
            }
            _ => {}
        }
        // A whole stream is never judged truncated (issue 31): the real
        // stacks write their ends in their own ways (hyper's buffer of its
        // own, nginx's and libmicrohttpd's framing, the openai client's
        // close at `[DONE]`).
        if t["outcome"] == "ok" || closed_at_done {
            let end = &t["stalls"];
            if !end["truncated"].is_null() {
                problems.push(format!("a whole stream judged truncated: {t}"));
            }
            finish_read += usize::from(end["finish_reason"] == "length");
            // Every OpenAI stream here ends with `"finish_reason":"length"`
            // in its last event's last 40 bytes, and every send ends at an
            // event's end: each stack's write shape (hyper's and nginx's
            // `writev` of size line, data and CRLF) shows it in the tail.
            if c.path.starts_with("/v1/") && end["finish_reason"] != "length" {
                problems.push(format!("the last finish reason not read: {t}"));
            }
        }
        for n in t["notes"].as_array().into_iter().flatten() {
            let n = n.as_str().unwrap_or_default().to_string();
            if !notes.contains(&n) {
                notes.push(n);
            }
        }
        let Some(tt) = t["ttft_ns"].as_u64() else {
            problems.push(format!("no TTFT: {t}"));
            continue;
        };
        let ct = c.ttft_s.context("client TTFT")? * 1e3;
        let tt = tt as f64 / 1e6;
        // The server's recv returns after the client sent and its send
        // before the client read: the traced TTFT is never the longer.
        if tt > ct + 0.010 {
            problems.push(format!("traced {tt} ms > client {ct} ms: {t}"));
        }
        let est = t["client_ttft_estimate_ns"]
            .as_u64()
            .map(|e| e as f64 / 1e6);
        row.estimated += usize::from(est.is_some());
        // The request's wait in the server's socket before its first read
        // (from its first segment): the client's TTFT holds it, the
        // server-side one by definition not (a sync worker's accept, a busy
        // event loop). What is left is the client's own delay.
        let unread = match (
            t["t_arrive_ns"].as_u64(),
            t["t_request_segment_ns"].as_u64(),
        ) {
            (Some(a), Some(seg)) if seg <= a => (a - seg) as f64 / 1e6,
            _ => 0.0,
        };
        // On one clock with the client's own stamps: the request's segment
        // comes after the client began to send, the first token's send
        // before the client read it. Between the client's stamp and the
        // segment lies the client's own start (a new connection per request
        // against gunicorn's sync workers: the Python client's connect).
        let client_start = match (c.t_send, t["t_request_segment_ns"].as_u64()) {
            (Some(sent), Some(seg)) if seg >= sent => (seg - sent) as f64 / 1e6,
            (Some(sent), Some(seg)) => {
                problems.push(format!(
                    "segment {seg} before the client's send {sent}: {t}"
                ));
                0.0
            }
            _ => 0.0,
        };
        if let (Some(read), Some(sent)) = (c.t_first_token, t["t_first_token_ns"].as_u64())
            && read < sent
        {
            problems.push(format!("first token read at {read}, sent at {sent}: {t}"));
        }
        // The CPUs' stalls between the first token's send and the client's
        // read (curl's read from its TTFT, which starts before the segment:
        // a little later than the read), or the client's own holds there,
        // whichever is longer (a stall while the client waited for a CPU
        // counts in both). CI saw an openai read 14 ms after the client's
        // ACK on gunicorn-sync with 2.4 ms of stalls (the CI run of 1622afa:
        // two stacks tests at once on two CPUs).
        let read = c.t_first_token.or_else(|| {
            let seg = t["t_request_segment_ns"].as_u64()?;
            Some(seg + ((ct - client_start) * 1e6) as u64)
        });
        let held = match (t["t_first_token_ns"].as_u64(), read) {
            (Some(sent), Some(read)) => {
                let stalled = stalls.within(sent, read) as f64 / 1e6;
                stalled.max(c.held_ms(sent, read))
            }
            _ => 0.0,
        };
        if !c.warmup {
            client.push(ct);
            tracedv.push(tt);
            if held > 0.0 {
                row.held = (row.held.0 + 1, row.held.1.max(held));
            }
            let d = ct - tt - unread - client_start;
            diff.push(d);
            // The holds excuse the client's lateness only: a stall on the
            // other CPU, or in the client's own time to read, takes off too
            // much, which must not fail the other side.
            diff_less_held.push(d - held);
            if d > row.worst.0 {
                row.worst = (d, c.client.clone());
            }
            row.est_close.1 += 1;
            // The estimate starts at the request's segment too.
            let ct = ct - client_start;
            match est {
                Some(e)
                    if ct - e >= -ESTIMATE_TOLERANCE_MS
                        && ct - held - e <= ESTIMATE_TOLERANCE_MS =>
                {
                    row.est_close.0 += 1;
                    est_diff.push(ct - e);
                }
                Some(e) => {
                    est_diff.push(ct - e);
                    eprintln!(
                        "{stack}: estimate {e:.3} ms, client less its start {ct:.3} ms, \
                         {held:.3} ms of it CPU stalls or the client's holds ({}): {t}",
                        c.client
                    );
                }
                None => eprintln!("{stack}: no estimate ({}): {t}", c.client),
            }
        }
    }
    ensure!(
        !diff.is_empty(),
        "{stack}: nothing to compare: {problems:?}"
    );
    row.client = (p(&client, 0.5), p(&client, 0.99));
    row.traced = (p(&tracedv, 0.5), p(&tracedv, 0.99));
    row.diff = (p(&diff, 0.5), p(&diff, 0.99));
    if !est_diff.is_empty() {
        let largest = est_diff
            .iter()
            .copied()
            .max_by(|a, b| a.abs().total_cmp(&b.abs()))
            .unwrap_or(0.0);
        row.est_diff = (p(&est_diff, 0.5), p(&est_diff, 0.99), largest);
    }
    if row.closed_at_done > 0 {
        notes.push(format!(
            "{} openai closed at [DONE] before the terminator (never written)",
            row.closed_at_done
        ));
    }
    if row.held.0 > 0 {
        notes.push(format!(
            "CPU stalls or client holds before {} reads, up to {:.3} ms",
            row.held.0, row.held.1
        ));
    }
    row.notes = notes.join(", ");
    let p99_less_held = p(&diff_less_held, 0.99);
    if row.diff.0 >= P50_TOLERANCE_MS || p99_less_held >= P99_TOLERANCE_MS {
        problems.push(format!(
            "client - traced TTFT - unread wait - client start P50 {:.3} / P99 {:.3} ms, P99 less \
             CPU stalls and client holds {p99_less_held:.3} ms (tolerance {P50_TOLERANCE_MS} / {P99_TOLERANCE_MS} ms)",
            row.diff.0, row.diff.1
        ));
    }
    // Estimates missing or far off, counted apart from the TTFT's own.
    let est_misses = row.est_close.1 - row.est_close.0;
    if est_misses > ESTIMATE_MISSES || row.matched - row.estimated > ESTIMATE_MISSES {
        problems.push(format!(
            "client TTFT estimate within {ESTIMATE_TOLERANCE_MS} ms of the client's for {} of {} \
             compared requests ({} of {} matched have one)",
            row.est_close.0, row.est_close.1, row.estimated, row.matched
        ));
    }
    print_row(&row);
    eprintln!(
        "{stack}: none of {} whole streams judged truncated; the last finish reason read in {finish_read}",
        row.ok + row.closed_at_done
    );
    eprintln!(
        "{stack}: the server's own clock{}: {}",
        if stack.starts_with("nginx") {
            " (the demo behind the proxy)"
        } else {
            ""
        },
        clock.summary()
    );
    if clock.arrival.len() != clients.len() {
        problems.push(format!(
            "{} of {} requests stamped by the server",
            clock.arrival.len(),
            clients.len()
        ));
    }
    problems.extend(clock.problems);
    ensure!(problems.is_empty(), "{stack}:\n{}", problems.join("\n"));
    Ok(())
}

fn print_header() {
    eprintln!(
        "| stack | seen / sent | `ok` | client TTFT P50 / P99 | traced TTFT P50 / P99 | \
         client − traced − unread − start P50 / P99 | largest (client) | estimate / seen | client − start − estimate P50 / P99 \
         (largest) | within tolerance | E2E + TPOT | GPU joined | chunks | notes |"
    );
    eprintln!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
}

fn print_row(r: &Row) {
    eprintln!(
        "| {} | {} / {} | {} | {:.2} / {:.2} ms | {:.2} / {:.2} ms | {:.3} / {:.3} ms | {:.3} ms ({}) \
         | {} / {} | {:.3} / {:.3} ms ({:.3}) | {} / {} | {} | {} | {}–{} | {} |",
        r.stack,
        r.matched,
        r.sent,
        r.ok,
        r.client.0,
        r.client.1,
        r.traced.0,
        r.traced.1,
        r.diff.0,
        r.diff.1,
        r.worst.0,
        r.worst.1,
        r.estimated,
        r.matched,
        r.est_diff.0,
        r.est_diff.1,
        r.est_diff.2,
        r.est_close.0,
        r.est_close.1,
        r.e2e_tpot,
        r.gpu,
        r.chunks.0,
        r.chunks.1,
        r.notes
    );
}

/// [`estimate_under_loss_on_a_closing_stack`] runs alone, the other two
/// side by side: beside them it twice lost a request's record under 35 %
/// loss on 2 CPUs (2026-12-05, `req_on_conn: 2 ... not traced`). That was
/// the test's own matching, a client port given again to a new connection
/// (seen alone too, 2026-12-07; [`by_port_order`]); it still runs alone, its
/// ACK timings then judged on a machine it does not share.
static ALONE: RwLock<()> = RwLock::new(());

#[test]
fn real_stacks_under_the_tracer() -> Result<()> {
    let Some(_g) = root_test("real_stacks_under_the_tracer") else {
        return Ok(());
    };
    let _beside = ALONE.read().unwrap_or_else(|e| e.into_inner());
    let cudart = fixtures::existing_fixture(fixtures::STUB_CUDART)?;
    print_header();
    let mut failed = Vec::new();
    for stack in chosen_stacks() {
        let result = traced_run(stack, &cudart, &MATRIX)
            .and_then(|run| run.map_or(Ok(()), |run| judge(stack, run)));
        if let Err(e) = result {
            eprintln!("FAIL {stack}: {e:#}");
            failed.push(stack);
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
    Ok(())
}

/// The stacks `TTFT_STACKS=a,b` chose (all when unset).
fn chosen_stacks() -> Vec<&'static str> {
    let only = std::env::var("TTFT_STACKS").ok();
    STACKS
        .iter()
        .copied()
        .filter(|s| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|x| x == *s))
        })
        .collect()
}

/// Least share of a stack's slow requests (under loss) to be named
/// `network`: the least measured in four runs of the whole test (10:16,
/// 10:27, 10:35 and 10:42 UTC, 2026-12-01, on this 2-core machine; the first
/// with 30 requests per stack, the others in batches until 3 came slow; the
/// last on this code), with a connection's deliveries keyed by its serial
/// and exact per-segment ACK numbers. Every slow request of every stack was
/// named (132 of 133) but one on libmicrohttpd (3/4): its first token's ACK
/// came 20 ms after the request, yet curl read it 655 ms after (docs/measurements.md,
/// network recall per stack). gunicorn's sync workers close after every
/// response and were asked only a third before: 13 of 13 now.
fn min_recall(stack: &str) -> f64 {
    match stack {
        "libmicrohttpd" => 0.75,
        _ => 1.0,
    }
}

/// `network` recall with real loss (20 % of the server's packets to the
/// client dropped, nftables, on the traced port: behind nginx, nginx's
/// listener, so the demo's upstream connection is untouched) on every
/// stack of the matrix. The SLO is set to 100 ms: a clean request takes
/// about 21 ms (28 behind nginx), and a lost first token waits for a
/// retransmit (200 ms by timeout; tens of ms by a tail loss probe, which
/// `network` names from half the SLO). curl only: its TTFT starts once connected,
/// so a lost SYN-ACK (before any request exists) is not counted; and a
/// connection per request, so the stacks that close after every response
/// (gunicorn's sync workers) and those that leave the close to the client
/// are both covered.
#[test]
fn network_loss_on_real_stacks() -> Result<()> {
    let Some(_g) = root_test("network_loss_on_real_stacks") else {
        return Ok(());
    };
    let _beside = ALONE.read().unwrap_or_else(|e| e.into_inner());
    let cudart = fixtures::existing_fixture(fixtures::STUB_CUDART)?;
    let until = UntilSlow {
        least: LOSS_LEAST_SLOW,
        over_s: 0.1,
        max_requests: LOSS_MAX_REQUESTS,
    };
    let load = Load {
        clients: "curl",
        requests: LOSS_BATCH,
        loss: Some(20),
        loss_spares_handshake: false,
        tokens: TOKENS,
        loss_pulses: false,
        tracer: &["--slo-ms", "100"],
        until_slow: Some(until),
        in_root_cgroup: false,
    };
    let until = load.until_slow.as_ref().context("until_slow")?;
    eprintln!("| stack | recall | false positives / clean | with retransmits | time |");
    eprintln!("| --- | --- | --- | --- | --- |");
    let mut failed = Vec::new();
    for stack in chosen_stacks() {
        let started = Instant::now();
        let Some(run) = traced_run(stack, &cudart, &load)? else {
            continue;
        };
        let (mut faulty, mut recalled, mut clean, mut false_pos, mut retrans) = (0, 0, 0, 0, 0);
        for c in &run.clients {
            let t = run
                .traced
                .get(&(u64::from(c.client_port), c.req_on_conn))
                .with_context(|| format!("{stack}: {c:?} not traced"))?;
            let classes: Vec<&str> = t["causes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|k| k["class"].as_str())
                .collect();
            retrans += usize::from(t["tcp_retransmits"].as_u64().unwrap_or(0) > 0);
            if until.is_slow(c) {
                faulty += 1;
                recalled += usize::from(classes.contains(&"network"));
                if !classes.contains(&"network") {
                    eprintln!("{stack}: slow request not named network: client {c:?}, traced {t}");
                    // Other connections on the same socket (a reused address).
                    for o in run
                        .traced
                        .values()
                        .filter(|o| o["conn"] == t["conn"] && *o != t)
                    {
                        eprintln!("  same socket: {o}");
                    }
                }
            } else {
                clean += 1;
                if !classes.is_empty() {
                    false_pos += 1;
                    eprintln!("{stack}: clean request blamed: client {c:?}, traced {t}");
                }
            }
        }
        eprintln!(
            "| {stack} | {recalled}/{faulty} | {false_pos}/{clean} | {retrans}/{} | {:.0} s |",
            run.clients.len(),
            started.elapsed().as_secs_f64()
        );
        // No clean request blamed, and at least the stack's share of the
        // slow ones named network.
        if faulty == 0 || (recalled as f64) < min_recall(stack) * faulty as f64 || false_pos > 0 {
            eprintln!("{stack}: the tracer's last lines:\n{}", run.tracer_tail);
            failed.push(stack);
        }
    }
    assert!(failed.is_empty(), "network recall too low on {failed:?}");
    Ok(())
}

/// Loss mid-stream on every stack (issue 31, item 5): httpx streams of
/// [`MIDSTREAM_TOKENS`] tokens (about 0.6 s at the stub's 5 ms a decode
/// step) one after another while the server's packets are dropped in
/// pulses of 300 ms every 1.5 s ([`LossPulses`]). A request is injected when
/// a pulse began after its first token's send and before its last send
/// (the traced times), clean when no pulse overlapped it from its arrival
/// to 100 ms after its last send; others (a pulse over its first token,
/// or just after its end) are not scored.
/// Recalled: a stall over the pulse named `network`. Asserted over all
/// stacks together: recall ≥ 95 %, ≤ 2 % of clean requests with a stall
/// seen at the delivery or named `network` (a send stall of a busy CPU is
/// not this test's: it runs beside the other stacks tests; those are
/// printed), every stack with a request injected. 8 requests a stack
/// (12 until 2026-12-06: 54 of 54 recalled, 6 injected a stack, ~20 s a
/// stack) give about 4 injected a stack in ~13 s.
const MIDSTREAM_TOKENS: u64 = 120;
const MIDSTREAM_REQUESTS: usize = 8;

#[test]
fn midstream_loss_on_real_stacks() -> Result<()> {
    let Some(_g) = root_test("midstream_loss_on_real_stacks") else {
        return Ok(());
    };
    let _beside = ALONE.read().unwrap_or_else(|e| e.into_inner());
    let cudart = fixtures::existing_fixture(fixtures::STUB_CUDART)?;
    let load = Load {
        clients: "httpx",
        requests: MIDSTREAM_REQUESTS,
        loss: None,
        loss_spares_handshake: false,
        tokens: MIDSTREAM_TOKENS,
        loss_pulses: true,
        tracer: &[],
        until_slow: None,
        in_root_cgroup: false,
    };
    eprintln!(
        "| stack | recalled / injected | seen at | clean with a stall on the wire / any stall / clean | not scored | time |"
    );
    eprintln!("| --- | --- | --- | --- | --- | --- |");
    let (mut all_injected, mut all_recalled, mut all_clean, mut all_fp) = (0, 0, 0, 0);
    let mut none_injected = Vec::new();
    for stack in chosen_stacks() {
        let started = Instant::now();
        let Some(run) = traced_run(stack, &cudart, &load)? else {
            continue;
        };
        let (mut injected, mut recalled, mut clean, mut fp, mut skipped) = (0, 0, 0, 0, 0);
        let mut stalled = 0;
        let mut seen_at: HashMap<String, usize> = HashMap::new();
        for t in run.traced.values() {
            let at = |k: &str| t[k].as_u64();
            let (Some(arrive), Some(first), Some(done)) =
                (at("t_arrive_ns"), at("t_first_token_ns"), at("t_done_ns"))
            else {
                skipped += 1;
                continue;
            };
            let windows = t["stalls"]["windows"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let pulse = run
                .pulses
                .iter()
                .find(|(from, _)| *from > first && *from < done);
            if let Some(&(from, to)) = pulse {
                injected += 1;
                let over: Vec<&Value> = windows
                    .iter()
                    .filter(|w| {
                        w["t_start_ns"].as_u64().is_some_and(|a| a < to)
                            && w["t_end_ns"].as_u64().is_some_and(|b| b > from)
                    })
                    .collect();
                for w in &over {
                    let side = w["seen_at"].as_str().unwrap_or("send").to_string();
                    *seen_at.entry(side).or_default() += 1;
                }
                let hit = over.iter().any(|w| {
                    w["causes"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| c["class"] == "network"))
                });
                recalled += usize::from(hit);
                if !hit {
                    eprintln!("{stack}: pulse [{from}, {to}] missed: {t}");
                }
                continue;
            }
            // A pulse over before the request arrived held nothing of it
            // (its client had the whole previous response); one that began
            // within 100 ms after its last send may still hold its tail
            // (its ACK, delayed by the client up to 40 ms).
            let near = run
                .pulses
                .iter()
                .any(|&(from, to)| to > arrive && from < done.saturating_add(100_000_000));
            if near {
                skipped += 1;
                continue;
            }
            clean += 1;
            if !windows.is_empty() {
                let wire = windows.iter().any(|w| {
                    w["seen_at"] == "delivery"
                        || w["causes"]
                            .as_array()
                            .is_some_and(|c| c.iter().any(|c| c["class"] == "network"))
                });
                fp += usize::from(wire);
                stalled += 1;
                eprintln!("{stack}: clean request stalled: {t}");
            }
        }
        eprintln!(
            "| {stack} | {recalled}/{injected} | {seen_at:?} | {fp} / {stalled} / {clean} | {skipped} | {:.0} s |",
            started.elapsed().as_secs_f64()
        );
        if injected == 0 {
            none_injected.push(stack);
        }
        all_injected += injected;
        all_recalled += recalled;
        all_clean += clean;
        all_fp += fp;
    }
    eprintln!(
        "all: {all_recalled}/{all_injected} recalled, {all_fp}/{all_clean} clean requests with a stall on the wire"
    );
    // Over all stacks: a handful injected per stack, too few for a bound each.
    ensure!(
        none_injected.is_empty(),
        "no loss mid-stream on {none_injected:?}"
    );
    ensure!(
        all_recalled as f64 >= 0.95 * all_injected as f64,
        "mid-stream loss named network in {all_recalled} of {all_injected} < 95 %"
    );
    ensure!(
        all_fp as f64 <= 0.02 * all_clean as f64,
        "clean requests with a stall on the wire: {all_fp} of {all_clean} > 2 %"
    );
    Ok(())
}

/// How late an ACK taken as the client's of its first token may be after
/// the client's own stamp of reading it (issue 34).
const ACK_AFTER_READ_TOLERANCE_MS: f64 = 5.0;
/// The objective of [`estimate_under_loss_on_a_closing_stack`]: the
/// tracer's default SLO.
const OBJECTIVE_S: f64 = 0.350;
/// Requests per hook in [`estimate_under_loss_on_a_closing_stack`]: 60
/// until 2026-12-07 (58-59 of 60 retransmitted, each judged on its own);
/// 30 take the test, which runs alone while a harness thread waits, 91 s
/// (CI took ~57 min against the ~45 asked).
const ESTIMATE_UNDER_LOSS_REQUESTS: usize = 30;

/// The client TTFT estimate under loss on a stack that closes after every
/// response (gunicorn's sync workers), against the client's own stamp of its
/// first content (httpx, CLOCK_MONOTONIC): 35 % of the server's packets
/// after its SYN-ACK dropped, so first tokens and the responses' tails are retransmitted after
/// the server's close. On the default segment hook (the server's cgroup) the
/// ACK the tracer takes for the first token's is never more than
/// [`ACK_AFTER_READ_TOLERANCE_MS`] after the client read it. On the
/// host-wide hook (a server in the root cgroup), whose `tcp_probe` sees no
/// ACK after the close, a first token acknowledged only by the close has an
/// upper bound; it may be late, never early. On both, no request the client
/// had within the objective is named `network` (issue 34: before, ACKs
/// after the close went unseen on both hooks, the state change that says
/// everything was acknowledged stood for them, one or two retransmission
/// timeouts late, and requests read in time were named `network`).
#[test]
fn estimate_under_loss_on_a_closing_stack() -> Result<()> {
    let Some(_g) = root_test("estimate_under_loss_on_a_closing_stack") else {
        return Ok(());
    };
    let _alone = ALONE.write().unwrap_or_else(|e| e.into_inner());
    let cudart = fixtures::existing_fixture(fixtures::STUB_CUDART)?;
    for in_root_cgroup in [false, true] {
        let load = Load {
            clients: "httpx",
            requests: ESTIMATE_UNDER_LOSS_REQUESTS,
            loss: Some(35),
            loss_spares_handshake: true,
            tokens: TOKENS,
            loss_pulses: false,
            tracer: &[],
            until_slow: None,
            in_root_cgroup,
        };
        let Some(run) = traced_run("gunicorn-sync", &cudart, &load)? else {
            return Ok(());
        };
        judge_estimates_under_loss(&run, in_root_cgroup)?;
    }
    Ok(())
}

/// See [`estimate_under_loss_on_a_closing_stack`].
fn judge_estimates_under_loss(run: &Run, host_wide: bool) -> Result<()> {
    let hook = if host_wide { "host-wide" } else { "cgroup" };
    let mut late_by = Vec::new();
    let (mut unacked, mut retransmitted, mut by_close) = (0, 0, 0);
    let mut problems = Vec::new();
    for c in &run.clients {
        let t = run
            .traced
            .get(&(u64::from(c.client_port), c.req_on_conn))
            .with_context(|| format!("{hook}: {c:?} not traced"))?;
        let read = c.t_first_token.context("httpx stamps its first content")?;
        let in_time = c.ttft_s.is_some_and(|s| s <= OBJECTIVE_S);
        let network = t["causes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|k| k["class"] == "network");
        if in_time && network {
            problems.push(format!(
                "read within the objective ({:?} s), named network: {t}",
                c.ttft_s
            ));
        }
        retransmitted += usize::from(t["tcp_retransmits"].as_u64().unwrap_or(0) > 0);
        let Some(acked) = t["t_first_token_acked_ns"].as_u64() else {
            unacked += 1;
            continue;
        };
        let late = (acked as f64 - read as f64) / 1e6;
        let bound = t["notes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n == "first_token_acked_by_close");
        if bound && host_wide {
            by_close += 1;
            continue;
        }
        late_by.push(late);
        if late > ACK_AFTER_READ_TOLERANCE_MS {
            problems.push(format!(
                "first token's ACK {late:.3} ms after the client read it: {t}"
            ));
        }
    }
    ensure!(!late_by.is_empty(), "{hook}: no request had an estimate");
    let largest = late_by.iter().copied().fold(f64::MIN, f64::max);
    eprintln!(
        "gunicorn-sync, {hook} segments, 35 % loss from the server: {} requests, {} with an \
         exact ACK, {by_close} bounded by the close, {unacked} unacknowledged, {retransmitted} \
         retransmitted; ACK − client's read P50 {:.3} / P99 {:.3} ms, largest {largest:.3} ms",
        run.clients.len(),
        late_by.len(),
        p(&late_by, 0.5),
        p(&late_by, 0.99),
    );
    // Loss must have been there to judge: at 35 % most connections lose a
    // segment.
    ensure!(
        retransmitted * 4 >= run.clients.len(),
        "{hook}: only {retransmitted} of {} requests retransmitted",
        run.clients.len()
    );
    ensure!(problems.is_empty(), "{hook}:\n{}", problems.join("\n"));
    Ok(())
}
