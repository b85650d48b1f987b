//! The event hook: how the programs that run for every context switch,
//! wakeup and (with the syscall send hook only) socket call on the host are
//! attached. BTF tracepoints for the scheduler (the tracepoint's own
//! `struct task_struct *` arguments, read in place at offsets from the
//! kernel's BTF), raw tracepoints for the socket lengths (`struct sock *`
//! and two integers, no memory read) and for `tcp_probe` (the socket and
//! the segment, read only for followed connections) by default; the
//! classic tracepoints,
//! which fill a perf record of every event before the program runs, where
//! the kernel lacks BTF or the prototypes differ.

use super::ProbeError;
use aya::{
    Btf, Ebpf,
    programs::{BtfTracePoint, RawTracePoint},
};

/// How the per-event programs are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventHook {
    /// BTF and raw tracepoints: untraced tasks pay the tracepoint's
    /// dispatch and one byte read per task (`TRACED_IDS`).
    Raw,
    /// Classic tracepoints: on top, the kernel fills the tracepoint's perf
    /// record of every switch, wakeup and socket call. The fallback.
    Tracepoints,
}

impl EventHook {
    pub fn describe(self) -> &'static str {
        match self {
            EventHook::Raw => {
                "BTF tracepoints sched_switch (wakeups from the task's sched_info; \
                 sched_wakeup, sched_wakeup_new on kernels without it) and, with the syscall \
                 send hook, raw tracepoints sock_send_length, sock_recv_length (the kernel's \
                 arguments, offsets from BTF); tcp_probe as a raw tracepoint where BTF has its \
                 prototype"
            }
            EventHook::Tracepoints => {
                "classic tracepoints sched:sched_switch, sched_wakeup, sched_wakeup_new, \
                 tcp:tcp_probe and, with the syscall send hook, sock:sock_send_length, \
                 sock_recv_length (fallback: the kernel fills a perf record of every context \
                 switch, wakeup, TCP segment and socket call first)"
            }
        }
    }
}

/// Forces the event hook, for comparing them (`cargo xtask bench`) and
/// testing the fallbacks: `tracepoints`, `btf-wakeups` (BTF tracepoints
/// with the wakeup programs, as on kernels without `sched_info`) or `btf`
/// (the default).
pub const EVENT_HOOK_ENV: &str = "TTFT_TRACE_EVENT_HOOK";

/// How a program of the default hook attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `tp_btf`: typed arguments the program may read in place.
    Btf,
    /// `raw_tracepoint`: the arguments as plain integers.
    Raw,
}

/// The per-event programs: (classic program, default program, how it
/// attaches, tracepoint). The classic ones are in [`super::TRACEPOINTS`]
/// too, under the tracepoint's category.
const HOT: &[(&str, &str, Kind, &str)] = &[
    (
        "sched_switch",
        "btf_sched_switch",
        Kind::Btf,
        "sched_switch",
    ),
    (
        "sched_wakeup",
        "btf_sched_wakeup",
        Kind::Btf,
        "sched_wakeup",
    ),
    (
        "sched_wakeup_new",
        "btf_sched_wakeup_new",
        Kind::Btf,
        "sched_wakeup_new",
    ),
    (
        "sock_send_length",
        "raw_sock_send_length",
        Kind::Raw,
        "sock_send_length",
    ),
    (
        "sock_recv_length",
        "raw_sock_recv_length",
        Kind::Raw,
        "sock_recv_length",
    ),
    ("tcp_probe", "raw_tcp_probe", Kind::Raw, "tcp_probe"),
];

/// Which of the default programs [`attach_default`] attaches.
pub(super) struct Wanted {
    /// The socket lengths: the syscall send hook's.
    pub socket_lengths: bool,
    /// The context switches: not with `--sched sampled`.
    pub switches: bool,
    /// The wakeups: on kernels without `sched_info`.
    pub wakeups: bool,
    /// `tcp_probe`: where its BTF offsets were read.
    pub segments: bool,
    /// Segments seen on the workloads' cgroups instead, with `tcp_probe`
    /// kept for the fallback ([`super::segment_scope`]).
    pub scoped_segments: bool,
}

impl Wanted {
    /// Whether the default hook stands in for the classic `program`: all
    /// but `tcp_probe` without its offsets (the wakeups without their
    /// programs are read from `sched_info`; the socket lengths not wanted
    /// are not needed at all).
    fn covers(&self, classic: &str) -> bool {
        classic != "tcp_probe" || self.segments
    }

    fn wants(&self, classic: &str) -> bool {
        match classic {
            "sock_send_length" | "sock_recv_length" => self.socket_lengths,
            "sched_wakeup" | "sched_wakeup_new" => self.wakeups,
            "sched_switch" => self.switches,
            "tcp_probe" => self.segments && !self.scoped_segments,
            _ => true,
        }
    }
}

/// An attached program of the default hook.
enum Link {
    Btf(aya::programs::tp_btf::BtfTracePointLinkId),
    Raw(aya::programs::raw_trace_point::RawTracePointLinkId),
}

/// Loads and attaches every default program of [`HOT`] that `wanted`
/// asks for, or none: on a failure the ones attached are detached again, so
/// that the classic programs can take over without an event counted twice.
/// Returns how many it attached, and the classic programs the hook stands
/// in for.
pub(super) fn attach_default(
    ebpf: &mut Ebpf,
    wanted: &Wanted,
) -> Result<(usize, Vec<&'static str>), ProbeError> {
    let btf = Btf::from_sys_fs().map_err(|e| {
        ProbeError::Program("btf_sched_switch", aya::programs::ProgramError::Btf(e))
    })?;
    let mut links = Vec::new();
    let mut result = Ok(());
    for &(classic, name, kind, tracepoint) in HOT {
        if !wanted.wants(classic) {
            continue;
        }
        match attach_one(ebpf, &btf, name, kind, tracepoint) {
            Ok(link) => links.push((name, link)),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if let Err(e) = result {
        for (name, link) in links {
            let _ = match link {
                Link::Btf(link) => program::<BtfTracePoint>(ebpf, name).map(|p| p.detach(link)),
                Link::Raw(link) => program::<RawTracePoint>(ebpf, name).map(|p| p.detach(link)),
            };
        }
        return Err(e);
    }
    let covered = HOT
        .iter()
        .map(|&(classic, _, _, _)| classic)
        .filter(|classic| wanted.covers(classic))
        .collect();
    Ok((links.len(), covered))
}

fn program<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, ProbeError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|e| ProbeError::Program(name, e))
}

fn attach_one(
    ebpf: &mut Ebpf,
    btf: &Btf,
    name: &'static str,
    kind: Kind,
    tracepoint: &str,
) -> Result<Link, ProbeError> {
    let err = |e| ProbeError::Program(name, e);
    match kind {
        Kind::Btf => {
            let prog = program::<BtfTracePoint>(ebpf, name)?;
            if prog.fd().is_err() {
                prog.load(tracepoint, btf).map_err(err)?;
            }
            prog.attach().map(Link::Btf).map_err(err)
        }
        Kind::Raw => attach_raw(ebpf, name, tracepoint).map(Link::Raw),
    }
}

fn attach_raw(
    ebpf: &mut Ebpf,
    name: &'static str,
    tracepoint: &str,
) -> Result<aya::programs::raw_trace_point::RawTracePointLinkId, ProbeError> {
    let err = |e| ProbeError::Program(name, e);
    let prog = program::<RawTracePoint>(ebpf, name)?;
    if prog.fd().is_err() {
        prog.load().map_err(err)?;
    }
    prog.attach(tracepoint).map_err(err)
}

/// Attaches the raw `tcp_probe` program, host-wide: the segments' fallback
/// from the workloads' cgroups.
pub(super) fn attach_raw_segments(
    ebpf: &mut Ebpf,
) -> Result<aya::programs::raw_trace_point::RawTracePointLinkId, ProbeError> {
    attach_raw(ebpf, "raw_tcp_probe", "tcp_probe")
}

/// Detaches the raw `tcp_probe` program attached by [`attach_raw_segments`].
pub(super) fn detach_raw_segments(
    ebpf: &mut Ebpf,
    link: aya::programs::raw_trace_point::RawTracePointLinkId,
) -> Result<(), ProbeError> {
    let name = "raw_tcp_probe";
    program::<RawTracePoint>(ebpf, name)?
        .detach(link)
        .map_err(|e| ProbeError::Program(name, e))
}
