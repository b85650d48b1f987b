//! What a process outside the traced tree pays per CUDA launch when it maps
//! the same libraries as the traced one (another tenant's server on the
//! same image): the workload's tight launch loop, with no tracer, with
//! `attach` tracing another (stopped) workload with its uprobes bound to
//! that tree (the default), and with `--host-wide-probes` (the old reach, as
//! the daemon's). Rounds alternate the three; medians. The bound setup may
//! add at most half an uprobe trap ([`bounds::neighbour_added_ns`]).

use std::{
    collections::BTreeSet,
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use crate::{
    attachtime::wait_for_detaches,
    bounds::{self, Verdicts},
    bpfprogs::other_tracer,
    demo::{start_tracer, wait_stopped},
};

const LAUNCHES: u32 = 200_000;

/// ns per launch of the neighbour, beside `attach` with `extra` flags
/// (None: no tracer).
fn launch_ns(root: &Path, extra: Option<&[&str]>) -> Result<f64> {
    let bin = root.join("target/fixtures/workload");
    let neighbour = || -> Result<f64> {
        let out = Command::new(&bin)
            .args(["--bench-launches", &LAUNCHES.to_string()])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().last().context("workload printed nothing")?;
        let v: Value = serde_json::from_str(line)?;
        v["ns_per_launch"].as_f64().context("no ns_per_launch")
    };
    let Some(extra) = extra else {
        return neighbour();
    };
    let mut traced = Command::new(&bin)
        .arg("--stop-before-work")
        .stdout(Stdio::null())
        .spawn()?;
    wait_stopped(traced.id())?;
    let mut args = vec![
        "--pid".to_string(),
        traced.id().to_string(),
        "--no-listen".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut tracer = start_tracer(root, "attach", &args, "attached")?;
    // The second library's probes follow the first's "attached" line.
    thread::sleep(Duration::from_millis(300));
    let ns = neighbour();
    let _ = traced.kill();
    let _ = traced.wait();
    let _ = tracer.wait();
    wait_for_detaches()?;
    ns
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `rounds` rounds; returns the results and their verdicts.
pub fn run(root: &Path, rounds: usize) -> Result<(Value, Verdicts)> {
    let (mut none, mut bound, mut host) = (Vec::new(), Vec::new(), Vec::new());
    let mut other = false;
    for _ in 0..rounds {
        // Another tracer's uprobes on the same files would tax every setup,
        // the untraced one too: wait (up to a minute) for it to go.
        other |= other_tracer(&BTreeSet::new(), Duration::from_secs(60))?;
        none.push(launch_ns(root, None)?);
        bound.push(launch_ns(root, Some(&[]))?);
        host.push(launch_ns(root, Some(&["--host-wide-probes"]))?);
    }
    let (n, b, h) = (
        median(none.clone()),
        median(bound.clone()),
        median(host.clone()),
    );
    println!(
        "a neighbour mapping the same CUDA libraries, per launch: {n:.0} ns without a tracer, \
         {b:.0} ns beside attach ({:+.1} %), {h:.0} ns beside attach --host-wide-probes \
         ({:+.0} %)",
        (b / n - 1.0) * 100.0,
        (h / n - 1.0) * 100.0
    );
    if other {
        println!(
            "WARNING: another tracer was loaded during the neighbour runs: they are taxed by it"
        );
    }
    let mut verdicts = Verdicts::default();
    verdicts.judge(b - n, bounds::neighbour_added_ns(n), |limit| {
        format!(
            "a neighbour's launch beside attach: {b:.0} ns against {n:.0} ns without a tracer \
             (limit +{limit:.0} ns)"
        )
    });
    let result = json!({
        "launches": LAUNCHES, "rounds": rounds, "other_tracer": other,
        "ns_no_tracer": n, "ns_beside_attach": b, "ns_beside_host_wide_probes": h,
        "runs_no_tracer": none, "runs_beside_attach": bound, "runs_beside_host_wide_probes": host,
    });
    Ok((result, verdicts))
}
