//! The traced process tree: the target, its descendants, liveness.

use std::{collections::BTreeMap, fs};

/// `comm` of a process, for messages.
pub fn comm(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// Whether `id` is a live process (a thread group leader), not a thread.
/// `/proc/<tid>` resolves for threads too, hence the Tgid check.
pub fn is_process(id: u32) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{id}/status")) else {
        return false;
    };
    status_field(&status, "Tgid:") == Some(id) && status_field(&status, "State:").is_none()
}

/// A numeric field of /proc/PID/status; `State:` is returned only for a
/// zombie or dead process (`Z`/`X`), so `is_none()` means "running".
pub fn status_field(status: &str, key: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let value = line[key.len()..].trim();
    if key == "State:" {
        return (value.starts_with('Z') || value.starts_with('X')).then_some(0);
    }
    value.parse().ok()
}

/// Parent pid from the text of /proc/PID/stat. The command name may hold
/// spaces and parentheses, so parse after the last `)`.
pub fn parent_from_stat(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Parent of `pid`, from /proc/PID/stat.
pub fn parent(pid: u32) -> Option<u32> {
    parent_from_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// When `pid` started, on CLOCK_MONOTONIC (from /proc/PID/stat `starttime`,
/// clock ticks since boot on CLOCK_BOOTTIME, moved to MONOTONIC by the
/// suspended time).
pub fn start_time_ns(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the command: state is field 3 of the line, starttime field 22.
    let ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|&h| h > 0)?;
    let boot_ns = ticks.checked_mul(1_000_000_000)? / hz;
    let suspended =
        crate::host::clock::boottime_ns().saturating_sub(crate::host::clock::monotonic_ns());
    Some(boot_ns.saturating_sub(suspended))
}

/// Every live descendant of `root` (not `root` itself), from one pass over /proc.
pub fn descendants(root: u32) -> Vec<u32> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(ppid) = fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .as_deref()
            .and_then(parent_from_stat)
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for &c in children.get(&p).map(Vec::as_slice).unwrap_or_default() {
            if !out.contains(&c) && c != root {
                out.push(c);
                stack.push(c);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let stat = "1234 (python3 (x) y) S 77 1234 1234 0 -1 4194560";
        assert_eq!(parent_from_stat(stat), Some(77));
        assert_eq!(parent_from_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_a_process_and_its_child_a_descendant() {
        let me = std::process::id();
        assert!(is_process(me));
        assert!(!is_process(u32::MAX));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("spawn sleep");
        let found = descendants(me).contains(&child.id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(found, "child {} not among descendants", child.id());
        assert!(comm(me).is_some());
        let started = start_time_ns(me).expect("start time");
        let now = crate::host::clock::monotonic_ns();
        assert!(
            started <= now && now - started < 3_600_000_000_000,
            "{started} vs {now}"
        );
    }

    #[test]
    fn zombie_state_is_not_alive() {
        let status = "Name:\tx\nState:\tZ (zombie)\nTgid:\t5\n";
        assert_eq!(status_field(status, "Tgid:"), Some(5));
        assert!(status_field(status, "State:").is_some());
        let running = "Name:\tx\nState:\tS (sleeping)\nTgid:\t5\n";
        assert!(status_field(running, "State:").is_none());
    }
}
