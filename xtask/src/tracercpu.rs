//! The tracer's own CPU time by scheduler source (`cargo xtask bench`, also
//! `--only tracercpu`): what `--sched sampled` (no program on any context
//! switch; the traced threads' `/proc` counters read every 10 ms) costs
//! the daemon, against `--sched exact` (a program on every switch of the
//! host, and no sampling tick).
//!
//! Each round traces the stub workload (one thread, about 170 episodes/s)
//! with `attach`, once per source in turn, and reads the tracer's CPU
//! time from the kernel (`/proc/PID/task/*/schedstat`, nanoseconds) over a
//! window after its start-up. Medians over rounds. Beside them, the floor
//! of any 10 ms tick on this machine: a thread that only sleeps 10 ms in
//! a loop, its own CPU time per second (on a VM each wakeup costs tens of
//! microseconds of exits; on bare metal a few).

use std::{
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use crate::{
    demo::{interrupt, signal, start_tracer, wait_stopped},
    process::clock_ns,
};

/// The sources compared, with the flag value.
const SOURCES: &[&str] = &["sampled", "exact"];

pub struct Plan {
    pub rounds: usize,
    /// Seconds of each measured window (after two of start-up).
    pub secs: f64,
}

pub const FULL: Plan = Plan {
    rounds: 3,
    secs: 6.0,
};

pub const QUICK: Plan = Plan {
    rounds: 1,
    secs: 2.0,
};

/// CPU nanoseconds of every live thread of `pid`.
fn cpu_ns(pid: u32) -> Result<u64> {
    let mut sum = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
        // A thread that exits between the listing and the read is skipped.
        let Ok(line) = std::fs::read_to_string(entry.path().join("schedstat")) else {
            continue;
        };
        let first = line.split_whitespace().next().unwrap_or("0");
        sum += first.parse::<u64>().unwrap_or(0);
    }
    Ok(sum)
}

/// The tracer's CPU milliseconds per second with `--sched source`.
fn measure(root: &Path, source: &str, secs: f64) -> Result<f64> {
    let mut workload = Command::new(root.join("target/fixtures/workload"))
        .args([
            "--style",
            "sync",
            "--episodes",
            "1000000",
            "--gap-us",
            "5000",
        ])
        .arg("--stop-before-work")
        .stdout(std::process::Stdio::null())
        .spawn()
        .context("starting the workload")?;
    let pid = workload.id();
    wait_stopped(pid)?;
    let args: Vec<String> = [
        "--pid",
        &pid.to_string(),
        "--sched",
        source,
        "--no-listen",
        "--no-nvml",
        "--interval",
        "60",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracer = start_tracer(root, "attach", &args, "] attached ")?;
    signal(pid, "CONT")?;
    thread::sleep(Duration::from_secs(2));
    let (before, t0) = (cpu_ns(tracer.id())?, Instant::now());
    thread::sleep(Duration::from_secs_f64(secs));
    let (after, t1) = (cpu_ns(tracer.id())?, Instant::now());
    workload.kill()?;
    workload.wait()?;
    interrupt(&mut tracer, false, Duration::from_secs(10))?;
    Ok((after - before) as f64 / 1e6 / (t1 - t0).as_secs_f64())
}

/// CPU milliseconds per second of a thread that sleeps 10 ms in a loop.
fn tick_floor(secs: f64) -> f64 {
    let thread_cpu_ns = || clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
    let start = (Instant::now(), thread_cpu_ns());
    while start.0.elapsed().as_secs_f64() < secs {
        thread::sleep(Duration::from_millis(10));
    }
    (thread_cpu_ns() - start.1) as f64 / 1e6 / start.0.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the rounds; returns the JSON (the figures are stated, not judged:
/// the tracer's CPU at load is the scale bench's).
pub fn run(root: &Path, plan: &Plan) -> Result<Value> {
    let mut per_source: Vec<Vec<f64>> = vec![Vec::new(); SOURCES.len()];
    for _ in 0..plan.rounds {
        for (i, source) in SOURCES.iter().enumerate() {
            per_source[i].push(measure(root, source, plan.secs)?);
        }
    }
    let floor = tick_floor(plan.secs.min(3.0));
    println!(
        "\ntracer CPU, attach tracing the stub workload (median of {} rounds):",
        plan.rounds
    );
    let mut out = serde_json::Map::new();
    for (source, runs) in SOURCES.iter().zip(per_source) {
        let m = median(runs.clone());
        println!("  --sched {source:<8} {m:6.2} ms/s  (runs {runs:.2?})");
        out.insert(
            (*source).to_string(),
            json!({"ms_per_s_median": m, "runs_ms_per_s": runs}),
        );
    }
    println!("  floor: a thread sleeping 10 ms in a loop pays {floor:.2} ms/s here");
    out.insert("tick_floor_ms_per_s".into(), json!(floor));
    out.insert("secs".into(), json!(plan.secs));
    Ok(Value::Object(out))
}
