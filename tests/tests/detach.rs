//! Root-only: the daemon detaches the probes of a library no traced process
//! maps any more (after `--detach-unmapped`), so a host where CUDA
//! processes come and go does not keep probes on files no one uses, and
//! attaches again when a process maps the file anew.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use ttft_trace_tests::{
    fixtures::{Style, Variant, Workload},
    tracer::{Tracer, root_test, uprobe_links, uprobe_programs},
};

/// One workload run to its end under the daemon; returns its pid.
fn run_workload(tracer: &mut Tracer, programs: &BTreeSet<u64>, round: usize) -> Result<u32> {
    let mut child = Workload::new(Style::Sync)
        .variant(Variant::Hashed)
        .episodes(10)
        .gap_us(2_000)
        .stop_before_work(true)
        .spawn_stopped()?;
    let pid = child.id();
    tracer.wait_for_stderr(
        &format!("tracing workload pid {pid} "),
        1,
        Duration::from_secs(20),
    )?;
    let attached = uprobe_links(programs)?;
    ensure!(
        attached > 0,
        "round {round}: the library's uprobes are attached"
    );
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let st = child.wait_timeout(Duration::from_secs(30))?;
    ensure!(st.success(), "{st}");
    Ok(pid)
}

#[test]
fn probes_of_a_library_no_one_maps_are_detached() -> Result<()> {
    let Some(_g) = root_test("probes_of_a_library_no_one_maps_are_detached") else {
        return Ok(());
    };
    let args = [
        "--rescan-ms",
        "200",
        "--no-nvml",
        "--detach-unmapped",
        "2",
        "--comm",
        "^workload_hashed$",
    ]
    .map(String::from);
    let mut tracer = Tracer::start_daemon(&args)?;
    let programs = uprobe_programs(tracer.pid().context("daemon pid")?)?;
    let mut pids = Vec::new();
    for round in 1..=2 {
        pids.push(run_workload(&mut tracer, &programs, round)?);
        // Its libraries (the runtime and the driver) are detached once no
        // traced process has mapped them for 2 s.
        tracer.wait_for_stderr(
            "no traced process maps it any more",
            2 * round,
            Duration::from_secs(20),
        )?;
        // The kernel removes the uprobes on a thread of the daemon's
        // (about 0.1 s each).
        let started = Instant::now();
        while uprobe_links(&programs)? > 0 {
            ensure!(
                started.elapsed() < Duration::from_secs(15),
                "round {round}: {} uprobe links left",
                uprobe_links(&programs)?
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let out = tracer.interrupt(Duration::from_secs(30))?;
    ensure!(out.success, "{}", out.stderr);
    let kinds = |kind: &str| out.lines.iter().filter(|l| l["type"] == kind).count();
    ensure!(
        (kinds("attach"), kinds("detach")) == (4, 4),
        "attached twice and detached twice, runtime and driver: {} attach, {} detach lines",
        kinds("attach"),
        kinds("detach")
    );
    let episodes = out.episodes();
    for pid in pids {
        let traced = episodes.iter().filter(|e| e.pid == pid).count();
        ensure!(
            traced == 10,
            "workload {pid}: {traced} of 10 episodes traced"
        );
    }
    Ok(())
}
