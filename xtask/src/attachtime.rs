//! How long `ttft-trace attach` takes to start tracing a process that maps
//! the real `libcudart.so.12` (the wheel's, unpacked by `cargo xtask
//! setup`), and to let go of it, with the parts the tracer reports:
//! reading the kernel's layouts (tracefs, BTF), loading and verifying the
//! programs, attaching the tracepoints, creating the uprobes. Detaching is
//! timed twice: until the tracer has exited (what a user waits for), and
//! until its `ttft-detach` child, which holds the uprobes while the kernel
//! removes them (about 0.1 s each), is gone.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    bounds::{self, Verdicts},
    demo::signal,
    setup::real_cudart,
};

/// The number after `key` in `line` (`"in 12.5 ms"` -> 12.5).
fn number_after(line: &str, key: &str) -> Option<f64> {
    let rest = line.split(key).nth(1)?;
    let digits: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    digits.parse().ok()
}

/// A child killed when dropped: an error part-way leaves no process behind.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until no `ttft-detach` process is left from an earlier run: the
/// kernel removes a uprobe under the mutex that reading tracefs takes too,
/// so a detach in progress holds up the next tracer's start by seconds.
pub fn wait_for_detaches() -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let busy = std::fs::read_dir("/proc")?.flatten().any(|e| {
            std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == "ttft-detach")
        });
        if !busy {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("a ttft-detach process is still there after 120 s");
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// One attach and detach; the figures in ms.
fn once(root: &std::path::Path) -> Result<Value> {
    wait_for_detaches()?;
    let cudart = real_cudart();
    if !cudart.is_file() {
        bail!("{} is missing: run cargo xtask setup", cudart.display());
    }
    let lib_dir = cudart.parent().context("cudart dir")?;
    let fixtures = root.join("target/fixtures");
    let workload = Command::new(fixtures.join("workload_real"))
        .args([
            "--ignore-errors",
            "--episodes",
            "100000000",
            "--gap-us",
            "10000",
        ])
        .env(
            "LD_LIBRARY_PATH",
            format!("{}:{}", lib_dir.display(), fixtures.display()),
        )
        .stdout(Stdio::null())
        .spawn()
        .context("workload_real")?;
    let workload = Killed(workload);
    // Its libraries mapped.
    thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let tracer = Command::new(root.join("target/release/ttft-trace"))
        .args(["attach", "--pid", &workload.0.id().to_string()])
        .args(["--no-listen", "--no-nvml", "--interval", "3600"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut tracer = Killed(tracer);
    let stderr = tracer.0.stderr.take().context("tracer stderr")?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send((started.elapsed(), line)).is_err() {
                break;
            }
        }
    });
    let (mut loaded, mut uprobes, mut attached_at) = (None, None, None);
    while attached_at.is_none() {
        let (at, line) = rx
            .recv_timeout(Duration::from_secs(30))
            .context("the tracer did not attach within 30 s")?;
        if line.contains("probes loaded in") {
            loaded = Some(line);
        } else if line.contains("attached") && line.contains("libcudart") {
            uprobes = number_after(&line, ") in ");
            attached_at = Some(at);
        }
    }
    let loaded = loaded.context("no 'probes loaded' line")?;
    let stop = Instant::now();
    signal(tracer.0.id(), "INT")?;
    tracer.0.wait()?;
    let exit_ms = stop.elapsed().as_secs_f64() * 1e3;
    let mut held = None;
    while let Ok((_, line)) = rx.recv_timeout(Duration::from_millis(500)) {
        if line.contains("in the background (process ") {
            held = Some((
                number_after(&line, "detaching ").unwrap_or(0.0),
                number_after(&line, "(process ").unwrap_or(0.0) as u32,
            ));
        }
    }
    let (events, child) = held.context("no background detach logged")?;
    while std::path::Path::new(&format!("/proc/{child}")).exists() {
        if stop.elapsed() > Duration::from_secs(60) {
            bail!("ttft-detach {child} still there after 60 s");
        }
        thread::sleep(Duration::from_millis(10));
    }
    let kernel_ms = stop.elapsed().as_secs_f64() * 1e3;
    drop(workload);
    Ok(json!({
        "attach_ms": attached_at.unwrap_or_default().as_secs_f64() * 1e3,
        "load_ms": number_after(&loaded, "probes loaded in "),
        "layouts_ms": number_after(&loaded, "(tracefs, BTF) "),
        "verify_ms": number_after(&loaded, "verified "),
        "tracepoints_ms": number_after(&loaded, "tracepoint links "),
        "uprobes_ms": uprobes,
        "exit_ms": exit_ms,
        "perf_events": events,
        "kernel_detached_ms": kernel_ms,
    }))
}

/// `runs` attach/detach cycles, each once every earlier tracer's uprobes
/// are gone (see [`wait_for_detaches`]). Returns the runs, and the verdicts
/// of attach and the tracer's exit (medians) against [`bounds::ATTACH_MS`].
pub fn run(root: &std::path::Path, runs: usize) -> Result<(Value, Verdicts)> {
    let mut all = Vec::new();
    for _ in 0..runs {
        let r = once(root)?;
        println!(
            "attach: {:.0} ms to probes on libcudart.so.12 (load {:.0}: layouts {:.0}, verify {:.0}, \
             tracepoints {:.0}; uprobes {:.1}); detach: exit {:.0} ms, the kernel's removal of {} \
             perf events done {:.0} ms after the signal",
            r["attach_ms"].as_f64().unwrap_or(f64::NAN),
            r["load_ms"].as_f64().unwrap_or(f64::NAN),
            r["layouts_ms"].as_f64().unwrap_or(f64::NAN),
            r["verify_ms"].as_f64().unwrap_or(f64::NAN),
            r["tracepoints_ms"].as_f64().unwrap_or(f64::NAN),
            r["uprobes_ms"].as_f64().unwrap_or(f64::NAN),
            r["exit_ms"].as_f64().unwrap_or(f64::NAN),
            r["perf_events"],
            r["kernel_detached_ms"].as_f64().unwrap_or(f64::NAN),
        );
        all.push(r);
    }
    let median = |key: &str| {
        let mut v: Vec<f64> = all.iter().filter_map(|r| r[key].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let mut verdicts = Verdicts::default();
    for (key, what) in [("attach_ms", "attach"), ("exit_ms", "detach (exit)")] {
        let m = median(key);
        verdicts.judge(m, bounds::ATTACH_MS, |limit| {
            format!("{what}: {m:.0} ms (median; limit {limit:.0} ms)")
        });
    }
    Ok((json!({ "runs": all }), verdicts))
}
