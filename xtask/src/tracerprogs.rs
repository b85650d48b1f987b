//! The tracer's host-wide programs loaded from its own eBPF object, with no
//! tracer running, for the hook-toggle bench's `programs` setups: switching
//! these from none to one link measures what an untraced task pays for
//! them (0 -> 1), where switching a second link of a running tracer's
//! programs (1 -> 2) also pays the kernel's change from a direct call to
//! an iteration over the tracepoint's programs, an upper bound.
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

use anyhow::{Context as _, Result, bail};
use aya::{
    Btf, EbpfLoader,
    programs::{BtfTracePoint, RawTracePoint},
};

/// The raw-tracepoint programs of the default path, with their tracepoint.
const TCP: &[(&str, &str)] = &[
    ("tcp_sendmsg_locked", "tcp_sendmsg_locked"),
    ("tcp_rcv_space_adjust", "tcp_rcv_space_adjust"),
    ("raw_tcp_probe", "tcp_probe"),
];
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

/// Which of the tracer's host-wide programs to load.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Set {
    /// The default path's three TCP programs.
    Tcp,
    /// Those and `--sched exact`'s switch program.
    TcpAndSwitch,
    /// The send and receive programs, not the segment one: what a task
    /// outside the workload's cgroup would run if segments were seen by a
    /// program on that cgroup (not built; see the README's Limits).
    SendReceive,
}

/// The programs of `set`, loaded and not attached: (name, fd, tracepoint
/// for a raw program, `None` for the BTF one).
pub fn load(root: &Path, set: Set) -> Result<Vec<(String, OwnedFd, Option<CString>)>> {
    let bytes = std::fs::read(object(root)?)?;
    let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")?
        .trim()
        .parse()?;
    let mut ebpf = EbpfLoader::new()
        .map_max_entries("TRACED_IDS", pid_max.div_ceil(IDS_PER_SLOT))
        .load(&bytes)
        .context("loading the tracer's object")?;
    let mut out = Vec::new();
    let tcp = TCP
        .iter()
        .filter(|(name, _)| set != Set::SendReceive || *name != "raw_tcp_probe");
    for &(name, tp) in tcp {
        let Some(prog) = ebpf.program_mut(name) else {
            bail!("no program {name} in the tracer's object");
        };
        let prog: &mut RawTracePoint = prog.try_into()?;
        prog.load().with_context(|| format!("loading {name}"))?;
        let fd = prog.fd()?.as_fd().try_clone_to_owned()?;
        out.push((name.to_string(), fd, Some(CString::new(tp)?)));
    }
    if set == Set::TcpAndSwitch {
        let (name, tp) = SWITCH;
        let btf = Btf::from_sys_fs()?;
        let Some(prog) = ebpf.program_mut(name) else {
            bail!("no program {name} in the tracer's object");
        };
        let prog: &mut BtfTracePoint = prog.try_into()?;
        prog.load(tp, &btf)
            .with_context(|| format!("loading {name}"))?;
        out.push((
            name.to_string(),
            prog.fd()?.as_fd().try_clone_to_owned()?,
            None,
        ));
    }
    // The program fds hold the programs and, through them, their maps.
    Ok(out)
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
            eprintln!("skipped: needs root and a build of the tracer (its eBPF object)");
            return Ok(());
        }
        assert_eq!(load(&root, Set::SendReceive)?.len(), 2);
        let progs = load(&root, Set::TcpAndSwitch)?;
        let names: Vec<&str> = progs.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "tcp_sendmsg_locked",
                "tcp_rcv_space_adjust",
                "raw_tcp_probe",
                "btf_sched_switch"
            ]
        );
        for (name, fd, tp) in &progs {
            let link = crate::rawfloor::raw_tp_open(fd, tp.as_deref())
                .with_context(|| format!("attaching {name}"))?;
            drop(link);
        }
        Ok(())
    }
}
