//! The BPF programs loaded on the host, as bpftool lists them: the tracer's
//! (or another tracer's, which taxes every run of a bench) and their cost
//! per run from the kernel's run-time statistics.

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use crate::rawfloor;

/// The tracer's programs whose per-run cost is reported.
const PROGRAMS: &[&str] = &[
    "btf_sched_switch",
    "btf_sched_wakeup",
    "btf_sched_wakeup_new",
    "raw_sock_send_length",
    "raw_sock_recv_length",
    "sched_switch",
    "sched_wakeup",
    "sched_wakeup_new",
    "tcp_probe",
    "raw_tcp_probe",
    "sock_send_length",
    "sock_recv_length",
    "tcp_sendmsg_locked",
    "tcp_rcv_space_adjust",
    "sys_enter_write",
    "sys_exit_send",
    rawfloor::NAME,
];

/// The BPF programs loaded now (bpftool's JSON objects).
fn programs() -> Result<Vec<Value>> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "--json"])
        .output()
        .context("running bpftool (cargo xtask setup installs it)")?;
    let progs: Value = serde_json::from_slice(&out.stdout)?;
    Ok(progs.as_array().cloned().unwrap_or_default())
}

/// Ids of the loaded programs named like the tracer's: another tracer on the
/// host (another ttft-trace, above all one with the syscall hook) taxes
/// every run, so runs are made only when none is loaded.
pub(crate) fn tracer_like_ids() -> Result<BTreeSet<u64>> {
    Ok(programs()?
        .iter()
        .filter(|p| PROGRAMS.contains(&p["name"].as_str().unwrap_or("")))
        .filter_map(|p| p["id"].as_u64())
        .collect())
}

/// Whether a tracer-like program other than `own` is loaded: another
/// tracer on the host taxes every run, untraced or not (the ratios then
/// understate the tax). Waits up to `wait` for it to go.
pub fn other_tracer(own: &BTreeSet<u64>, wait: Duration) -> Result<bool> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        if tracer_like_ids()?.is_subset(own) {
            return Ok(false);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(true);
        }
        thread::sleep(Duration::from_secs(1));
    }
}

/// Mean ns per run of each of the tracer's programs loaded since `before`,
/// from the kernel's run-time statistics.
pub(crate) fn program_costs(before: &BTreeSet<u64>) -> Result<BTreeMap<String, Value>> {
    let mut costs = BTreeMap::new();
    for p in programs()? {
        let name = p["name"].as_str().unwrap_or("");
        if !PROGRAMS.contains(&name) || p["id"].as_u64().is_none_or(|id| before.contains(&id)) {
            continue;
        }
        let (Some(t), Some(n)) = (p["run_time_ns"].as_u64(), p["run_cnt"].as_u64()) else {
            continue;
        };
        if n > 0 {
            costs.insert(
                name.to_string(),
                json!({"runs": n, "ns_per_run": t as f64 / n as f64}),
            );
        }
    }
    Ok(costs)
}

/// Sets the kernel's BPF run-time statistics while alive (off for the
/// measured runs, on for the cost pass), and restores the previous setting
/// when dropped.
pub(crate) struct BpfStats(String);

impl BpfStats {
    const PATH: &'static str = "/proc/sys/kernel/bpf_stats_enabled";

    pub(crate) fn new() -> Result<Self> {
        let old = std::fs::read_to_string(Self::PATH)?.trim().to_string();
        let stats = Self(old);
        stats.set(false)?;
        Ok(stats)
    }

    pub(crate) fn set(&self, on: bool) -> Result<()> {
        std::fs::write(Self::PATH, if on { "1" } else { "0" })?;
        Ok(())
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, &self.0);
    }
}
