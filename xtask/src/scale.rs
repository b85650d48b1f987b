//! The tracer at scale (`cargo xtask bench --only scale`, and part of the full
//! `cargo xtask bench`): `ttft-trace attach` on the load generator's server
//! (tests/loadgen/main.rs, loopback), whose engines stream SSE chunks to
//! every connection at one chunk per decode step, with the client holding
//! 1 000 and then 10 000 keep-alive connections that issue streamed requests
//! back to back, for a bounded time each (see [`FULL`]).
//!
//! Sampled every second: the tracer's RSS (`VmRSS`) and CPU time
//! (`utime + stime`), the generator's CPU time and the machine's. Over each
//! step's window (after a warm-up): the tracer's CPU as a share of one core,
//! its RSS (median and largest), the chunks the client received a second
//! (achieved, against the rate offered), the requests the client completed
//! against those the tracer reports with a first token. Memory per
//! connection is the difference of the median RSS of the first step and the
//! first with the most connections over the difference of their connections.
//!
//! Fails when the tracer's peak RSS (`VmHWM`) passes 64 MiB, when an event is
//! lost in the kernel, when a completed request is not traced (outcome `ok`
//! and a first token, exactly as many as the client completed), when a
//! bounded table drops an entry, or when the generator could not hold its
//! connections. A machine too small to offer the full rate is not a
//! failure of the tracer: the rate achieved is reported beside the one
//! offered, and the figures hold for that rate.

use std::{
    io::{BufRead, BufReader, Read as _},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    bounds::{self, Verdicts},
    demo::{free_addr, scrape, signal, start_tracer},
    process::{cmd, output},
};

/// One step of load.
pub struct Step {
    pub connections: u64,
    /// One chunk every this many decode steps of the server.
    pub steps_per_chunk: u64,
}

pub struct Plan {
    /// The steps, connections in increasing order.
    pub steps: &'static [Step],
    /// Seconds of load per step.
    pub seconds: f64,
    /// Seconds over which the connections' first requests are spread.
    pub stagger_s: f64,
    /// Seconds at the start of each step's load left out of its figures
    /// (past the stagger).
    pub warmup_s: f64,
    /// The server's engines, whose steps are spread over the chunk period.
    pub engines: u64,
    /// Chunks per streamed response.
    pub max_tokens: u64,
    /// Period of the server's decode step, hence of each stream's chunks.
    pub chunk_ms: u64,
}

/// 1 000 connections at 20 chunks a second, 10 000 at 5 a second (50 000
/// chunks a second: what a 2-core machine offers in full with the tracer
/// beside it), then 10 000 at 20 a second: on 2 cores the generator takes
/// both and offers about half that rate; the tracer is checked at the rate
/// achieved. 30 s each; responses of 100 chunks, so each connection issues
/// requests back to back through the window.
pub const FULL: Plan = Plan {
    steps: &[
        Step {
            connections: 1_000,
            steps_per_chunk: 1,
        },
        Step {
            connections: 10_000,
            steps_per_chunk: 4,
        },
        Step {
            connections: 10_000,
            steps_per_chunk: 1,
        },
    ],
    seconds: 30.0,
    stagger_s: 5.0,
    warmup_s: 6.0,
    engines: 8,
    max_tokens: 100,
    chunk_ms: 50,
};

/// `--quick`: 300 connections at 20 chunks a second, then 3 000 at 5 (the
/// memory per connection between them), 6 s each after a short stagger:
/// what CI can afford in under a minute.
pub const QUICK: Plan = Plan {
    steps: &[
        Step {
            connections: 300,
            steps_per_chunk: 1,
        },
        Step {
            connections: 3_000,
            steps_per_chunk: 4,
        },
    ],
    seconds: 6.0,
    stagger_s: 2.0,
    warmup_s: 3.0,
    engines: 8,
    max_tokens: 100,
    chunk_ms: 50,
};

/// A child killed when dropped: an error part-way leaves no process behind.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CPU time of a process (user + system), in clock ticks.
pub fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces: state is the
    // 3rd field of stat, utime and stime the 14th and 15th.
    let rest = stat.rsplit_once(')').context("/proc/PID/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> Result<u64> {
        Ok(fields.get(i - 3).context("short /proc/PID/stat")?.parse()?)
    };
    Ok(field(14)? + field(15)?)
}

/// A `Vm*` line of /proc/PID/status, in KiB.
pub fn status_kib(pid: u32, key: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {key} for pid {pid}"))
}

/// The machine's busy and total CPU time (all CPUs), in clock ticks.
fn machine_ticks() -> Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    // idle and iowait.
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Ok((total - idle, total))
}

/// One reading, every second of a step.
#[derive(Clone, Copy)]
struct Sample {
    t: Instant,
    rss_kib: u64,
    tracer: u64,
    server: u64,
    client: u64,
    machine_busy: u64,
    machine_total: u64,
}

fn sample(tracer: u32, server: u32, client: u32) -> Result<Sample> {
    let (machine_busy, machine_total) = machine_ticks()?;
    Ok(Sample {
        t: Instant::now(),
        rss_kib: status_kib(tracer, "VmRSS:")?,
        tracer: cpu_ticks(tracer)?,
        server: cpu_ticks(server)?,
        // The client may have just exited: its time is then not counted.
        client: cpu_ticks(client).unwrap_or(0),
        machine_busy,
        machine_total,
    })
}

/// Sum of the series of `name` (`name{...} v` or `name v`) whose labels
/// contain `labels`.
fn metric(body: &str, name: &str, labels: &str) -> u64 {
    body.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
                && l.contains(labels)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The tracer's counters that the benches check (this one and
/// [`crate::h2scale`]).
#[derive(Clone, Copy, Default)]
pub struct Counters {
    pub requests_ok: u64,
    pub requests_all: u64,
    pub first_tokens: u64,
    pub events_lost: u64,
    pub evictions: u64,
    /// HTTP/2 frames not reported, and walks that lost their place.
    pub h2_frames_dropped: u64,
    pub h2_walks_lost: u64,
}

pub fn counters(metrics: SocketAddr) -> Result<Counters> {
    let body = scrape(metrics).context("scraping the tracer's /metrics")?;
    Ok(Counters {
        requests_ok: metric(&body, "ttft_trace_requests_total", "outcome=\"ok\""),
        requests_all: metric(&body, "ttft_trace_requests_total", ""),
        first_tokens: metric(&body, "ttft_trace_time_to_first_token_seconds_count", ""),
        events_lost: metric(&body, "ttft_trace_events_lost_total", ""),
        evictions: metric(&body, "ttft_trace_table_evictions_total", ""),
        h2_frames_dropped: metric(&body, "ttft_trace_http2_frames_dropped_total", ""),
        h2_walks_lost: metric(&body, "ttft_trace_http2_walk_lost_total", ""),
    })
}

fn read_json_line(out: &mut BufReader<ChildStdout>, what: &str) -> Result<Value> {
    let mut line = String::new();
    out.read_line(&mut line)?;
    serde_json::from_str(&line).with_context(|| format!("{what}: {line:?}"))
}

/// `ticks` of CPU over `secs`, as a percentage of one core.
fn percent(ticks: u64, secs: f64, hz: f64) -> f64 {
    ticks as f64 / hz / secs * 100.0
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

struct Setup<'a> {
    root: &'a Path,
    loadgen: PathBuf,
    server: &'a Child,
    addr: &'a str,
    tracer: u32,
    metrics: SocketAddr,
    hz: f64,
}

/// One step: `connections` held for the plan's time; returns its figures
/// and what failed.
fn step(s: &Setup, plan: &Plan, load: &Step) -> Result<(Value, Verdicts)> {
    let connections = load.connections;
    let before = counters(s.metrics)?;
    let mut client = Killed(
        Command::new(&s.loadgen)
            .args(["load", "--addr", s.addr])
            .args(["--connections", &connections.to_string()])
            .args(["--seconds", &plan.seconds.to_string()])
            .args(["--max-tokens", &plan.max_tokens.to_string()])
            .args(["--steps-per-chunk", &load.steps_per_chunk.to_string()])
            .args(["--stagger-s", &plan.stagger_s.to_string()])
            .current_dir(s.root)
            .stdout(Stdio::piped())
            .spawn()
            .context("starting loadgen load")?,
    );
    let mut out = BufReader::new(client.0.stdout.take().context("loadgen stdout")?);
    let connected = read_json_line(&mut out, "loadgen's connect line")?;
    let t0 = Instant::now();
    let (from, to) = (
        t0 + Duration::from_secs_f64(plan.warmup_s),
        t0 + Duration::from_secs_f64(plan.seconds),
    );
    let (server, client_pid) = (s.server.id(), client.0.id());
    let mut samples = Vec::new();
    while client.0.try_wait()?.is_none() {
        samples.push(sample(s.tracer, server, client_pid)?);
        thread::sleep(Duration::from_secs(1));
    }
    let mut rest = String::new();
    out.read_to_string(&mut rest)?;
    let done: Value = serde_json::from_str(rest.lines().last().unwrap_or(""))
        .with_context(|| format!("loadgen's summary: {rest:?}"))?;
    let completed = done["requests"].as_u64().context("loadgen: requests")?;
    // A request's line waits for the client's ACK of its first token (up
    // to 5 s): poll until the tracer has them all, or stops counting.
    let mut after = counters(s.metrics)?;
    let settle = Instant::now() + Duration::from_secs(15);
    while after.requests_all.saturating_sub(before.requests_all) < completed
        && Instant::now() < settle
    {
        thread::sleep(Duration::from_millis(500));
        after = counters(s.metrics)?;
    }
    let window: Vec<Sample> = samples
        .iter()
        .copied()
        .filter(|x| x.t >= from && x.t <= to)
        .collect();
    let (Some(first), Some(last)) = (window.first(), window.last()) else {
        bail!("no sample in the window of {connections} connections");
    };
    let secs = (last.t - first.t).as_secs_f64();
    if secs < 1.0 {
        bail!("the window of {connections} connections is shorter than a second");
    }
    let rss: Vec<u64> = window.iter().map(|x| x.rss_kib).collect();
    let rss_max = rss.iter().copied().max().unwrap_or(0);
    let rss_median = median(rss);
    let cpu = percent(last.tracer - first.tracer, secs, s.hz);
    let server_cpu = percent(last.server - first.server, secs, s.hz);
    let client_cpu = percent(last.client.saturating_sub(first.client), secs, s.hz);
    let machine = (last.machine_busy - first.machine_busy) as f64
        / (last.machine_total - first.machine_total).max(1) as f64
        * 100.0;
    let held = connected["connected"].as_u64().unwrap_or(0);
    let offered = held as f64 * 1000.0 / (plan.chunk_ms * load.steps_per_chunk) as f64;
    let achieved = done["chunks_per_s"].as_f64().unwrap_or(0.0);
    // The tracer's CPU per chunk streamed (one send of the server each).
    let us_per_chunk = cpu / 100.0 / achieved * 1e6;
    let traced_ok = after.requests_ok.saturating_sub(before.requests_ok);
    let traced_all = after.requests_all.saturating_sub(before.requests_all);
    let first_tokens = after.first_tokens.saturating_sub(before.first_tokens);
    let lost = after.events_lost.saturating_sub(before.events_lost);
    let evicted = after.evictions.saturating_sub(before.evictions);
    println!(
        "scale: {held} connections, {achieved:.0} chunks/s received of {offered:.0} offered \
         ({:.0} %); {completed} requests completed, {traced_ok} traced ok, {first_tokens} with a \
         first token; tracer RSS {rss_median} KiB (max {rss_max}), CPU {cpu:.1} % of a core \
         ({us_per_chunk:.2} µs a chunk); \
         generator {server_cpu:.0} % + {client_cpu:.0} %, machine {machine:.0} % busy; \
         {lost} events lost",
        achieved / offered * 100.0
    );
    let mut verdicts = Verdicts::default();
    let failed_connects = done["failed_connects"].as_u64().unwrap_or(0);
    let connection_errors = done["connection_errors"].as_u64().unwrap_or(0);
    verdicts.require(
        held == connections && failed_connects + connection_errors == 0,
        || {
            format!(
                "scale: the generator held {held} of {connections} connections \
                 ({failed_connects} failed connects, {connection_errors} connection errors)"
            )
        },
    );
    verdicts.require(
        traced_ok == completed && first_tokens == completed && traced_all == completed,
        || {
            format!(
                "scale at {connections}: {completed} requests completed by the client, the \
                 tracer reports {traced_all} ({traced_ok} ok, {first_tokens} with a first token)"
            )
        },
    );
    verdicts.require(lost == 0, || {
        format!("scale at {connections}: {lost} events lost")
    });
    verdicts.require(evicted == 0, || {
        format!("scale at {connections}: {evicted} entries evicted from bounded tables")
    });
    let result = json!({
        "connections": held, "seconds": plan.seconds, "window_s": secs,
        "chunks_per_s_offered": offered, "chunks_per_s_achieved": achieved,
        "requests_completed": completed, "requests_traced": traced_all,
        "requests_traced_ok": traced_ok, "requests_with_first_token": first_tokens,
        "events_lost": lost, "table_evictions": evicted,
        "tracer_rss_kib_median": rss_median, "tracer_rss_kib_max": rss_max,
        "tracer_cpu_percent_of_core": cpu, "tracer_cpu_us_per_chunk": us_per_chunk,
        "server_cpu_percent_of_core": server_cpu, "client_cpu_percent_of_core": client_cpu,
        "machine_busy_percent": machine,
        "loadgen": done, "connect": connected,
    });
    Ok((result, verdicts))
}

/// Builds `bins` of the tests crate in release (a debug load generator
/// would not offer the rate); returns the clock ticks a second of
/// `/proc/PID/stat`.
pub fn release_bins(root: &Path, bins: &[&str]) -> Result<f64> {
    let mut build = Command::new("cargo");
    build
        .current_dir(root)
        .args(["build", "--release", "-p", "ttft-trace-tests"]);
    for bin in bins {
        build.args(["--bin", bin]);
    }
    cmd(&mut build)?;
    output(Command::new("getconf").arg("CLK_TCK"))?
        .trim()
        .parse()
        .context("getconf CLK_TCK")
}

/// `ttft-trace attach` (release) on `pid`, serving /metrics on `metrics`,
/// with `extra` arguments; returns once it printed `ready`.
pub fn attach_serving(
    root: &Path,
    pid: u32,
    metrics: SocketAddr,
    extra: &[String],
    ready: &str,
) -> Result<Killed> {
    let mut args: Vec<String> = vec![
        "--pid".into(),
        pid.to_string(),
        "--listen".into(),
        metrics.to_string(),
        "--interval".into(),
        "3600".into(),
        "--no-nvml".into(),
    ];
    args.extend_from_slice(extra);
    Ok(Killed(start_tracer(root, "attach", &args, ready)?))
}

/// Runs the plan; returns the results and their verdicts.
pub fn run(root: &Path, plan: &Plan) -> Result<(Value, Verdicts)> {
    let hz = release_bins(root, &["loadgen"])?;
    let loadgen = root.join("target/release/loadgen");
    let mut server = Killed(
        Command::new(&loadgen)
            .arg("serve")
            .arg("--cudart")
            .arg(root.join("target/fixtures/libcudart.so.12"))
            .args(["--chunk-ms", &plan.chunk_ms.to_string()])
            .args(["--engines", &plan.engines.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .context("starting loadgen serve")?,
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().context("server stdout")?).read_line(&mut line)?;
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .with_context(|| format!("loadgen serve did not say where it listens: {line:?}"))?
        .to_string();
    let metrics = free_addr()?;
    let jsonl = root.join("target/bench/scale.jsonl");
    std::fs::create_dir_all(root.join("target/bench"))?;
    let _ = std::fs::remove_file(&jsonl);
    let tracer = attach_serving(
        root,
        server.0.id(),
        metrics,
        &["--jsonl".into(), jsonl.display().to_string()],
        "attached",
    )?;
    let tracer_pid = tracer.0.id();
    thread::sleep(Duration::from_secs(2));
    let idle_kib = status_kib(tracer_pid, "VmRSS:")?;
    // Starting (BTF, the libraries' symbol tables) has its own peak.
    let idle_hwm_kib = status_kib(tracer_pid, "VmHWM:")?;
    println!(
        "scale: tracer RSS {idle_kib} KiB attached, no connection (peak so far {idle_hwm_kib} KiB)"
    );
    let setup = Setup {
        root,
        loadgen,
        server: &server.0,
        addr: &addr,
        tracer: tracer_pid,
        metrics,
        hz,
    };
    let mut steps = Vec::new();
    let mut verdicts = Verdicts::default();
    for load in plan.steps {
        let (result, v) = step(&setup, plan, load)?;
        verdicts.extend(v);
        steps.push(result);
    }
    let hwm_kib = status_kib(tracer_pid, "VmHWM:")?;
    // The tracer ends when its target does, with the totals line.
    signal(server.0.id(), "TERM")?;
    let _ = server.0.wait();
    let mut tracer = tracer;
    let _ = tracer.0.wait();
    let text = std::fs::read_to_string(&jsonl)?;
    let totals: Value = text
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["type"] == "totals")
        .context("no totals line in the tracer's JSONL")?;
    // A request line a connection: the file is large and said all it had
    // to in the totals.
    let _ = std::fs::remove_file(&jsonl);
    // Over the whole run, between the steps too (each step's own losses
    // are checked above).
    let events_lost = totals["events_lost"].as_u64().unwrap_or(0);
    let refused: u64 = totals["request_stats"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w["stats"]["connections_refused"].as_u64())
        .sum();
    verdicts.judge(hwm_kib as f64, bounds::SCALE_RSS_KIB, |limit| {
        format!("scale: the tracer's peak RSS is {hwm_kib} KiB (limit {limit:.0} KiB)")
    });
    verdicts.require(events_lost == 0, || {
        format!("scale: {events_lost} events lost over the whole run")
    });
    verdicts.require(refused == 0, || {
        format!("scale: {refused} connections refused by the correlator")
    });
    // Memory per connection: between the first step and the first with the
    // most connections (the same chunk rate per connection where the plan
    // allows).
    let figure = |v: Option<&Value>, key: &str| v.and_then(|v| v[key].as_u64()).unwrap_or(0);
    let most = steps.iter().map(|v| figure(Some(v), "connections")).max();
    let lo = steps.first();
    let hi = steps
        .iter()
        .find(|v| Some(figure(Some(v), "connections")) == most);
    let (conns_lo, conns_hi) = (figure(lo, "connections"), figure(hi, "connections"));
    let (rss_lo, rss_hi) = (
        figure(lo, "tracer_rss_kib_median"),
        figure(hi, "tracer_rss_kib_median"),
    );
    let per_conn_bytes = if conns_hi > conns_lo {
        (rss_hi as f64 - rss_lo as f64) * 1024.0 / (conns_hi - conns_lo) as f64
    } else {
        f64::NAN
    };
    println!(
        "scale: tracer peak RSS {hwm_kib} KiB; {per_conn_bytes:.0} bytes per connection \
         ({conns_lo} -> {conns_hi} connections); {events_lost} events lost in all"
    );
    verdicts.judge(per_conn_bytes, bounds::BYTES_PER_CONNECTION, |limit| {
        format!(
            "scale: {per_conn_bytes:.0} bytes per followed connection ({conns_lo} -> {conns_hi} \
             connections; limit {limit:.0})"
        )
    });
    let result = json!({
        "plan": {"seconds": plan.seconds, "stagger_s": plan.stagger_s,
                 "warmup_s": plan.warmup_s, "engines": plan.engines,
                 "max_tokens": plan.max_tokens, "chunk_ms": plan.chunk_ms},
        "tracer_rss_kib_idle": idle_kib, "tracer_rss_kib_peak_idle": idle_hwm_kib,
        "tracer_rss_kib_peak": hwm_kib,
        "rss_guard_kib": bounds::SCALE_RSS_KIB.guard, "bytes_per_connection": per_conn_bytes,
        "guards_broken": verdicts.broken(),
        "events_lost": events_lost, "connections_refused": refused,
        "steps": steps, "totals": totals,
    });
    Ok((result, verdicts))
}
