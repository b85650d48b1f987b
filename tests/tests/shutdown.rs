//! Root-only: a signal stops tracing promptly even while the traced
//! workload floods the ring buffer (the event loop routes a bounded batch
//! of records per turn, so signals and timers are never starved), and the
//! run still ends with its summary and totals. The process exits at once;
//! its `ttft-detach` child holds the uprobes until the kernel has taken
//! them out, and then is gone.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use ttft_trace_tests::{
    fixtures::{self, Style, Workload},
    tracer::{Tracer, root_test, uprobe_links, uprobe_programs},
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
    let programs = uprobe_programs(tracer.pid().context("tracer pid")?)?;
    let while_tracing = uprobe_links(&programs)?;
    assert!(while_tracing > 0, "bpftool shows the tracer's uprobe links");
    let sent = Instant::now();
    if let Some(tracer_pid) = tracer.pid() {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(tracer_pid as i32, libc::SIGTERM) };
    }
    tracer.wait_for_stderr("stopping (Signal)", 1, Duration::from_secs(10))?;
    let honoured = sent.elapsed();
    let out = tracer.finish(Duration::from_secs(60))?;
    let exited = out.exited_at.duration_since(sent);
    let detached = sent.elapsed();
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
    assert!(
        exited < Duration::from_secs(2),
        "exited {exited:?} after SIGTERM:\n{}",
        out.stderr
    );
    background_detach_ends(&out.stderr, detached, &programs)
}

/// The child named in the log (`detaching N probe perf events in the
/// background (process P, ...`), which `finish` waited for, was gone
/// within the kernel's ~0.1 s per uprobe of the signal (0.3 s allowed, and
/// 2 s more), and no uprobe link is left.
fn background_detach_ends(
    stderr: &str,
    detached: Duration,
    programs: &std::collections::BTreeSet<u64>,
) -> Result<()> {
    let line = stderr
        .lines()
        .find(|l| l.contains("in the background (process "))
        .ok_or_else(|| anyhow::anyhow!("no background detach logged:\n{stderr}"))?;
    let digits: String = line
        .split("detaching ")
        .nth(1)
        .unwrap_or_default()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let events: u64 = digits.parse()?;
    let allowed = Duration::from_secs(2) + Duration::from_millis(300 * events);
    eprintln!("ttft-detach ({events} perf events) gone {detached:?} after the signal");
    assert!(detached < allowed, "ttft-detach took {detached:?}");
    let left = uprobe_links(programs)?;
    assert_eq!(left, 0, "uprobe links left after ttft-detach ended");
    Ok(())
}
