//! Root-only: in `attach` mode, a process outside the traced tree that maps
//! the same CUDA libraries takes no trap: the uprobes are bound to the traced
//! processes, so the kernel plants no breakpoint in the other's memory and
//! the probe programs never run for it.
//!
//! What is counted: the run count of every uprobe program the tracer holds
//! (`run_cnt` in the kernel's fdinfo of each program, with run statistics
//! enabled for the test's duration by `BPF_ENABLE_STATS`). A trap on a probed
//! function runs its program (the in-kernel filter of untraced processes
//! comes after), so no trap means no run.

use std::{
    fs,
    os::fd::{FromRawFd, OwnedFd},
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use ttft_trace_tests::{
    fixtures::{self, Style, Workload},
    tracer::{Tracer, root_test, uprobe_program_infos},
};

/// `bpf(2)` command `BPF_ENABLE_STATS`, statistics type `BPF_STATS_RUN_TIME`
/// (uapi `linux/bpf.h`).
const BPF_ENABLE_STATS: libc::c_long = 32;
const BPF_STATS_RUN_TIME: u32 = 0;

/// Run statistics on while the returned descriptor is open.
fn enable_run_stats() -> Result<OwnedFd> {
    let mut attr = [0u8; 128];
    attr[..4].copy_from_slice(&BPF_STATS_RUN_TIME.to_ne_bytes());
    // SAFETY: bpf(2) reads `size` bytes of `attr`, which outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_ENABLE_STATS,
            attr.as_ptr(),
            attr.len() as u32,
        )
    };
    if fd < 0 {
        bail!("BPF_ENABLE_STATS: {}", std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The summed run count of the uprobe programs process `pid` holds.
fn uprobe_runs(pid: u32) -> Result<u64> {
    Ok(uprobe_program_infos(pid)?.iter().map(|p| p.run_cnt).sum())
}

/// Attaches to a stopped workload (`extra` flags), runs another workload
/// on the same libraries outside its tree, then lets the traced one run.
/// Returns (runs during the other's launches, runs during the traced
/// one's, the other's launch calls, the traced one's episodes as traced).
fn neighbour_runs(extra: &[&str]) -> Result<(u64, u64, u64, usize)> {
    let traced = Workload::new(Style::Sync).episodes(20).spawn_stopped()?;
    let mut args = vec!["--pid".to_string(), traced.id().to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    let tracer = Tracer::start(&args, 2)?;
    let tracer_pid = tracer.pid().context("tracer pid")?;
    let _stats = enable_run_stats()?;

    let before = uprobe_runs(tracer_pid)?;
    let truth = fixtures::temp_path("truth", "jsonl");
    let other = Workload::new(Style::Sync)
        .episodes(50)
        .gap_us(100)
        .truth(&truth)
        .run()?
        .ensure_success()?;
    let _ = fs::remove_file(&truth);
    let other_calls: u64 = other.truth.iter().map(|e| e.kernel_launches).sum();
    ensure!(other_calls > 0, "the neighbour launched nothing");
    let during_other = uprobe_runs(tracer_pid)? - before;

    let before = uprobe_runs(tracer_pid)?;
    fixtures::cont(traced.id())?;
    let mut traced = traced;
    traced.wait_timeout(Duration::from_secs(30))?;
    let during_traced = uprobe_runs(tracer_pid)? - before;
    let out = tracer.finish(Duration::from_secs(20))?;
    ensure!(out.success, "tracer failed:\n{}", out.stderr);
    Ok((
        during_other,
        during_traced,
        other_calls,
        out.episodes().len(),
    ))
}

#[test]
fn a_process_outside_the_tree_takes_no_trap() -> Result<()> {
    let Some(_g) = root_test("a_process_outside_the_tree_takes_no_trap") else {
        return Ok(());
    };
    let (other, traced, other_calls, episodes) = neighbour_runs(&[])?;
    eprintln!(
        "probes bound to the traced tree: {other} program runs for the neighbour's \
         {other_calls} launches, {traced} for the traced workload's 20 episodes"
    );
    ensure!(
        other == 0,
        "{other} probe runs for a process outside the tree"
    );
    // The count does move for the traced process: the check could fail.
    ensure!(traced > 0, "no probe run for the traced workload");
    ensure!(episodes == 20, "{episodes} of 20 episodes traced");

    // Host-wide probes (the daemon's, or `--host-wide-probes`): the same
    // neighbour traps on every probed call.
    let (other, _, other_calls, episodes) = neighbour_runs(&["--host-wide-probes"])?;
    eprintln!("host-wide probes: {other} program runs for the neighbour's {other_calls} launches");
    ensure!(
        other >= other_calls,
        "host-wide: {other} runs for {other_calls} launches"
    );
    ensure!(episodes == 20, "{episodes} of 20 episodes traced");
    Ok(())
}
