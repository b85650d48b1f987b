//! `cargo xtask demo`: trace the bundled GPU-free workload (a program on the
//! stub CUDA runtime with an emulated device timeline) and show what a user
//! sees: the attach report, summary lines, the final summary and /metrics.

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

use crate::run::{cmd, repo_root};

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

/// Starts `ttft-trace attach` and returns once it reports its probes
/// attached; its stderr is echoed by a thread.
pub fn start_tracer(root: &Path, args: &[String]) -> Result<Child> {
    let bin = root.join("target/release/ttft-trace");
    let mut child = Command::new(&bin)
        .arg("attach")
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stderr = child.stderr.take().context("tracer stderr")?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if line.contains("attached") {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(30)).is_err() {
        let _ = child.kill();
        bail!("the tracer did not attach within 30 s");
    }
    // The runtime and the driver library report separately; let both land.
    thread::sleep(Duration::from_millis(200));
    Ok(child)
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
    let mut workload = Command::new(fixtures.join("workload"))
        .args([
            "--style",
            "stream",
            "--episodes",
            "300",
            "--launches",
            "8",
            "--kernel-us",
            "1000",
        ])
        .args([
            "--copy-bytes",
            "65536",
            "--h2d-bytes",
            "4096",
            "--gap-us",
            "4000",
            "--stop-before-work",
        ])
        .arg("--truth")
        .arg(out.join("truth.jsonl"))
        .spawn()
        .context("starting the demo workload (target/fixtures/workload)")?;
    let pid = workload.id();
    wait_stopped(pid)?;
    let addr = free_addr()?;
    println!("== tracing the demo workload (pid {pid}): 300 GPU episodes of 8 kernel launches ==");
    let mut tracer = start_tracer(
        &root,
        &[
            "--pid".into(),
            pid.to_string(),
            "--listen".into(),
            addr.to_string(),
            "--interval".into(),
            "1".into(),
            "--jsonl".into(),
            out.join("episodes.jsonl").display().to_string(),
        ],
    )?;
    signal(pid, "CONT")?;
    // Scrape while the workload runs: the tracer stops when its target exits.
    let mut last = None;
    while workload.try_wait()?.is_none() {
        if let Ok(body) = scrape(addr) {
            last = Some(body);
        }
        thread::sleep(Duration::from_millis(200));
    }
    let status = tracer.wait()?;
    if !status.success() {
        bail!("the tracer exited with {status}");
    }
    println!("\n== what http://{addr}/metrics served (last scrape before the workload exited) ==");
    let body = last.context("no successful scrape of /metrics")?;
    for line in body
        .lines()
        .filter(|l| l.starts_with("ttft_trace_") && !l.contains("_bucket{"))
    {
        println!("{line}");
    }
    println!(
        "\nPer-episode JSON lines: {}\nWorkload ground truth:  {}",
        out.join("episodes.jsonl").display(),
        out.join("truth.jsonl").display()
    );
    Ok(())
}
