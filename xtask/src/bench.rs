//! `cargo xtask bench`: costs that matter to a user, measured end to end.
//! - the host tax: what untraced processes pay while the tracer runs
//!   (see [`crate::hosttax`]), judged ([`crate::bounds::HOST_TAX`]); also alone with
//!   `--only hosttax`;
//! - the same resolved to a percent or two: the tracer's raw-tracepoint
//!   programs attached a second time and switched every ~40 ms inside one
//!   run of each operation (see [`crate::hooktoggle`]), judged the same
//!   way; also alone with `--only toggle`;
//! - the added cost per launch, traced against one empty uprobe on the same
//!   function (see [`crate::launchtrap`]), judged ([`crate::bounds::LAUNCH`]), beside
//!   a minimal recorder (the clock and one map update); also alone with
//!   `--only launches`;
//! - the episode rate the daemon keeps up with before the kernel drops
//!   events (ttft_trace_events_lost_total stays 0);
//! - attach and detach times on the real libcudart.so.12 (see
//!   [`crate::attachtime`]), judged ([`crate::bounds::ATTACH_MS`]); also alone with
//!   `--only attach`;
//! - what a process outside the traced tree that maps the same CUDA
//!   libraries pays per launch (see [`crate::neighbour`]), judged
//!   ([`crate::bounds::neighbour_added_ns`]);
//! - the daemon's cost of `--sched sampled` per traced thread (the
//!   `schedstat` bench of the ttft-trace crate), and the tracer's whole CPU
//!   time by scheduler source (see [`crate::tracercpu`]; also alone with
//!   `--only tracercpu`);
//! - the tracer's RSS and CPU with 10 000 followed streaming connections
//!   (see [`crate::scale`]), judged (RSS, bytes per connection) and no
//!   event lost nor request missed; also
//!   alone with `--only scale`;
//! - what reading TLS costs a traced server: requests/s and one
//!   `SSL_write`, traced against untraced, beside the same in plain HTTP
//!   (see [`crate::tlscost`]), stated; also alone with `--only tls`;
//! - the tracer with 1 000 concurrent gRPC calls over 10 HTTP/2
//!   connections (see [`crate::h2scale`]), judged (RSS, no event lost,
//!   every call traced); also alone with `--only h2`;
//! - which received segments per-socket `sock_ops` callbacks and a
//!   `cgroup_skb` program would see, against `tcp_probe` (see
//!   [`crate::sockopscover`]; also alone with `--only sockops`), stated.
//!
//! Each judged figure has a guard and a goal ([`crate::bounds`]): every
//! run fails when a guard is broken; the full bench and `--only` also say
//! which goals are met. `--quick` (for CI: a few minutes once built) runs
//! one short round of each guarded part (the toggle host tax, attach and
//! detach, a neighbour, one launch shape against one trap, scale to 3 000
//! connections) and the stated ones.

use std::process::Command;

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    attachtime,
    bounds::Verdicts,
    demo::{build_all, signal, start_tracer, wait_stopped},
    h2scale, hooktoggle, hosttax, launchtrap, neighbour,
    process::{output, repo_root},
    scale, sockopscover, tlscost, tracercpu,
};

const RUNS: usize = 5;
/// Attach and detach runs of the full bench (each waits for the last
/// one's uprobes to be removed: seconds).
const ATTACH_RUNS: usize = 3;

/// Runs `episodes` one-launch episodes with no device time and no gap, as
/// fast as the stub allows, and returns (episodes/s offered, episodes seen,
/// events lost) from the tracer's closing JSONL totals, and the tracer's
/// peak RSS in KiB while the workload ran.
fn event_rate(root: &std::path::Path, episodes: u32, ringbuf: u32) -> Result<(f64, u64, u64, u64)> {
    let bin = root.join("target/fixtures/workload");
    let mut child = Command::new(&bin)
        .args([
            "--style",
            "sync",
            "--episodes",
            &episodes.to_string(),
            "--launches",
            "1",
        ])
        .args([
            "--kernel-us",
            "0",
            "--copy-bytes",
            "8",
            "--gap-us",
            "0",
            "--stop-before-work",
        ])
        .spawn()?;
    let pid = child.id();
    wait_stopped(pid)?;
    let jsonl = root.join("target/bench/rate.jsonl");
    let mut tracer = start_tracer(
        root,
        "attach",
        &[
            "--pid".into(),
            pid.to_string(),
            "--no-listen".into(),
            "--ringbuf-bytes".into(),
            ringbuf.to_string(),
            "--interval".into(),
            "60".into(),
            "--jsonl".into(),
            jsonl.display().to_string(),
        ],
        "attached",
    )?;
    let start = std::time::Instant::now();
    signal(pid, "CONT")?;
    // VmHWM only grows: its last reading before the workload ends is the
    // peak at that rate (the tracer exits soon after its target).
    let mut hwm_kib = 0;
    while child.try_wait()?.is_none() {
        hwm_kib = scale::status_kib(tracer.id(), "VmHWM:")?;
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let secs = start.elapsed().as_secs_f64();
    tracer.wait()?;
    let text = std::fs::read_to_string(&jsonl)?;
    let totals: Value = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["type"] == "totals")
        .context("no totals line in the tracer's JSONL")?;
    let seen = totals["episodes_ok"].as_u64().unwrap_or(0);
    let lost = totals["events_lost"].as_u64().unwrap_or(0);
    Ok((f64::from(episodes) / secs, seen, lost, hwm_kib))
}

/// Writes `value` to target/bench/`name`.
fn write_result(root: &std::path::Path, name: &str, value: &Value) -> Result<()> {
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(name), serde_json::to_string_pretty(value)?)?;
    println!("written to target/bench/{name}");
    Ok(())
}

/// One part of the bench, run alone (its full rounds).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// The host tax alone, 5 rounds of 300 ms runs as in the full bench
    /// (see [`crate::hosttax`]), about 12 minutes.
    Hosttax,
    /// The tracer's raw-tracepoint programs switched on and off inside one
    /// run of each operation (see [`crate::hooktoggle`]), about 3 minutes.
    Toggle,
    /// Attach and detach on the real runtime, 3 runs (see
    /// [`crate::attachtime`]).
    Attach,
    /// A neighbour's launch beside `attach` (see [`crate::neighbour`]).
    Neighbour,
    /// A traced launch against one empty uprobe (see [`crate::launchtrap`]).
    Launches,
    /// The tracer's own CPU time, `--sched sampled` against `--sched
    /// exact`, 3 rounds (see [`crate::tracercpu`]), about a minute.
    Tracercpu,
    /// The tracer at scale, about 4 minutes: 1 000 then 10 000 streaming
    /// connections on loopback (see [`crate::scale`]).
    Scale,
    /// Which received segments per-socket `sock_ops` callbacks and a
    /// `cgroup_skb` program see, against `tcp_probe` (see
    /// [`crate::sockopscover`]), a second.
    Sockops,
    /// TLS requests/s and `SSL_write` calls, traced against untraced, and
    /// the same in plain HTTP, 5 rounds (see [`crate::tlscost`]), about a
    /// minute.
    Tls,
    /// 1 000 concurrent gRPC calls over 10 HTTP/2 connections (see
    /// [`crate::h2scale`]), about 40 s.
    H2,
}

/// The full bench's host tax: rounds of (untraced, each setup).
const HOSTTAX: hosttax::Plan = hosttax::Plan {
    rounds: 5,
    ms: 300,
    passes: 3,
};

pub fn bench(quick: bool, only: Option<Part>) -> Result<()> {
    let root = repo_root()?;
    build_all(&root)?;
    if let Some(part) = only {
        let (name, (value, verdicts)) = match part {
            Part::Hosttax => ("hosttax.json", hosttax::run(&root, &HOSTTAX)?),
            Part::Toggle => ("toggle.json", hooktoggle::run(&root, &hooktoggle::FULL)?),
            Part::Attach => ("attach.json", attachtime::run(&root, ATTACH_RUNS)?),
            Part::Neighbour => ("neighbour.json", neighbour::run(&root, RUNS)?),
            Part::Launches => ("launches.json", launchtrap::run(&root, RUNS, usize::MAX)?),
            Part::Scale => ("scale.json", scale::run(&root, &scale::FULL)?),
            Part::H2 => ("h2.json", h2scale::run(&root, &h2scale::FULL)?),
            // Stated, not judged.
            Part::Tracercpu => (
                "tracercpu.json",
                (
                    tracercpu::run(&root, &tracercpu::FULL)?,
                    Verdicts::default(),
                ),
            ),
            Part::Sockops => (
                "sockops.json",
                (sockopscover::run(&root)?, Verdicts::default()),
            ),
            Part::Tls => (
                "tls.json",
                (tlscost::run(&root, RUNS)?, Verdicts::default()),
            ),
        };
        write_result(&root, name, &value)?;
        return held(&verdicts, true);
    }
    if quick {
        return quick_bench(&root);
    }
    let (tax, mut verdicts) = hosttax::run(&root, &HOSTTAX)?;
    write_result(&root, "hosttax.json", &tax)?;
    let (toggle, v) = hooktoggle::run(&root, &hooktoggle::FULL)?;
    write_result(&root, "toggle.json", &toggle)?;
    verdicts.extend(v);
    let (attach, v) = attachtime::run(&root, ATTACH_RUNS)?;
    verdicts.extend(v);
    let (neighbour, v) = neighbour::run(&root, RUNS)?;
    verdicts.extend(v);
    let (launch_traps, v) = launchtrap::run(&root, RUNS, usize::MAX)?;
    verdicts.extend(v);
    let mut rates = Vec::new();
    for (episodes, ringbuf) in [(200_000u32, 1u32 << 22), (200_000, 1 << 16)] {
        let (rate, seen, lost, hwm_kib) = event_rate(&root, episodes, ringbuf)?;
        println!(
            "episodes offered at {rate:.0}/s with a {} KiB ring buffer: {seen} seen, {lost} lost; \
             tracer peak RSS {hwm_kib} KiB",
            ringbuf / 1024
        );
        rates.push(json!({"episodes": episodes, "ringbuf_bytes": ringbuf, "offered_per_s": rate, "seen": seen, "lost": lost, "tracer_rss_kib_peak": hwm_kib}));
    }
    let pipeline = output(Command::new("cargo").current_dir(&root).args([
        "bench",
        "-q",
        "-p",
        "ttft-trace",
        "--bench",
        "pipeline",
    ]))?;
    let pipeline: Value = serde_json::from_str(pipeline.lines().last().unwrap_or("{}"))?;
    println!(
        "userspace pipeline: {} episode events/s on one core ({} ns each: decode, record, JSONL, histograms)",
        pipeline["events_per_s"], pipeline["ns_per_event"]
    );
    let discovery = output(Command::new("cargo").current_dir(&root).args([
        "bench",
        "-q",
        "-p",
        "ttft-trace",
        "--bench",
        "discovery",
    ]))?;
    let discovery: Value = serde_json::from_str(discovery.lines().last().unwrap_or("{}"))?;
    println!(
        "daemon discovery: a /proc pass over {} processes takes {:.1} ms warm ({:.0} µs each; {:.1} ms cold, every file inspected once)",
        discovery["processes"],
        discovery["warm_pass_ms"].as_f64().unwrap_or(f64::NAN),
        discovery["warm_us_per_process"]
            .as_f64()
            .unwrap_or(f64::NAN),
        discovery["cold_pass_ms"].as_f64().unwrap_or(f64::NAN),
    );
    let sampler = output(Command::new("cargo").current_dir(&root).args([
        "bench",
        "-q",
        "-p",
        "ttft-trace",
        "--bench",
        "schedstat",
    ]))?;
    let sampler: Value = serde_json::from_str(sampler.lines().last().unwrap_or("{}"))?;
    println!(
        "--sched sampled: {} ns per traced thread and reading ({} threads: {:.2} % of a core at \
         the 10 ms period)",
        sampler["ns_per_thread_read"],
        sampler["threads"],
        sampler["core_share_at_10ms"].as_f64().unwrap_or(f64::NAN) * 100.0
    );
    let tracer_cpu = tracercpu::run(&root, &tracercpu::FULL)?;
    write_result(&root, "tracercpu.json", &tracer_cpu)?;
    let sockops = sockopscover::run(&root)?;
    write_result(&root, "sockops.json", &sockops)?;
    let tls = tlscost::run(&root, RUNS)?;
    write_result(&root, "tls.json", &tls)?;
    let (scale, v) = scale::run(&root, &scale::FULL)?;
    write_result(&root, "scale.json", &scale)?;
    verdicts.extend(v);
    let (h2, v) = h2scale::run(&root, &h2scale::FULL)?;
    write_result(&root, "h2.json", &h2)?;
    verdicts.extend(v);
    let results = json!({
        "host_tax": tax,
        "hook_toggle": toggle,
        "scale": scale,
        "http2": h2,
        "attach_detach": attach,
        "neighbour_launch": neighbour,
        "userspace_pipeline": pipeline,
        "daemon_discovery": discovery,
        "sched_sampler": sampler,
        "tracer_cpu": tracer_cpu,
        "sockops_coverage": sockops,
        "tls": tls,
        "launch_traps": launch_traps, "event_rate": rates,
    });
    write_result(&root, "results.json", &results)?;
    held(&verdicts, true)
}

/// `--quick`, for CI: one short round of each guarded figure (the toggle
/// host tax, attach and detach (three runs: their median), a neighbour's launch, a traced launch
/// against one trap (3 rounds, one shape), scale to 3 000 connections), and the stated ones; fails
/// when a guard is broken. The block host tax is left to the full bench: one
/// 100 ms round of it moves by 10 to 20 % on this VM, more than it could
/// judge.
fn quick_bench(root: &std::path::Path) -> Result<()> {
    let (toggle, mut verdicts) = hooktoggle::run(root, &hooktoggle::QUICK)?;
    write_result(root, "toggle.json", &toggle)?;
    // Three runs, judged on their median as the full bench is: one run
    // ranged 912-1121 ms beside another of 958 on this 2-CPU VM
    // (2026-12-07), across the guard.
    let (attach, v) = attachtime::run(root, 3)?;
    write_result(root, "attach.json", &attach)?;
    verdicts.extend(v);
    let (neighbour, v) = neighbour::run(root, 1)?;
    write_result(root, "neighbour.json", &neighbour)?;
    verdicts.extend(v);
    let (launches, v) = launchtrap::run(root, 3, 1)?;
    write_result(root, "launches.json", &launches)?;
    verdicts.extend(v);
    let (scale, v) = scale::run(root, &scale::QUICK)?;
    write_result(root, "scale.json", &scale)?;
    verdicts.extend(v);
    let cpu = tracercpu::run(root, &tracercpu::QUICK)?;
    write_result(root, "tracercpu.json", &cpu)?;
    let cover = sockopscover::run(root)?;
    write_result(root, "sockops.json", &cover)?;
    let tls = tlscost::run(root, 1)?;
    write_result(root, "tls.json", &tls)?;
    held(&verdicts, false)
}

/// Prints `verdicts` (the goals too when `goals`): an error when a guard
/// is broken.
fn held(verdicts: &Verdicts, goals: bool) -> Result<()> {
    if !verdicts.print(goals) {
        bail!("a guard is broken (FAIL lines above; limits in xtask/src/bounds.rs)");
    }
    Ok(())
}
