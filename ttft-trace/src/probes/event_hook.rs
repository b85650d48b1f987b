//! The event hook: how the programs that run for every context switch,
//! wakeup and (with the syscall send hook only) socket call on the host are
//! attached. BTF tracepoints for the scheduler (the tracepoint's own
//! `struct task_struct *` arguments, read in place at offsets from the
//! kernel's BTF) and raw tracepoints for the socket lengths (`struct sock *`
//! and two integers, no memory read) by default; the classic tracepoints,
//! which fill a perf record of every event before the program runs, where
//! the kernel lacks BTF or the prototypes differ.

use aya::{
    Btf, Ebpf,
    programs::{BtfTracePoint, RawTracePoint},
};
use ttft_trace_common::offsets::{ABSENT, TaskOffsets};

use super::{ProbeError, btf};

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
                 arguments, offsets from BTF)"
            }
            EventHook::Tracepoints => {
                "classic tracepoints sched:sched_switch, sched_wakeup, sched_wakeup_new and, with \
                 the syscall send hook, sock:sock_send_length, sock_recv_length (fallback: the \
                 kernel fills a perf record of every context switch, wakeup and socket call \
                 first)"
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
];

fn is_wakeup(program: &str) -> bool {
    matches!(program, "sched_wakeup" | "sched_wakeup_new")
}

/// Whether `program` is a classic program that the default hook replaces.
pub(super) fn is_hot(program: &str) -> bool {
    HOT.iter().any(|&(classic, _, _, _)| classic == program)
}

/// The event hook this host gets, with the BTF offsets it needs, or why the
/// fallback is used.
pub fn event_hook_plan() -> Result<TaskOffsets, String> {
    let mut wakeup_programs = false;
    match std::env::var(EVENT_HOOK_ENV).as_deref() {
        Ok("tracepoints") => return Err(format!("{EVENT_HOOK_ENV}=tracepoints")),
        Ok("btf-wakeups") => wakeup_programs = true,
        Ok("btf") | Err(_) => {}
        Ok(other) => log::warn!("{EVENT_HOOK_ENV}={other} is not an event hook; ignored"),
    }
    let btf = btf::Btf::vmlinux().map_err(|e| e.to_string())?;
    let mut offsets = btf::task_offsets(&btf).map_err(|e| e.to_string())?;
    if wakeup_programs {
        (offsets.last_queued, offsets.last_arrival) = (ABSENT, ABSENT);
    }
    Ok(offsets)
}

/// An attached program of the default hook.
enum Link {
    Btf(aya::programs::tp_btf::BtfTracePointLinkId),
    Raw(aya::programs::raw_trace_point::RawTracePointLinkId),
}

/// Loads and attaches every default program of [`HOT`] (the socket
/// lengths only when `socket_lengths`: the syscall send hook's; the wakeups
/// only when `wakeups`: without `sched_info`), or none: on a failure the ones
/// attached are detached again, so that the classic programs can take over
/// without an event counted twice. Returns how many it attached.
pub(super) fn attach_default(
    ebpf: &mut Ebpf,
    socket_lengths: bool,
    wakeups: bool,
) -> Result<usize, ProbeError> {
    let btf = Btf::from_sys_fs().map_err(|e| {
        ProbeError::Program("btf_sched_switch", aya::programs::ProgramError::Btf(e))
    })?;
    let mut links = Vec::new();
    let mut result = Ok(());
    for &(classic, name, kind, tracepoint) in HOT {
        if (!socket_lengths && super::send_hook::is_socket_length(classic))
            || (!wakeups && is_wakeup(classic))
        {
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
    Ok(links.len())
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
        Kind::Raw => {
            let prog = program::<RawTracePoint>(ebpf, name)?;
            if prog.fd().is_err() {
                prog.load().map_err(err)?;
            }
            prog.attach(tracepoint).map(Link::Raw).map_err(err)
        }
    }
}
