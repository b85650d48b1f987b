//! The environment switches that force a fallback hook, for comparing the
//! hooks (`cargo xtask bench`) and testing the fallbacks: part of the
//! settings a plan is made from, read once.

use crate::probes::{EVENT_HOOK_ENV, SEGMENT_HOOK_ENV, SEND_HOOK_ENV};

/// Which fallbacks are forced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `TTFT_TRACE_SEND_HOOK=syscalls`: the syscall send hook.
    pub syscall_sends: bool,
    /// `TTFT_TRACE_EVENT_HOOK=tracepoints`: the classic tracepoints for the
    /// per-event programs (and segments).
    pub classic_events: bool,
    /// `TTFT_TRACE_EVENT_HOOK=btf-wakeups`: the BTF wakeup programs, as on
    /// kernels without `sched_info`.
    pub wakeup_programs: bool,
    /// `TTFT_TRACE_SEGMENT_HOOK=tcp_probe`: segments host-wide on the raw
    /// tracepoint.
    pub host_wide_segments: bool,
}

impl Overrides {
    /// The switches set in this process's environment; a value that names
    /// no hook is said and ignored.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let mut o = Self::default();
        match var(SEND_HOOK_ENV).as_deref() {
            Some("syscalls") => o.syscall_sends = true,
            Some("tcp") | None => {}
            Some(other) => log::warn!("{SEND_HOOK_ENV}={other} is not a send hook; ignored"),
        }
        match var(EVENT_HOOK_ENV).as_deref() {
            Some("tracepoints") => o.classic_events = true,
            Some("btf-wakeups") => o.wakeup_programs = true,
            Some("btf") | None => {}
            Some(other) => log::warn!("{EVENT_HOOK_ENV}={other} is not an event hook; ignored"),
        }
        match var(SEGMENT_HOOK_ENV).as_deref() {
            Some("tcp_probe") => o.host_wide_segments = true,
            None => {}
            Some(other) => {
                log::warn!("{SEGMENT_HOOK_ENV}={other} is not a segment hook (tcp_probe); ignored")
            }
        }
        o
    }
}
