//! `cargo xtask demo`: trace the bundled GPU-free workload (a program on the
//! stub CUDA runtime with an emulated device timeline) and show what a user
//! sees: the attach report, summary lines, the final summary and /metrics.
//! It needs what building needs (the only set-up it asks for: rust-src and
//! bpf-linker), gcc for the stub CUDA libraries and python3's standard
//! library for the demo server and load generator; none of the tests' tools.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::process::{cmd, repo_root};

/// Builds the daemon (release) and the fixtures.
pub fn build_all(root: &Path) -> Result<()> {
    cmd(Command::new("cargo")
        .current_dir(root)
        .args(["build", "--release", "-p", "ttft-trace"]))?;
    cmd(Command::new("cargo")
        .current_dir(root)
        .args(["build", "-p", "ttft-trace-tests"]))
}

/// A free loopback port, preferring the default 9464.
pub fn free_addr() -> Result<SocketAddr> {
    for port in [9464, 0] {
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            return Ok(l.local_addr()?);
        }
    }
    bail!("no free loopback port")
}

/// Polls /proc/PID/stat until the process is stopped (state T).
pub fn wait_stopped(pid: u32) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('T'))
        {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(5));
    }
    bail!("pid {pid} did not stop")
}

pub fn signal(pid: u32, sig: &str) -> Result<()> {
    cmd(Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]))
}

/// Interrupts `child` and waits for it to exit, sending `SIGINT` again each
/// second when `repeat` (bpftrace can miss one that comes as it starts its
/// event loop, and then waits for good), and `SIGKILL` after `limit`, which
/// is an error: a bench must not hang on a tool it runs.
pub fn interrupt(child: &mut Child, repeat: bool, limit: Duration) -> Result<()> {
    let started = Instant::now();
    let mut sent = started;
    signal(child.id(), "INT")?;
    loop {
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        if started.elapsed() >= limit {
            child.kill()?;
            child.wait()?;
            bail!("pid {} did not exit within {limit:?} of SIGINT", child.id());
        }
        if repeat && sent.elapsed() >= Duration::from_secs(1) {
            // Gone meanwhile: try_wait says so next round.
            let _ = signal(child.id(), "INT");
            sent = Instant::now();
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `ttft-trace <subcommand>` and returns once a line of its stderr
/// contains `ready` (its probes attached, its target found); its stderr is
/// echoed by a thread.
pub fn start_tracer(root: &Path, subcommand: &str, args: &[String], ready: &str) -> Result<Child> {
    let bin = root.join("target/release/ttft-trace");
    let ready = ready.to_string();
    let mut child = Command::new(&bin)
        .arg(subcommand)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stderr = child.stderr.take().context("tracer stderr")?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if line.contains(&ready) {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(30)).is_err() {
        let _ = child.kill();
        bail!("the tracer did not report {subcommand:?} ready within 30 s");
    }
    // The runtime and the driver library report separately; let both land.
    thread::sleep(Duration::from_millis(200));
    Ok(child)
}

/// Waits up to 10 s for `port` to accept on loopback.
pub fn wait_listening(port: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("the server does not listen on {port}");
        }
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Prints what /metrics at `addr` served (`body`), the histograms'
/// buckets left out.
pub fn print_metrics(addr: SocketAddr, body: &str) {
    println!("\n== what http://{addr}/metrics served (histogram buckets left out) ==");
    for line in body
        .lines()
        .filter(|l| l.starts_with("ttft_trace_") && !l.contains("_bucket{"))
    {
        println!("{line}");
    }
}

/// GET /metrics over plain HTTP/1.1.
pub fn scrape(addr: SocketAddr) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    let (_, body) = body.split_once("\r\n\r\n").context("no HTTP body")?;
    Ok(body.to_string())
}

pub fn demo() -> Result<()> {
    let root = repo_root()?;
    build_all(&root)?;
    let fixtures = root.join("target/fixtures");
    let out = root.join("target/demo");
    std::fs::create_dir_all(&out)?;
    // The tracer appends to its JSONL file (a restarted daemon adds to its
    // log): each demo starts a new one.
    let _ = std::fs::remove_file(out.join("trace.jsonl"));
    // The demo inference server: OpenAI-compatible SSE over HTTP/1.1, a CPU
    // tokenizer, a batching GPU worker on the stub CUDA runtime.
    let mut server = Command::new("python3")
        .arg(root.join("tests/demo/server.py"))
        .args([
            "--port",
            "0",
            "--output-tokens",
            "64",
            "--stall-ms",
            "400",
            "--cudart",
        ])
        .arg(fixtures.join("libcudart.so.12"))
        .arg("--truth")
        .arg(out.join("server-truth.jsonl"))
        .env("PYTHONUNBUFFERED", "1")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting tests/demo/server.py")?;
    let pid = server.id();
    let mut line = String::new();
    BufReader::new(server.stdout.take().context("server stdout")?).read_line(&mut line)?;
    let port = line
        .split("http://127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .context("the demo server did not say where it listens")?
        .to_string();
    let addr = free_addr()?;
    println!(
        "== ttft-trace daemon: finding the demo inference server (pid {pid}, port {port}) by itself =="
    );
    let tracer = start_tracer(
        &root,
        "daemon",
        &[
            // Only the demo: other CUDA processes on this host stay out.
            "--only-port".into(),
            port.clone(),
            "--listen".into(),
            addr.to_string(),
            "--interval".into(),
            "2".into(),
            "--jsonl".into(),
            out.join("trace.jsonl").display().to_string(),
        ],
        "following requests on port",
    );
    let result = tracer.and_then(|mut tracer| {
        println!(
            "== load: 16 streamed completions at concurrency 1, then 16 at 4 (tests/demo/loadgen.py); \
             a quarter of them ask the server for a 400 ms tokenizer stall =="
        );
        let load = cmd(Command::new("python3")
            .arg(root.join("tests/demo/loadgen.py"))
            .args(["--port", &port, "--concurrency", "1,4", "--requests", "16", "--output-tokens", "64"])
            .args(["--fault", "tokenizer_stall", "--fault-share", "0.25"])
            .arg("--out")
            .arg(out.join("client.jsonl")));
        thread::sleep(Duration::from_millis(500));
        let body = scrape(addr);
        signal(tracer.id(), "INT")?;
        tracer.wait()?;
        load?;
        print_metrics(addr, &body.context("scraping /metrics")?);
        Ok(())
    });
    signal(pid, "TERM")?;
    server.wait()?;
    result?;
    println!(
        "\nPer-request and per-episode JSON lines: {}\nThe client's own measurements:      {}\nThe server's ground truth:           {}",
        out.join("trace.jsonl").display(),
        out.join("client.jsonl").display(),
        out.join("server-truth.jsonl").display()
    );
    Ok(())
}
