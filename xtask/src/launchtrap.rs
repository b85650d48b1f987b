//! What a traced launch costs against one empty uprobe on the same function,
//! measured in the same run: the workload's tight launch loop
//! (`--bench-launches`) untraced, under bpftrace with an empty program on
//! the launch function (`uprobe:LIB:FUNC {}`, one trap per call), under
//! bpftrace with the least a tracer that times launches does
//! (`uprobe:LIB:FUNC { @t[tid] = nsecs; }`: the clock and one hash update
//! per launch), under `ttft-trace attach`, and under `attach
//! --host-wide-probes` (the reach the daemon has). Three shapes: a runtime launch whose runtime calls
//! the driver (the stub pair: `cudaLaunchKernel` over `cuLaunchKernel`), a
//! direct driver launch (`cuLaunchKernel`), and a graph launch
//! (`cudaGraphLaunch` over `cuGraphLaunch`). Rounds alternate the setups;
//! medians. The target is a traced launch at most 1.10 x the empty uprobe's
//! added cost; the bench prints how far each shape is and what the added
//! cost is per step of a server issuing 800 launches per step.

use std::{
    collections::BTreeSet,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    attachtime::wait_for_detaches,
    bounds::{self, Verdicts},
    bpfprogs::other_tracer,
    demo::{interrupt, signal, start_tracer, wait_stopped},
    taxsetups::start_bpftrace,
};

/// Launches timed per run: about a second at a traced launch's 1.4 µs.
/// With 200 000 (0.3 s) one round's ratio moved by a third on this 2-CPU
/// VM (1.30-1.94 x); with a million, 1.32-1.67 x (2026-12-07).
const LAUNCHES: u32 = 1_000_000;
/// Launches per step of a real server shape (eager prefill of a large model).
const PER_STEP: f64 = 800.0;

/// One shape: the workload's style, the library and function bpftrace
/// probes.
struct Shape {
    name: &'static str,
    style: &'static str,
    library: &'static str,
    function: &'static str,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "runtime over driver",
        style: "stream",
        library: "libcudart.so.12",
        function: "cudaLaunchKernel",
    },
    Shape {
        name: "driver",
        style: "driver",
        library: "libcuda.so.1",
        function: "cuLaunchKernel",
    },
    Shape {
        name: "graph",
        style: "graph",
        library: "libcudart.so.12",
        function: "cudaGraphLaunch",
    },
];

/// Idle time after the first 1000 launches, before the timed ones, in
/// every setup: the tracer leaves a process's launches to the driver's
/// probes at its first rescan (250 ms) after 256 runtime launches seen to
/// reach the driver; the timed loop then measures what stays.
const WARMUP_MS: &str = "600";

fn workload(root: &Path, shape: &Shape) -> Command {
    let mut c = Command::new(root.join("target/fixtures/workload"));
    c.args(["--style", shape.style])
        .args(["--bench-launches", &LAUNCHES.to_string()])
        .args(["--bench-warmup-ms", WARMUP_MS]);
    c
}

fn parse_ns(stdout: &[u8]) -> Result<f64> {
    let text = String::from_utf8_lossy(stdout);
    let line = text.lines().last().context("workload printed nothing")?;
    let v: Value = serde_json::from_str(line)?;
    v["ns_per_launch"].as_f64().context("no ns_per_launch")
}

fn untraced(root: &Path, shape: &Shape) -> Result<f64> {
    parse_ns(&workload(root, shape).output()?.stdout)
}

/// The empty program: one trap, nothing done.
const EMPTY: &str = "";
/// The least a tracer that times launches per thread does: the clock and one
/// hash update.
const RECORDER: &str = "@t[tid] = nsecs;";

/// Under bpftrace with `body` on the shape's launch function.
fn bpftrace_uprobe(root: &Path, shape: &Shape, body: &str) -> Result<f64> {
    let lib = root.join("target/fixtures").join(shape.library);
    let program = format!("uprobe:{}:{} {{ {body} }}", lib.display(), shape.function);
    let mut bpftrace = start_bpftrace(&program)?;
    let ns = untraced(root, shape);
    interrupt(&mut bpftrace, true, Duration::from_secs(30))?;
    ns
}

/// Under `ttft-trace attach` (with `extra` arguments), started while the
/// workload is stopped. The workload stops again after its warm-up, and
/// is timed once the tracer has no thread detaching probes: the runtime's
/// launch probes, left to the driver's at a rescan, take 70-125 ms each
/// to go (six on the stub runtime), and launches timed while they go pay
/// two traps (the ratio moved between 1.55 and 1.98 x round to round
/// with a fixed 600 ms warm-up, 2026-12-07).
fn traced(root: &Path, shape: &Shape, extra: &[&str]) -> Result<f64> {
    let child = workload(root, shape)
        .args(["--stop-before-work", "--bench-stop-after-warmup"])
        .stdout(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    wait_stopped(pid)?;
    let mut args = vec!["--pid".into(), pid.to_string(), "--no-listen".into()];
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut tracer = start_tracer(root, "attach", &args, "attached")?;
    // The second library's probes follow the first's "attached" line.
    thread::sleep(Duration::from_millis(300));
    signal(pid, "CONT")?;
    wait_stopped(pid)?;
    wait_no_thread(tracer.id(), DETACH_THREAD, Duration::from_secs(10))?;
    signal(pid, "CONT")?;
    let out = child.wait_with_output()?;
    tracer.wait()?;
    wait_for_detaches()?;
    parse_ns(&out.stdout)
}

/// The name of the tracer's threads that detach a library's probes.
const DETACH_THREAD: &str = "ttft-detach-lib";

/// Waits until process `pid` has no thread named `name`.
fn wait_no_thread(pid: u32, name: &str, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let busy = std::fs::read_dir(format!("/proc/{pid}/task"))?
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .any(|comm| comm.trim_end() == name);
        if !busy {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the tracer (pid {pid}) still had a {name} thread after {limit:?}");
        }
        thread::sleep(Duration::from_millis(5));
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `rounds` rounds of the first `shapes` shapes (all: `usize::MAX`);
/// returns the results and their verdicts against [`bounds::LAUNCH`].
pub fn run(root: &Path, rounds: usize, shapes: usize) -> Result<(Value, Verdicts)> {
    let mut rows = Vec::new();
    let mut verdicts = Verdicts::default();
    let mut other = false;
    for shape in SHAPES.iter().take(shapes) {
        let (mut u, mut e, mut r, mut t, mut b) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            // Another tracer's uprobes on the same files would tax every
            // setup, the untraced one too: wait (up to a minute) for it to go.
            other |= other_tracer(&BTreeSet::new(), Duration::from_secs(60))?;
            u.push(untraced(root, shape)?);
            e.push(bpftrace_uprobe(root, shape, EMPTY)?);
            r.push(bpftrace_uprobe(root, shape, RECORDER)?);
            t.push(traced(root, shape, &[])?);
            b.push(traced(root, shape, &["--host-wide-probes"])?);
        }
        let (um, em, tm) = (median(u.clone()), median(e.clone()), median(t.clone()));
        let (trap, added) = (em - um, tm - um);
        let ratio = added / trap;
        let both = median(b.clone()) - um;
        let recorder = median(r.clone()) - um;
        println!(
            "launch, {}: {um:.0} ns untraced, +{trap:.0} ns one empty uprobe on {}, \
             +{recorder:.0} ns a minimal recorder ({:.2} x), \
             +{added:.0} ns traced ({ratio:.2} x the trap, {:.2} x the recorder; \
             {:.2} ms per step of {PER_STEP} launches), \
             +{both:.0} ns with host-wide probes ({:.2} x)",
            shape.name,
            shape.function,
            recorder / trap,
            added / recorder,
            added * PER_STEP / 1e6,
            both / trap
        );
        verdicts.judge(ratio, bounds::LAUNCH, |limit| {
            format!(
                "a traced launch ({}) costs {ratio:.2} x one empty uprobe (limit {limit:.2} x)",
                shape.name
            )
        });
        rows.push(json!({
            "shape": shape.name, "function": shape.function,
            "ns_untraced": um, "ns_empty_uprobe": em, "ns_traced": tm,
            "added_ns_empty_uprobe": trap, "added_ns_traced": added, "ratio": ratio,
            "added_ms_per_step": added * PER_STEP / 1e6, "launches_per_step": PER_STEP,
            "added_ns_host_wide": both, "ratio_host_wide": both / trap,
            "added_ns_recorder": recorder, "ratio_recorder": recorder / trap,
            "ratio_traced_over_recorder": added / recorder,
            "runs_untraced": u, "runs_empty_uprobe": e, "runs_recorder": r, "runs_traced": t,
            "runs_host_wide": b,
        }));
    }
    if other {
        println!("WARNING: another tracer was loaded during the launch runs: they are taxed by it");
    }
    let result = json!({
        "launches": LAUNCHES, "rounds": rounds, "shapes": rows,
        "guard": bounds::LAUNCH.guard, "goal": bounds::LAUNCH.goal,
        "other_tracer": other,
    });
    Ok((result, verdicts))
}
