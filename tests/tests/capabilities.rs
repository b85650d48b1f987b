//! Root-only: `ttft-trace check` on this host, and the capability set of
//! `deploy/systemd/ttft-trace.service` proved by running the tracer under
//! exactly that set (`setpriv`, as an unprivileged user with ambient
//! capabilities and no_new_privs, as the unit's DynamicUser would), then
//! with each capability removed.

use std::{
    path::Path,
    process::{Command, Output},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use ttft_trace_tests::{
    fixtures::{self, Style, Workload},
    tracer::{ATTACHED, root_test, spawn_piped, tracer_bin},
};

const UNIT: &str = include_str!("../../deploy/systemd/ttft-trace.service");
/// Stands in for the unit's dynamic user.
const NOBODY: u32 = 65534;

/// The capabilities of a `Key=CAP_A CAP_B` line of the unit.
fn unit_list(key: &str) -> Vec<String> {
    UNIT.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(|v| v.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The unit's capabilities: its ambient set, which must equal its bounding set.
fn unit_caps() -> Vec<String> {
    let ambient = unit_list("AmbientCapabilities");
    assert!(!ambient.is_empty(), "no AmbientCapabilities= in the unit");
    assert_eq!(ambient, unit_list("CapabilityBoundingSet"));
    ambient
}

/// Mounts tracefs if this host has not, as the unit's
/// `Wants=sys-kernel-tracing.mount` does before the service starts: a fresh
/// machine may not have it yet, and without CAP_SYS_ADMIN the tracer cannot
/// mount it itself, which would fail for that reason and not the one tested.
fn tracefs_mounted_as_the_unit_wants() -> Result<()> {
    let dir = Path::new("/sys/kernel/tracing");
    if dir.join("events").is_dir() {
        return Ok(());
    }
    let status = Command::new("mount")
        .args(["-t", "tracefs", "nodev"])
        .arg(dir)
        .status()?;
    if !status.success() || !dir.join("events").is_dir() {
        bail!("cannot mount tracefs at {}: {status}", dir.display());
    }
    Ok(())
}

/// `setpriv` running the tracer with exactly `caps` (names like `CAP_BPF`),
/// as `uid` when given, with no_new_privs, on a host set up as the unit
/// expects.
fn under_caps(caps: &[String], uid: Option<u32>) -> Result<Command> {
    tracefs_mounted_as_the_unit_wants()?;
    let list: String = std::iter::once("-all".to_string())
        .chain(
            caps.iter()
                .map(|c| format!("+{}", c.to_lowercase().trim_start_matches("cap_"))),
        )
        .collect::<Vec<_>>()
        .join(",");
    let mut c = Command::new("setpriv");
    if let Some(uid) = uid {
        c.args([
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".into(),
        ]);
    }
    c.arg("--no-new-privs")
        .arg(format!("--inh-caps={list}"))
        .arg(format!("--ambient-caps={list}"))
        .arg(format!("--bounding-set={list}"))
        .arg("--")
        .arg(tracer_bin()?);
    Ok(c)
}

/// Traces a stopped workload (run by root) with the tracer under `caps`:
/// (tracer succeeded, its stdout + stderr, episodes it reported).
fn attach_under(caps: &[String], uid: Option<u32>) -> Result<(bool, String, u64)> {
    let mut workload = Workload::new(Style::Stream)
        .episodes(40)
        .gap_us(5000)
        .spawn_stopped()?;
    let mut c = under_caps(caps, uid)?;
    c.args(["attach", "--pid", &workload.id().to_string()])
        .args(["--no-listen", "--no-nvml", "--duration", "10"]);
    let (mut tracer, rx) = spawn_piped(&mut c)?;
    // Let the workload go once both stub libraries are attached, or the tracer gave up.
    let mut stderr = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while stderr
        .iter()
        .filter(|l: &&String| l.contains(ATTACHED))
        .count()
        < 2
        && tracer.try_wait()?.is_none()
        && Instant::now() < deadline
    {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
            stderr.push(line);
        }
    }
    fixtures::cont(workload.id())?;
    workload.wait_timeout(Duration::from_secs(30))?;
    let out = tracer.wait_with_output()?;
    stderr.extend(rx.try_iter());
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let episodes = stdout
        .lines()
        .find_map(|l| l.strip_prefix("GPU episodes:"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    Ok((
        out.status.success(),
        format!("{stdout}\n{}", stderr.join("\n")),
        episodes,
    ))
}

fn check_under(caps: &[String], uid: Option<u32>) -> Result<Output> {
    Ok(under_caps(caps, uid)?.arg("check").output()?)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn check_passes_here_and_lists_every_item() -> Result<()> {
    let Some(_g) = root_test("check_passes_here_and_lists_every_item") else {
        return Ok(());
    };
    let out = Command::new(tracer_bin()?).arg("check").output()?;
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for line in [
        "ok    kernel",
        "ok    btf",
        "ok    tracefs",
        "ok    uprobes",
        "ok    tracepoint sched:sched_switch",
        "ok    tracepoint sock:sock_send_length",
        "ok    send hook",
        "ok    event hook",
        "ok    tracepoint tcp:tcp_retransmit_skb",
        "ok    tracepoint fields",
        "ok    capability CAP_SYS_ADMIN",
        "ok    capability CAP_SYS_PTRACE",
        "ok    ebpf load",
        "ok    uprobe self-test",
        "tracing can work here",
    ] {
        assert!(t.contains(line), "no {line:?} in:\n{t}");
    }
    // NVML: ok with a GPU, a warning without; never a failure.
    assert!(t.contains("ok    nvml") || t.contains("warn  nvml"), "{t}");
    let json = Command::new(tracer_bin()?)
        .args(["check", "--json"])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&json.stdout)?;
    assert_eq!(v["can_trace"], true, "{v}");
    assert!(v["items"].as_array().is_some_and(|a| a.len() > 20), "{v}");
    Ok(())
}

#[test]
fn check_fails_naming_the_dropped_capability() -> Result<()> {
    let Some(_g) = root_test("check_fails_naming_the_dropped_capability") else {
        return Ok(());
    };
    // Root with every capability of the unit but CAP_SYS_ADMIN.
    let caps: Vec<String> = unit_caps()
        .into_iter()
        .filter(|c| c != "CAP_SYS_ADMIN")
        .chain(["CAP_BPF".to_string(), "CAP_PERFMON".to_string()])
        .collect();
    let out = check_under(&caps, None)?;
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("FAIL  capability CAP_SYS_ADMIN"), "{t}");
    assert!(t.contains("FAIL  uprobe self-test"), "{t}");
    assert!(t.contains("tracing cannot work here"), "{t}");
    // The programs still load with CAP_BPF + CAP_PERFMON: only uprobes are refused.
    assert!(t.contains("ok    ebpf load"), "{t}");
    Ok(())
}

#[test]
fn the_units_capabilities_are_enough_and_each_is_needed() -> Result<()> {
    let Some(_g) = root_test("the_units_capabilities_are_enough_and_each_is_needed") else {
        return Ok(());
    };
    let caps = unit_caps();
    let (ok, out, episodes) = attach_under(&caps, Some(NOBODY))?;
    eprintln!("unit set {caps:?} as uid {NOBODY}: success {ok}, {episodes} episodes");
    assert!(ok && episodes == 40, "{out}");
    let check = check_under(&caps, Some(NOBODY))?;
    assert!(check.status.success(), "{}", text(&check));

    for dropped in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != dropped).cloned().collect();
        let (ok, out, episodes) = attach_under(&fewer, Some(NOBODY))?;
        let error = out
            .lines()
            .find(|l| l.contains("error:"))
            .unwrap_or("(no error line)");
        eprintln!("without {dropped}: success {ok}, {episodes} episodes; {error}");
        assert!(
            !ok && episodes == 0,
            "still traced without {dropped}:\n{out}"
        );
        assert!(
            out.contains(dropped.as_str()),
            "the error does not name {dropped}:\n{out}"
        );
    }
    Ok(())
}

#[test]
fn the_unit_verifies() -> Result<()> {
    let Some(_g) = root_test("the_unit_verifies") else {
        return Ok(());
    };
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        if std::env::var_os("TTFT_TRACE_REQUIRE_FIXTURES").is_some() {
            bail!("systemd-analyze not found (cargo xtask setup installs systemd)");
        }
        eprintln!("SKIP the_unit_verifies: no systemd-analyze");
        return Ok(());
    }
    // The unit names the installed binary; verify a copy naming this build's.
    let bin = tracer_bin()?;
    let unit = UNIT.replace("/usr/local/bin/ttft-trace", &bin.display().to_string());
    let dir = fixtures::temp_path("unit", "d");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("ttft-trace.service");
    std::fs::write(&path, unit)?;
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .current_dir(Path::new("/"))
        .output()?;
    let _ = std::fs::remove_dir_all(&dir);
    let t = text(&out);
    // verify exits 0 on settings it ignores: any output is a finding.
    assert!(out.status.success() && t.trim().is_empty(), "{t}");
    Ok(())
}
