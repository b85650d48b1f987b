//! The host tax: what processes the tracer does not trace pay while it runs
//! (`cargo xtask bench`, also `--quick`).
//!
//! The fixture `hosttax` times six operations of an untraced process (see
//! `tests/fixtures/hosttax.c`). Each round runs them untraced, then under
//! each tracer setup in turn, untraced again after each setup (the last
//! one's included), so that every traced block has an untraced block right
//! before and right after it (the order of the setups rotates by one each
//! round). Two figures per setup and operation:
//! - `ratio`: the median over rounds against the median of every untraced
//!   run; the level of this VM drifts by ±20 % over seconds, which this
//!   figure takes in whole;
//! - `paired_ratio`: each traced run against the mean of the untraced
//!   blocks right before and right after it in the same round (each
//!   block's mean over its passes, the two sides weighted equally), the
//!   median of those ratios, with their quartiles (`paired_q1`,
//!   `paired_q3`): drift slower than a block pair cancels. The threshold is
//!   judged on this one.
//!
//! Setups:
//! - `attach`, `daemon`: the tracer as shipped, `attach --pid` tracing a
//!   busy workload (the stub runtime launching in a loop) and `daemon`
//!   finding that workload itself, with the default `--sched sampled` (no
//!   program on `sched_switch` or the wakeups; the traced threads' spells
//!   from `/proc/PID/task/TID/schedstat` every 10 ms). These must stay
//!   within +5 %.
//! - `attach_exact_sched`, `daemon_exact_sched`: the same with the opt-in
//!   `--sched exact` (a program on every context switch of the host):
//!   reported beside them, not judged.
//! - `attach_syscall_hook`: `attach` with the send hook forced to the
//!   syscall tracepoints and socket lengths (`TTFT_TRACE_SEND_HOOK=syscalls`):
//!   the fallback on kernels without BTF or the TCP tracepoints, and what
//!   every host paid before.
//! - `attach_classic_events`: `attach` with the scheduler programs forced
//!   onto the classic tracepoints
//!   (`TTFT_TRACE_EVENT_HOOK=tracepoints`): the fallback on kernels without
//!   BTF, and the default before the raw tracepoints.
//! - `empty_raw_programs`: an empty program on each raw tracepoint of the
//!   tracer's default path (`sched_switch`, `tcp_probe`,
//!   `tcp_sendmsg_locked`, `tcp_rcv_space_adjust`; see `rawfloor.rs`): the
//!   floor any program there costs, against which ours is judged.
//! - `empty_tracepoints` (where bpftrace is installed): empty programs on
//!   the classic scheduler and `tcp_probe` tracepoints: the floor of the
//!   fallback.
//!
//! Placement: the measured operations run on a CPU of their own (the last
//! this bench may use), every process of an operation on it, so that a
//! ping-pong's turns are context switches rather than wakeups of another
//! CPU, and nothing else of the bench lands beside them; the workload, the
//! tracer and bpftrace run on the other CPUs. What the operations pay is
//! then what the kernel runs in their own context: the programs on their
//! syscalls, switches and segments. (The tracer's own CPU time is the scale
//! bench's figure.) Unpinned, the same runs spread over ±20-40 % here, as
//! the two ends of a ping-pong landed on one CPU or two and beside the
//! workload or not: too wide to judge +5 %.
//!
//! Per-event costs of the tracer's own programs come from the kernel's BPF
//! run-time statistics (`kernel.bpf_stats_enabled`, read with bpftool):
//! time inside each program per run, over every run of one more pass of the
//! operations in the last round (untraced tasks' switches, socket calls and
//! segments, almost all of them). The statistics are on only for that pass:
//! they time every program run, which would tax the measured runs too.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    bounds::{self, Verdicts},
    bpfprogs::{BpfStats, other_tracer, program_costs, tracer_like_ids},
    placement::Placement,
    taxsetups::{Setup, setups, start, start_workload, stop},
};

/// Operations of `hosttax`, in report order.
pub(crate) const CASES: &[(&str, &str)] = &[
    ("write", "1-byte write() to /dev/null"),
    ("sendmsg", "1-byte sendmsg() + read on a UNIX socket pair"),
    (
        "pipe",
        "pipe ping-pong between two processes on one CPU, per round trip",
    ),
    (
        "tcp",
        "loopback TCP 1-byte ping-pong (TCP_NODELAY) between two processes on one CPU, per \
         round trip",
    ),
    ("fork", "fork() + _exit() + waitpid()"),
    (
        "ctxsw",
        "two processes on one CPU taking turns with sched_yield() (2 context switches), per \
         round",
    ),
];

/// Setups judged against [`bounds::HOST_TAX`].
pub const JUDGED: &[&str] = &["attach", "daemon"];

pub struct Plan {
    /// Rounds of (untraced, each setup).
    pub rounds: usize,
    /// Milliseconds each operation runs per measurement.
    pub ms: u32,
    /// Measurements per setup and round, and of the untraced runs before
    /// each: more samples for the same starts and stops of the tracer.
    pub passes: usize,
}

/// `passes` timed runs of every operation, on `cpu`.
fn measure_passes(bin: &Path, plan: &Plan, cpu: usize) -> Result<Vec<BTreeMap<&'static str, f64>>> {
    (0..plan.passes)
        .map(|_| measure(bin, plan.ms, cpu))
        .collect()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The `q` quantile of `v` (0..=1), interpolated between the two nearest
/// values (0.5: the median, the mean of the middle two of an even count).
pub(crate) fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let at = q * (v.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// The ratios of the traced block `traced` (its passes) against the
/// untraced blocks right before and after it: per case, each traced run
/// over the mean of the two blocks' means.
fn paired(
    before: &[BTreeMap<&'static str, f64>],
    traced: &[BTreeMap<&'static str, f64>],
    after: &[BTreeMap<&'static str, f64>],
) -> BTreeMap<&'static str, Vec<f64>> {
    let side = |block: &[BTreeMap<&'static str, f64>], case| {
        mean(&block.iter().map(|m| m[case]).collect::<Vec<_>>())
    };
    CASES
        .iter()
        .map(|&(case, _)| {
            let base = (side(before, case) + side(after, case)) / 2.0;
            (case, traced.iter().map(|m| m[case] / base).collect())
        })
        .collect()
}

/// Runs the fixture `bin` with `args` (the case first); its stdout.
pub(crate) fn run_fixture(bin: &Path, args: &[&str]) -> Result<String> {
    let o = Command::new(bin)
        .args(args)
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !o.status.success() {
        bail!(
            "hosttax {} failed: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// One timed run of every operation, on `cpu`: case -> ns per operation.
fn measure(bin: &Path, ms: u32, cpu: usize) -> Result<BTreeMap<&'static str, f64>> {
    let mut out = BTreeMap::new();
    for &(case, _) in CASES {
        let o = run_fixture(bin, &[case, &ms.to_string(), &cpu.to_string()])?;
        let v: Value = serde_json::from_str(&o)?;
        out.insert(case, v["ns_per_op"].as_f64().context("no ns_per_op")?);
    }
    Ok(out)
}

/// Runs the host-tax measurement; returns its results and their verdicts.
pub fn run(root: &Path, plan: &Plan) -> Result<(Value, Verdicts)> {
    let bpftrace = Command::new("bpftrace")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let setups = setups(bpftrace);
    let place = Placement::new()?;
    let cpu = place.measured;
    eprintln!(
        "bench: host tax: measured operations on CPU {cpu}; workload, tracer and bpftrace on CPUs {:?}",
        place.rest
    );
    let workload = start_workload(root)?;
    let result = measure_rounds(root, plan, &setups, cpu, workload.id());
    workload.stop();
    let placement = json!({"measured_cpu": place.measured, "other_cpus": place.rest});
    drop(place);
    Ok(report(plan, &setups, placement, &result?))
}

/// What the rounds measured: ns per operation untraced (by case) and
/// traced (by setup and case), the paired ratios, the programs' costs per
/// run (by setup), and whether another tracer was seen.
struct Measured {
    untraced: BTreeMap<&'static str, Vec<f64>>,
    traced: BTreeMap<(&'static str, &'static str), Vec<f64>>,
    pairs: BTreeMap<(&'static str, &'static str), Vec<f64>>,
    costs: BTreeMap<&'static str, BTreeMap<String, Value>>,
    other: bool,
}

/// The rounds: untraced, then each setup followed by untraced again.
fn measure_rounds(
    root: &Path,
    plan: &Plan,
    setups: &[Setup],
    cpu: usize,
    workload: u32,
) -> Result<Measured> {
    let bin = root.join("target/fixtures/hosttax");
    let stats = BpfStats::new()?;
    let mut m = Measured {
        untraced: BTreeMap::new(),
        traced: BTreeMap::new(),
        pairs: BTreeMap::new(),
        costs: BTreeMap::new(),
        // Once, at the start: another tracer may be finishing.
        other: other_tracer(&BTreeSet::new(), Duration::from_secs(60))?,
    };
    if m.other {
        eprintln!(
            "bench: WARNING: another tracer's programs are loaded (another ttft-trace?); \
             every run pays their tax, so the ratios understate ours"
        );
    }
    for round in 0..plan.rounds {
        // Each round starts one setup further on: a setup's place in
        // the round (after which other setup's stop) is not its own.
        let turn = setups.iter().cycle().skip(round % setups.len());
        eprintln!(
            "bench: host tax round {}/{}: untraced",
            round + 1,
            plan.rounds
        );
        // The untraced block before the next setup: the round's first,
        // then each setup's block after it, so every traced block has
        // one on each side.
        let mut base = measure_passes(&bin, plan, cpu)?;
        for (&case, &ns) in base.iter().flatten() {
            m.untraced.entry(case).or_default().push(ns);
        }
        for setup in turn.take(setups.len()) {
            eprintln!(
                "bench: host tax round {}/{}: {}, then untraced",
                round + 1,
                plan.rounds,
                setup.name
            );
            let before = tracer_like_ids()?;
            let running = start(root, setup.name, workload)?;
            let own: BTreeSet<u64> = tracer_like_ids()?.difference(&before).copied().collect();
            m.other |= other_tracer(&own, Duration::ZERO)?;
            let got = measure_passes(&bin, plan, cpu);
            if setup.name != "empty_tracepoints" && round + 1 == plan.rounds && got.is_ok() {
                stats.set(true)?;
                let pass = measure(&bin, plan.ms, cpu);
                stats.set(false)?;
                pass?;
                m.costs.insert(setup.name, program_costs(&before)?);
            }
            stop(running)?;
            let got = got?;
            for (&case, &ns) in got.iter().flatten() {
                m.traced.entry((setup.name, case)).or_default().push(ns);
            }
            let after = measure_passes(&bin, plan, cpu)?;
            for (&case, &ns) in after.iter().flatten() {
                m.untraced.entry(case).or_default().push(ns);
            }
            for (case, ratios) in paired(&base, &got, &after) {
                m.pairs
                    .entry((setup.name, case))
                    .or_default()
                    .extend(ratios);
            }
            base = after;
        }
    }
    Ok(m)
}

/// Prints the table and builds the results; the lines that break the
/// threshold come with them.
fn report(plan: &Plan, setups: &[Setup], placement: Value, m: &Measured) -> (Value, Verdicts) {
    let Measured {
        untraced,
        traced,
        pairs,
        costs,
        other,
    } = m;
    if *other {
        println!(
            "WARNING: another tracer was loaded during the runs: the figures below are taxed by it too"
        );
    }
    let mut rows = Vec::new();
    let mut verdicts = Verdicts::default();
    println!(
        "host tax: untraced processes on CPU {} (the workload and tracer on the others), ns per \
         operation (median of {} rounds x {} runs of {} ms each, alternating untraced and traced); \
         paired: median [quartiles] of each traced run against the untraced blocks right before \
         and after it (judged)",
        placement["measured_cpu"], plan.rounds, plan.passes, plan.ms
    );
    for &(case, what) in CASES {
        let base = median(&untraced[case]);
        let mut row = json!({"case": case, "what": what, "untraced_ns": base, "untraced_runs": untraced[case]});
        let mut line = format!("  {case:8} untraced {base:>10.0}");
        for setup in setups {
            let runs = &traced[&(setup.name, case)];
            let ns = median(runs);
            let ratio = ns / base;
            let ratios = &pairs[&(setup.name, case)];
            let (q1, pm, q3) = (
                quantile(ratios, 0.25),
                quantile(ratios, 0.5),
                quantile(ratios, 0.75),
            );
            row[setup.name] = json!({
                "ns": ns, "ratio": ratio, "runs": runs,
                "paired_ratio": pm, "paired_q1": q1, "paired_q3": q3, "paired_ratios": ratios,
            });
            let pct = |r: f64| (r - 1.0) * 100.0;
            line += &format!(
                " | {} {ns:.0} ({:+.1} %; paired {:+.1} % [{:+.1}, {:+.1}])",
                setup.name,
                pct(ratio),
                pct(pm),
                pct(q1),
                pct(q3)
            );
            if JUDGED.contains(&setup.name) {
                verdicts.judge(pm, bounds::HOST_TAX, |limit| {
                    format!(
                        "host tax (limit +{:.0} %): {case} ({what}) costs {:+.1} % under {} \
                         (paired median of {} runs against the untraced runs beside them, \
                         quartiles {:+.1} / {:+.1} %; medians over all runs {base:.0} -> {ns:.0} \
                         ns, {:+.1} %)",
                        pct(limit),
                        pct(pm),
                        setup.name,
                        ratios.len(),
                        pct(q1),
                        pct(q3),
                        pct(ratio)
                    )
                });
            }
        }
        println!("{line}");
        rows.push(row);
    }
    // A round of the yielding pair is two context switches: the added
    // time per switch, the floor's included.
    let per_switch: BTreeMap<&str, f64> = setups
        .iter()
        .map(|s| {
            let added = median(&traced[&(s.name, "ctxsw")]) - median(&untraced["ctxsw"]);
            (s.name, added / 2.0)
        })
        .collect();
    let list: Vec<String> = per_switch
        .iter()
        .map(|(s, ns)| format!("{s} {ns:+.0} ns"))
        .collect();
    println!("added per context switch (ctxsw / 2): {}", list.join(", "));
    // The same from the paired figure: its ratio on the untraced median.
    let per_switch_paired: BTreeMap<&str, f64> = setups
        .iter()
        .map(|s| {
            let r = quantile(&pairs[&(s.name, "ctxsw")], 0.5);
            (s.name, (r - 1.0) * median(&untraced["ctxsw"]) / 2.0)
        })
        .collect();
    let list: Vec<String> = per_switch_paired
        .iter()
        .map(|(s, ns)| format!("{s} {ns:+.0} ns"))
        .collect();
    println!(
        "added per context switch, paired (ctxsw / 2): {}",
        list.join(", ")
    );
    println!(
        "per-event cost of the tracer's programs (kernel BPF run-time statistics, mean over every run):"
    );
    for (setup, progs) in costs {
        let list: Vec<String> = progs
            .iter()
            .map(|(name, v)| {
                format!(
                    "{name} {:.0} ns x {}",
                    v["ns_per_run"].as_f64().unwrap_or(f64::NAN),
                    v["runs"]
                )
            })
            .collect();
        println!("  {setup}: {}", list.join(", "));
    }
    let setups_json: Vec<Value> = setups
        .iter()
        .map(|s| json!({"name": s.name, "what": s.what}))
        .collect();
    let results = json!({
        "rounds": plan.rounds,
        "passes": plan.passes,
        "ms_per_run": plan.ms,
        "placement": placement,
        "guard_ratio": bounds::HOST_TAX.guard,
        "goal_ratio": bounds::HOST_TAX.goal,
        "judged_setups": JUDGED,
        "judged_on": "paired_ratio",
        "setups": setups_json,
        "cases": rows,
        "program_costs": costs,
        "added_ns_per_context_switch": per_switch,
        "added_ns_per_context_switch_paired": per_switch_paired,
        "guards_broken": verdicts.broken(),
        "other_tracer_seen": other,
    });
    (results, verdicts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate() {
        assert_eq!(quantile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(quantile(&[4.0, 1.0, 2.0, 3.0], 0.5), 2.5);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.25), 2.0);
        assert_eq!(quantile(&[7.0], 0.75), 7.0);
    }

    #[test]
    fn a_traced_run_is_paired_with_the_blocks_beside_it() {
        let block = |ns: f64| -> BTreeMap<&'static str, f64> {
            CASES.iter().map(|&(c, _)| (c, ns)).collect()
        };
        // Drift from 100 to 120 around a traced block at 121 and 132: the
        // base is the mean of the sides' means (100 and 120), 110.
        let before = [block(90.0), block(110.0)];
        let after = [block(120.0)];
        let got = paired(&before, &[block(121.0), block(132.0)], &after);
        for &(case, _) in CASES {
            let r = &got[case];
            assert!(
                (r[0] - 1.1).abs() < 1e-12 && (r[1] - 1.2).abs() < 1e-12,
                "{r:?}"
            );
        }
    }
}
