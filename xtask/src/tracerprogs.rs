//! The tracer's programs that other tasks meet, loaded from its own eBPF
//! object with no tracer running, for the hook-toggle bench's `programs`
//! setups: switching these from none to one link measures what an untraced
//! task pays for them (0 -> 1), where switching a second link of a running
//! tracer's programs (1 -> 2) also pays the kernel's change from a direct
//! call to an iteration over the tracepoint's programs, an upper bound.
//! The default path's segment program is linked to an empty cgroup: an
//! untraced task's sockets never run it, and what the link costs them is
//! the kernel's check of their own cgroup (switched on with the first
//! ingress program anywhere on the host).
//!
//! Loaded as an untraced task sees them: `TRACED_IDS` sized to this host's
//! `pid_max` and all zero, so each program stops where it does for a task
//! the tracer does not trace (a missing slot would read as "maybe traced"
//! and take the hash lookups of a traced one). The layout globals (BTF
//! offsets) stay zero: an untraced task's path reads none of them but the
//! segment program's local port, which it then reads at another offset of
//! the same socket, at the same cost.

use std::{
    ffi::CString,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use aya::{
    Btf, EbpfLoader,
    programs::{BtfTracePoint, CgroupSkb, RawTracePoint},
};

/// The send and receive programs (raw tracepoints, host-wide on every
/// path), with their tracepoint.
const SEND_RECEIVE: &[(&str, &str)] = &[
    ("tcp_sendmsg_locked", "tcp_sendmsg_locked"),
    ("tcp_rcv_space_adjust", "tcp_rcv_space_adjust"),
];
/// The segment program of the host-wide path.
const RAW_SEGMENTS: (&str, &str) = ("raw_tcp_probe", "tcp_probe");
/// The segment program of the default path (`cgroup_skb` ingress).
const CGROUP_SEGMENTS: &str = "skb_segment";
/// `--sched exact`'s switch program (BTF: it names its own tracepoint).
const SWITCH: (&str, &str) = ("btf_sched_switch", "sched_switch");
/// Ids per `TRACED_IDS` element, as the probes lay them out.
const IDS_PER_SLOT: u32 = 4096;

/// The object the tracer embeds: the newest one a build of it made (the
/// eBPF object is built in release for either profile of the tracer).
fn object(root: &Path) -> Result<PathBuf> {
    ["target/release/build", "target/debug/build"]
        .iter()
        .filter_map(|dir| std::fs::read_dir(root.join(dir)).ok())
        .flat_map(|entries| entries.flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with("ttft-trace-"))
        .map(|e| e.path().join("out/ttft-trace-probes"))
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .context("no ttft-trace-probes object under target/*/build (build the tracer)")
}

/// Which of the tracer's programs to load.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Set {
    /// The default path, for a task outside the traced workloads' cgroups:
    /// the send and receive programs, and the segment program on a cgroup
    /// none of the task's sockets is in (what the task pays for it is the
    /// kernel's check of its own cgroup).
    Default,
    /// Those and `--sched exact`'s switch program.
    DefaultAndSwitch,
    /// The host-wide path (a workload in the root cgroup, `--port`, the
    /// self-check's fallback): the send and receive programs and
    /// `raw_tcp_probe`.
    HostWide,
}

/// Where a loaded program is attached.
pub enum Target {
    /// A raw tracepoint, by name; `None` for a BTF program (it names its
    /// own).
    Tracepoint(Option<CString>),
    /// A cgroup's ingress.
    CgroupIngress,
}

/// The programs of `set`, loaded and not attached: (name, fd, target).
pub fn load(root: &Path, set: Set) -> Result<Vec<(String, OwnedFd, Target)>> {
    let bytes = std::fs::read(object(root)?)?;
    let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")?
        .trim()
        .parse()?;
    let mut ebpf = EbpfLoader::new()
        .map_max_entries("TRACED_IDS", pid_max.div_ceil(IDS_PER_SLOT))
        .load(&bytes)
        .context("loading the tracer's object")?;
    let mut out = Vec::new();
    let mut raw = SEND_RECEIVE.to_vec();
    if set == Set::HostWide {
        raw.push(RAW_SEGMENTS);
    }
    for (name, tp) in raw {
        let prog: &mut RawTracePoint = program(&mut ebpf, name)?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
        let fd = prog.fd()?.as_fd().try_clone_to_owned()?;
        out.push((
            name.to_string(),
            fd,
            Target::Tracepoint(Some(CString::new(tp)?)),
        ));
    }
    if set != Set::HostWide {
        let name = CGROUP_SEGMENTS;
        let prog: &mut CgroupSkb = program(&mut ebpf, name)?.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
        let fd = prog.fd()?.as_fd().try_clone_to_owned()?;
        out.push((name.to_string(), fd, Target::CgroupIngress));
    }
    if set == Set::DefaultAndSwitch {
        let (name, tp) = SWITCH;
        let btf = Btf::from_sys_fs()?;
        let prog: &mut BtfTracePoint = program(&mut ebpf, name)?.try_into()?;
        prog.load(tp, &btf)
            .with_context(|| format!("loading {name}"))?;
        out.push((
            name.to_string(),
            prog.fd()?.as_fd().try_clone_to_owned()?,
            Target::Tracepoint(None),
        ));
    }
    // The program fds hold the programs and, through them, their maps.
    Ok(out)
}

fn program<'a>(ebpf: &'a mut aya::Ebpf, name: &str) -> Result<&'a mut aya::programs::Program> {
    ebpf.program_mut(name)
        .with_context(|| format!("no program {name} in the tracer's object"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The programs load from the tracer's object and attach (root, and a
    /// build of the tracer, only).
    #[test]
    fn the_tracers_programs_load_and_attach() -> Result<()> {
        let root = crate::process::repo_root()?;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || object(&root).is_err() {
            let why = "needs root and a build of the tracer (its eBPF object)";
            assert!(
                std::env::var_os("TTFT_TRACE_REQUIRE_FIXTURES").is_none(),
                "the_tracers_programs_load_and_attach: {why}, and TTFT_TRACE_REQUIRE_FIXTURES is set"
            );
            eprintln!("SKIP the_tracers_programs_load_and_attach: {why}");
            return Ok(());
        }
        let names = |set| -> Result<Vec<String>> {
            Ok(load(&root, set)?.into_iter().map(|p| p.0).collect())
        };
        assert_eq!(
            names(Set::HostWide)?,
            [
                "tcp_sendmsg_locked",
                "tcp_rcv_space_adjust",
                "raw_tcp_probe"
            ]
        );
        assert_eq!(
            names(Set::Default)?,
            ["tcp_sendmsg_locked", "tcp_rcv_space_adjust", "skb_segment"]
        );
        let cgroup = crate::cgroup2::BenchCgroup::new("ttft-bench-test-empty")?;
        for (name, fd, target) in load(&root, Set::DefaultAndSwitch)? {
            let link = match target {
                Target::Tracepoint(tp) => crate::rawfloor::raw_tp_open(&fd, tp.as_deref()),
                Target::CgroupIngress => crate::cgroup2::link(
                    &fd,
                    cgroup.file(),
                    crate::cgroup2::BPF_CGROUP_INET_INGRESS,
                ),
            }
            .with_context(|| format!("attaching {name}"))?;
            drop(link);
        }
        Ok(())
    }
}
