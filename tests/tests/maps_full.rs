//! Root-only: a full eBPF map is counted and warned about, never the end
//! of the daemon. `LISTEN_PORTS` holds 1024 ports; the daemon is asked to
//! follow more, and keeps tracing.

use std::time::Duration;

use anyhow::Result;
use ttft_trace_tests::{
    fixtures::{Style, Variant, Workload, temp_path},
    tracer::{Tracer, root_test},
};

/// Entries of `LISTEN_PORTS` (ttft-trace-ebpf/src/maps.rs).
const LISTEN_PORTS_MAX: u16 = 1024;
const EXTRA: u16 = 6;

#[test]
fn a_full_listen_ports_map_is_counted_not_fatal() -> Result<()> {
    let Some(_g) = root_test("a_full_listen_ports_map_is_counted_not_fatal") else {
        return Ok(());
    };
    let mut args: Vec<String> = [
        "--rescan-ms",
        "200",
        "--no-nvml",
        "--interval",
        "60",
        "--comm",
        "^workload$",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for port in 0..LISTEN_PORTS_MAX + EXTRA {
        args.push("--port".into());
        args.push((20_000 + port).to_string());
    }
    let mut tracer = Tracer::start_daemon(&args)?;
    let truth = temp_path("maps-full-truth", "jsonl");
    let w = Workload::new(Style::Sync)
        .variant(Variant::Linked)
        .episodes(20)
        .gap_us(5_000)
        .stop_before_work(true)
        .truth(&truth);
    let mut child = w.spawn_stopped()?;
    let pid = child.id();
    tracer.wait_for_stderr(
        &format!("tracing workload pid {pid} "),
        1,
        Duration::from_secs(20),
    )?;
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let st = child.wait_timeout(Duration::from_secs(30))?;
    assert!(st.success(), "{st}");
    tracer.wait_for_stderr("has exited", 1, Duration::from_secs(10))?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    let _ = std::fs::remove_file(&truth);
    assert!(out.success, "the daemon ended badly:\n{}", out.stderr);
    let refused = out
        .stderr
        .lines()
        .filter(|l| l.contains("eBPF map LISTEN_PORTS is full"))
        .count();
    assert_eq!(refused, usize::from(EXTRA), "{}", out.stderr);
    let traced = out.episodes().iter().filter(|e| e.pid == pid).count();
    assert_eq!(traced, 20, "the workload is traced all the same");
    Ok(())
}
