//! Hook toggling: what processes the tracer does not trace pay for its
//! host-wide programs, resolved to a percent or two (`cargo xtask bench
//! --only toggle`; also in the full bench and, shorter, in `--quick`).
//!
//! The host-tax bench ([`crate::hosttax`]) starts and stops the tracer
//! between 300 ms blocks; on this VM one block's level moves by ±10-20 %,
//! too much to judge +5 %. Here the tracer runs throughout and the hooks
//! are switched inside one measured run instead:
//! - the tracer's host-wide BPF links are found with the bpf() syscall
//!   (the link ids after it started, less those before), and its programs
//!   opened by id;
//! - a thread on the other CPU attaches a second link of each raw-tracepoint
//!   program (`BPF_RAW_TRACEPOINT_OPEN`: with the tracepoint's name for a
//!   `raw_tracepoint` program, without for a `tp_btf` one, which names its
//!   own) every ~40 ms and closes it ~40 ms later, stamping each switch on
//!   CLOCK_MONOTONIC. The second link runs the same program on the same
//!   maps, so it does once more exactly what the tracer's own link does for
//!   every task it does not trace: an "on" phase pays the tracer's programs
//!   twice, an "off" phase once, and the difference is their cost. A check
//!   with the kernel's run counts (`kernel.bpf_stats_enabled`, on only for
//!   it) shows the second link runs: the runs per operation double;
//! - the fixture `hosttax` (`tests/fixtures/hosttax.c`, slice mode) runs
//!   each operation on a CPU of its own for the whole time and prints one
//!   line per 5 ms slice with its stamps and operations. Slices wholly
//!   inside a phase count (those across a switch are dropped); each on
//!   phase's ns per operation over the mean of the off phases right before
//!   and after it is one ratio, and the median of the ratios, with their
//!   quartiles, is the figure. Drift slower than a phase pair cancels.
//!
//! Beside the tracer's setups (`attach`, `attach_exact_sched` with `--sched
//! exact`, `daemon`): `null_control`, the same schedule switching nothing,
//! whose spread is the method's noise; `floor`, an empty program on the
//! four raw tracepoints of the default path ([`crate::rawfloor`]) against
//! none, what any program there costs; and `floor_second`, the same empty
//! program switched on top of a first link of it that stays. A tracepoint
//! with one probe calls it directly (a static call), with two or more
//! through its iterator, an indirect call per probe: going from one
//! program to two, as the tracer's setups do, adds that change too, and
//! `floor_second` is the floor of the same step. `programs` (and
//! `programs_exact`, with the switch program) take the step from none to
//! one instead: the tracer's own programs loaded from its object with no
//! tracer running, as an untraced task runs them ([`crate::tracerprogs`]).
//! Their segment program goes on the ingress of an empty cgroup: no
//! socket runs it, and what every socket pays is the kernel's check of its
//! own cgroup, on from the first ingress program anywhere on the host.
//! `programs_host_wide` takes the host-wide path's programs instead
//! (`raw_tcp_probe` for the cgroup program): a workload in the root
//! cgroup, `--port`, the self-check's fallback. The busy traced workload
//! runs in a cgroup of its own ([`taxsetups::WORKLOAD_CGROUP`]), as a
//! container's or a systemd unit's processes do, so that the tracer's
//! setups put their segment program there.
//!
//! Not covered, and left to the host-tax bench: the tracer's perf-event
//! links (uprobes, which under `attach` are bound to the traced process and
//! enable the perf task-context hooks every context switch then calls;
//! the classic tracepoints left on the default path, process fork and exit,
//! socket state, retransmits and resets, rare events), because closing a
//! perf event takes 64-84 ms here, too slow to switch every 40 ms; and the
//! tracer's own CPU time, on the other CPU. While a second link is on, a
//! traced task's events also run twice; the traced workload is on the
//! other CPU, and its events are not what is measured.

use std::{
    collections::BTreeSet,
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde_json::{Value, json};

use crate::{
    bounds::{self, Verdicts},
    bpfobj::{link_ids, prog_info, settled_link_ids},
    bpfprogs::{BpfStats, other_tracer},
    hosttax::{self, CASES},
    placement::Placement,
    process::clock_ns,
    taxsetups::{self, Running},
    togglehooks::Hooks,
    togglephases::{Slice, Toggle, summary},
    tracerprogs::Set,
};

pub struct Plan {
    /// Milliseconds each operation runs under each setup.
    pub ms_per_case: u32,
    /// Mean length of a phase (on or off); each is drawn within ±25 %.
    pub period_ms: u64,
    /// Length of the fixture's slices.
    pub slice_us: u32,
    /// Whether the setups of [`FULL_ONLY`] run too.
    pub all: bool,
}

/// The full bench's plan: about 50 on phases per operation and setup.
pub const FULL: Plan = Plan {
    ms_per_case: 4000,
    period_ms: 40,
    slice_us: 5000,
    all: true,
};

/// The setups only the full plan runs.
const FULL_ONLY: &[&str] = &[
    "daemon",
    "floor_second",
    "programs_exact",
    "programs_host_wide",
];

/// `--quick`: a dozen phases per operation, none of [`FULL_ONLY`].
pub const QUICK: Plan = Plan {
    ms_per_case: 1000,
    period_ms: 40,
    slice_us: 5000,
    all: false,
};

/// Judged against [`bounds::HOST_TAX`]: the default path's programs alone
/// (none -> one) and the tracer as shipped (one -> two); the opt-in exact
/// source is reported beside them.
pub const JUDGED: &[&str] = &["programs", "attach", "daemon"];

/// Setups and what each switches, in run order.
const SETUPS: &[(&str, &str)] = &[
    (
        "null_control",
        "the same schedule switching nothing: the method's noise",
    ),
    (
        "floor",
        "an empty program on sched_switch, tcp_probe, tcp_sendmsg_locked, tcp_rcv_space_adjust, \
         against none",
    ),
    (
        "floor_second",
        "the same empty program once more, on top of a first link of it that stays (1 -> 2 \
         programs, as the tracer's setups)",
    ),
    (
        "programs",
        "the tracer's default path, loaded from its object, no tracer running, as an untraced \
         task meets it: the send and receive programs (tcp_sendmsg_locked, tcp_rcv_space_adjust) \
         and the segment program on the ingress of an empty cgroup (skb_segment), against none",
    ),
    (
        "programs_exact",
        "the same and --sched exact's btf_sched_switch: against none",
    ),
    (
        "programs_host_wide",
        "the host-wide path (a workload in the root cgroup, --port, the self-check's fallback): \
         the send and receive programs and raw_tcp_probe, against none",
    ),
    (
        "attach",
        "ttft-trace attach --pid WORKLOAD: its raw-tracepoint programs once more",
    ),
    (
        "attach_exact_sched",
        "ttft-trace attach --pid WORKLOAD --sched exact: its raw-tracepoint programs once more",
    ),
    (
        "daemon",
        "ttft-trace daemon (finds WORKLOAD itself): its raw-tracepoint programs once more",
    ),
];

fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// Switches `hooks` on and off until `stop`, each phase `period` ± 25 %
/// (drawn, so that nothing periodic on the host, timer ticks or the
/// tracer's 10 ms sampling, keeps step with the phases).
fn toggler(hooks: &Hooks, period: Duration, stop: &AtomicBool) -> Result<Vec<Toggle>> {
    let mut toggles = Vec::new();
    let mut held = Vec::new();
    let mut on = false;
    let mut seed = now_ns() | 1;
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        on = !on;
        let before = now_ns();
        if on {
            held = hooks.attach()?;
        } else {
            held.clear();
        }
        toggles.push(Toggle {
            before,
            after: now_ns(),
            on,
        });
        // xorshift64: a uniform draw in [0.75, 1.25) periods.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        next += period.mul_f64(0.75 + (seed >> 11) as f64 / (1u64 << 53) as f64 / 2.0);
        thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    drop(held);
    Ok(toggles)
}

/// Runs the fixture's `case` for `ms` on `cpu` in slices of `slice_us`:
/// its slices and its operations in all.
fn fixture(
    bin: &Path,
    case: &str,
    ms: u32,
    cpu: usize,
    slice_us: u32,
) -> Result<(Vec<Slice>, u64)> {
    let text = hosttax::run_fixture(
        bin,
        &[
            case,
            &ms.to_string(),
            &cpu.to_string(),
            &slice_us.to_string(),
        ],
    )?;
    let mut slices = Vec::new();
    let mut ops = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("slice ") {
            let n: Vec<u64> = rest
                .split(' ')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .with_context(|| format!("hosttax slice line {line:?}"))?;
            let [start, end, o] = n[..] else {
                bail!("hosttax slice line {line:?}");
            };
            slices.push(Slice { start, end, ops: o });
        } else {
            let v: Value = serde_json::from_str(line)?;
            ops = v["ops"].as_u64();
        }
    }
    Ok((slices, ops.context("no ops in hosttax's output")?))
}

/// Shows that the second links run: each program's runs per round trip of
/// the fixture's loopback TCP ping-pong (a send, a receive and two
/// switches each way), with the tracer's links alone and with the second
/// ones too (statistics on only for these runs).
fn check(bin: &Path, cpu: usize, hooks: &Hooks, stats: &BpfStats) -> Result<Value> {
    let counts = || -> Result<Vec<u64>> {
        hooks
            .progs
            .iter()
            .map(|(_, fd)| Ok(prog_info(fd)?.2))
            .collect()
    };
    let mut per_op = vec![[0.0; 2]; hooks.progs.len()];
    for (k, second) in [false, true].into_iter().enumerate() {
        let held = if second { hooks.attach()? } else { Vec::new() };
        let before = counts()?;
        stats.set(true)?;
        let run = fixture(bin, "tcp", 300, cpu, 100_000);
        stats.set(false)?;
        let after = counts()?;
        drop(held);
        let ops = run?.1 as f64;
        for (p, (a, b)) in after.iter().zip(before).enumerate() {
            per_op[p][k] = (a - b) as f64 / ops;
        }
    }
    let list: Vec<String> = hooks
        .progs
        .iter()
        .zip(&per_op)
        .map(|((name, _), [one, two])| format!("{name} {one:.2} -> {two:.2}"))
        .collect();
    eprintln!(
        "bench: toggle: runs per TCP round trip, without -> with the second links: {}",
        list.join(", ")
    );
    Ok(hooks
        .progs
        .iter()
        .zip(per_op)
        .map(|((name, _), [one, two])| (name.clone(), json!({"without": one, "with": two})))
        .collect::<serde_json::Map<_, _>>()
        .into())
}

/// Starts what `setup` needs, finds its hooks, checks them and measures
/// every case; stops the tracer after. Returns the setup's JSON, with
/// `cases` (see [`summary`]).
fn measure_setup(
    root: &Path,
    (setup, what): (&str, &str),
    plan: &Plan,
    cpu: usize,
    workload: u32,
    stats: &BpfStats,
) -> Result<Value> {
    let bin = root.join("target/fixtures/hosttax");
    let (running, hooks) = match setup {
        "null_control" => (None, Ok(Hooks::default())),
        "floor" => (None, Hooks::floor(false)),
        "floor_second" => (None, Hooks::floor(true)),
        "programs" => (None, Hooks::programs(root, Set::Default)),
        "programs_exact" => (None, Hooks::programs(root, Set::DefaultAndSwitch)),
        "programs_host_wide" => (None, Hooks::programs(root, Set::HostWide)),
        tracer => {
            let before = link_ids()?;
            let running = taxsetups::start(root, tracer, workload)?;
            let hooks = match &running {
                Running::Process { child, .. } => {
                    settled_link_ids().and_then(|_| Hooks::tracer(&before, child.id()))
                }
                Running::Floor(_) => Err(anyhow!("{tracer} is no tracer")),
            };
            (Some(running), hooks)
        }
    };
    let result = hooks.and_then(|hooks| {
        if setup != "null_control" && hooks.links.is_empty() {
            bail!("{setup}: no raw-tracepoint link to switch");
        }
        let switched = match hooks.labels.len() {
            0 => "nothing".into(),
            _ => hooks.labels.join(", "),
        };
        eprintln!("bench: toggle: {setup}: switching {switched}");
        for s in &hooks.skipped {
            eprintln!("bench: toggle: {setup}: left alone: {s}");
        }
        let check = match hooks.links.len() {
            0 => Value::Null,
            _ => check(&bin, cpu, &hooks, stats)?,
        };
        let mut cases = serde_json::Map::new();
        for &(case, _) in CASES {
            let stop = AtomicBool::new(false);
            let (slices, toggles) = thread::scope(|s| {
                let period = Duration::from_millis(plan.period_ms);
                let (hooks, stop) = (&hooks, &stop);
                let t = s.spawn(move || toggler(hooks, period, stop));
                let run = fixture(&bin, case, plan.ms_per_case, cpu, plan.slice_us);
                stop.store(true, Ordering::Relaxed);
                let toggles = t.join().map_err(|_| anyhow!("the toggler panicked"))??;
                anyhow::Ok((run?.0, toggles))
            })?;
            let v = summary(&slices, &toggles);
            // Each switch starts a phase, half of them on ones.
            if v["phases"].as_u64().unwrap_or(0) < toggles.len() as u64 / 4 {
                eprintln!(
                    "bench: toggle: WARNING: {setup} {case}: {} of {} switches make a paired \
                     phase (longest switch {} µs)",
                    v["phases"], v["switches"], v["longest_switch_us"]
                );
            }
            cases.insert(case.into(), v);
        }
        Ok(json!({
            "name": setup, "what": what, "switched": hooks.labels, "left_alone": hooks.skipped,
            "runs_per_tcp_round_trip": check, "cases": cases,
        }))
    });
    if let Some(running) = running {
        taxsetups::stop(running)?;
    }
    result
}

/// Runs the toggling bench; returns its results and the lines that break
/// the threshold (`--quick` prints them without failing).
pub fn run(root: &Path, plan: &Plan) -> Result<(Value, Verdicts)> {
    let started = Instant::now();
    let place = Placement::new()?;
    let cpu = place.measured;
    eprintln!(
        "bench: toggle: measured operations on CPU {cpu}; workload, tracer and toggler on CPUs {:?}",
        place.rest
    );
    let other = other_tracer(&BTreeSet::new(), Duration::from_secs(60))?;
    if other {
        eprintln!("bench: toggle: WARNING: another tracer's programs are loaded");
    }
    let workload = taxsetups::start_workload(root)?;
    let result = (|| -> Result<_> {
        let stats = BpfStats::new()?;
        SETUPS
            .iter()
            .filter(|s| plan.all || !FULL_ONLY.contains(&s.0))
            .map(|&setup| {
                eprintln!("bench: toggle: {}", setup.0);
                measure_setup(root, setup, plan, cpu, workload.id(), &stats)
            })
            .collect::<Result<Vec<_>>>()
    })();
    workload.stop();
    let placement = json!({"measured_cpu": place.measured, "other_cpus": place.rest});
    drop(place);
    let setups = result?;
    let seconds = started.elapsed().as_secs_f64();

    println!(
        "toggle: hooks switched on and off every {} ms (± 25 %) inside one {} ms run of each \
         operation on CPU {cpu}; per on phase, its ns per operation over the mean of the off \
         phases beside it (slices of {} µs wholly inside a phase): median [quartiles] (on phases), \
         ns per operation added ({seconds:.0} s in all)",
        plan.period_ms, plan.ms_per_case, plan.slice_us
    );
    let names: Vec<&str> = setups.iter().filter_map(|s| s["name"].as_str()).collect();
    println!("| operation | off ns/op | {} |", names.join(" | "));
    println!("| --- | --- |{}", " --- |".repeat(names.len()));
    let pct = |r: f64| (r - 1.0) * 100.0;
    let mut verdicts = Verdicts::default();
    for &(case, what) in CASES {
        let off = setups[0]["cases"][case]["off_ns_per_op"].as_f64();
        let mut line = format!("| {case} | {:.0} |", off.unwrap_or(f64::NAN));
        for (setup, &name) in setups.iter().zip(&names) {
            let v = &setup["cases"][case];
            let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
            let (med, q1, q3) = (f("paired_median"), f("paired_q1"), f("paired_q3"));
            if med.is_nan() {
                line += " no phase |";
                continue;
            }
            line += &format!(
                " {:+.1} % [{:+.1}, {:+.1}] ({}) {:+.0} ns |",
                pct(med),
                pct(q1),
                pct(q3),
                v["phases"],
                f("added_ns_per_op")
            );
            if JUDGED.contains(&name) {
                let step = if name.starts_with("programs") {
                    "the tracer's programs, none -> one"
                } else {
                    "its programs once more"
                };
                verdicts.judge(med, bounds::HOST_TAX, |limit| {
                    format!(
                        "toggle (limit +{:.0} %): {case} ({what}) costs {:+.1} % under {name} \
                         ({step}; median of {} on phases against the off phases beside them, \
                         quartiles {:+.1} / {:+.1} %)",
                        pct(limit),
                        pct(med),
                        v["phases"],
                        pct(q1),
                        pct(q3)
                    )
                });
            }
        }
        println!("{line}");
    }
    let results = json!({
        "period_ms": plan.period_ms,
        "period_jitter": 0.25,
        "slice_us": plan.slice_us,
        "ms_per_case": plan.ms_per_case,
        "placement": placement,
        "guard_ratio": bounds::HOST_TAX.guard,
        "goal_ratio": bounds::HOST_TAX.goal,
        "judged_setups": JUDGED,
        "judged_on": "paired_median",
        "cases": CASES.iter().map(|&(c, w)| json!({"case": c, "what": w})).collect::<Vec<_>>(),
        "setups": setups,
        "guards_broken": verdicts.broken(),
        "other_tracer_seen": other,
        "seconds": seconds,
    });
    Ok((results, verdicts))
}
