//! The event hook: how the programs that run for every context switch,
//! wakeup and socket call on the host are attached. Raw tracepoints (the
//! tracepoint's own arguments, `struct task_struct *` and `struct sock *`,
//! with offsets from the kernel's BTF) by default; the classic tracepoints,
//! which fill a perf record of every event before the program runs, where
//! the kernel lacks BTF or the prototypes differ.

use aya::{Ebpf, programs::RawTracePoint};
use ttft_trace_common::offsets::TaskOffsets;

use super::{ProbeError, btf};

/// How the per-event programs are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventHook {
    /// Raw tracepoints: untraced tasks pay the tracepoint's dispatch and a
    /// map lookup.
    Raw,
    /// Classic tracepoints: on top, the kernel fills the tracepoint's perf
    /// record of every switch, wakeup and socket call. The fallback.
    Tracepoints,
}

impl EventHook {
    pub fn describe(self) -> &'static str {
        match self {
            EventHook::Raw => {
                "raw tracepoints sched_switch, sched_wakeup, sched_wakeup_new, \
                 sock_send_length, sock_recv_length (the kernel's arguments, offsets from BTF)"
            }
            EventHook::Tracepoints => {
                "classic tracepoints sched:sched_switch, sched_wakeup, sched_wakeup_new, \
                 sock:sock_send_length, sock_recv_length (fallback: the kernel fills a perf \
                 record of every context switch, wakeup and socket call first)"
            }
        }
    }
}

/// Forces the event hook, for comparing the two (`cargo xtask bench`) and
/// testing the fallback: `tracepoints` or `raw`.
pub const EVENT_HOOK_ENV: &str = "TTFT_TRACE_EVENT_HOOK";

/// The per-event programs: (classic program, raw program, tracepoint). The
/// classic ones are in [`super::TRACEPOINTS`] too, under the tracepoint's
/// category.
pub(super) const HOT: &[(&str, &str, &str)] = &[
    ("sched_switch", "raw_sched_switch", "sched_switch"),
    ("sched_wakeup", "raw_sched_wakeup", "sched_wakeup"),
    (
        "sched_wakeup_new",
        "raw_sched_wakeup_new",
        "sched_wakeup_new",
    ),
    (
        "sock_send_length",
        "raw_sock_send_length",
        "sock_send_length",
    ),
    (
        "sock_recv_length",
        "raw_sock_recv_length",
        "sock_recv_length",
    ),
];

/// Whether `program` is a classic program that the raw hook replaces.
pub(super) fn is_hot(program: &str) -> bool {
    HOT.iter().any(|&(classic, _, _)| classic == program)
}

/// The event hook this host gets, with the BTF offsets it needs, or why the
/// fallback is used.
pub fn event_hook_plan() -> Result<TaskOffsets, String> {
    match std::env::var(EVENT_HOOK_ENV).as_deref() {
        Ok("tracepoints") => return Err(format!("{EVENT_HOOK_ENV}=tracepoints")),
        Ok("raw") | Err(_) => {}
        Ok(other) => log::warn!("{EVENT_HOOK_ENV}={other} is not an event hook; ignored"),
    }
    let btf = btf::Btf::vmlinux().map_err(|e| e.to_string())?;
    btf::task_offsets(&btf).map_err(|e| e.to_string())
}

/// Loads and attaches every raw program of [`HOT`], or none: on a failure
/// the ones attached are detached again, so that the classic programs can
/// take over without an event counted twice.
pub(super) fn attach_raw(ebpf: &mut Ebpf) -> Result<(), ProbeError> {
    let mut links = Vec::new();
    let mut result = Ok(());
    for &(_, name, tracepoint) in HOT {
        match attach_one(ebpf, name, tracepoint) {
            Ok(link) => links.push((name, link)),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if result.is_err() {
        for (name, link) in links {
            if let Ok(prog) = raw_program(ebpf, name) {
                let _ = prog.detach(link);
            }
        }
    }
    result
}

fn raw_program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut RawTracePoint, ProbeError> {
    ebpf.program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|e| ProbeError::Program(name, e))
}

fn attach_one(
    ebpf: &mut Ebpf,
    name: &'static str,
    tracepoint: &str,
) -> Result<aya::programs::raw_trace_point::RawTracePointLinkId, ProbeError> {
    let prog = raw_program(ebpf, name)?;
    if prog.fd().is_err() {
        prog.load().map_err(|e| ProbeError::Program(name, e))?;
    }
    prog.attach(tracepoint)
        .map_err(|e| ProbeError::Program(name, e))
}
