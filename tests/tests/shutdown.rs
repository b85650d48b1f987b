//! Root-only: a signal stops tracing promptly even while the traced
//! workload floods the ring buffer (the event loop routes a bounded batch
//! of records per turn, so signals and timers are never starved), and the
//! run still ends with its summary and totals.

use std::time::{Duration, Instant};

use anyhow::Result;
use ttft_trace_tests::{
    fixtures::{self, Style, Workload},
    tracer::{Tracer, root_test},
};

#[test]
fn sigterm_is_honoured_under_an_event_flood() -> Result<()> {
    let name = "sigterm_is_honoured_under_an_event_flood";
    let Some(_serial) = root_test(name) else {
        return Ok(());
    };
    // Episodes back to back (no device time, no gap), every scheduler
    // spell an event, and a ring buffer of one page: the kernel writes as
    // fast as this workload can call, and drops what does not fit.
    let mut child = Workload::new(Style::Sync)
        .episodes(50_000_000)
        .launches(1)
        .kernel_us(0)
        .gap_us(0)
        .spawn_stopped()?;
    let pid = child.id().to_string();
    let args: Vec<String> = [
        "--pid",
        &pid,
        "--no-nvml",
        "--sched-min-us",
        "0",
        "--ringbuf-bytes",
        "4096",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracer = Tracer::start(&args, 1)?;
    fixtures::cont(child.id())?;
    std::thread::sleep(Duration::from_secs(2));
    let sent = Instant::now();
    if let Some(tracer_pid) = tracer.pid() {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(tracer_pid as i32, libc::SIGTERM) };
    }
    tracer.wait_for_stderr("stopping (Signal)", 1, Duration::from_secs(10))?;
    let honoured = sent.elapsed();
    let out = tracer.finish(Duration::from_secs(60))?;
    let exited = sent.elapsed();
    if let Some(c) = child.child_mut() {
        c.kill()?;
    }
    let _ = child.wait_timeout(Duration::from_secs(5));
    let totals = out.lines.iter().find(|l| l["type"] == "totals").cloned();
    let episodes = totals
        .as_ref()
        .and_then(|t| t["episodes_ok"].as_u64())
        .unwrap_or(0);
    let lost = totals
        .as_ref()
        .and_then(|t| t["events_lost"].as_u64())
        .unwrap_or(0);
    eprintln!(
        "SIGTERM honoured after {honoured:?}, exited after {exited:?} (probes detached); \
         {episodes} episodes traced and {lost} events lost in the kernel in ~2 s"
    );
    assert!(out.success, "tracer failed:\n{}", out.stderr);
    assert!(
        honoured < Duration::from_secs(2),
        "SIGTERM took {honoured:?} to stop the loop"
    );
    assert!(totals.is_some(), "the totals line is written");
    assert!(
        out.stdout.contains("== ttft-trace:"),
        "the final summary is printed:\n{}",
        out.stdout
    );
    assert!(episodes > 1000, "the flood was traced: {episodes} episodes");
    Ok(())
}
