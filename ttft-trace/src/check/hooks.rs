//! The items about the kernel side's plan: the tracepoint fields it reads,
//! the ACK timing, and each job's hook with what it costs everything else.
//! The hooks and their reasons are the plan's (as the probes attached
//! them); only the verdicts and fixes are said here.

use super::Item;
use crate::probes::{Choice, EventHook, PlanError, SEGMENT_HOOK_ENV, SegmentHook, SendHook};

/// Whether every field the plan reads is in its format file.
pub(super) fn fields_item(planned: Result<(), &PlanError>) -> Item {
    match planned {
        Ok(()) => Item::ok(
            "tracepoint fields",
            "every field the probes read is in its format file",
        ),
        Err(e @ PlanError::SyscallFields(_)) => Item::fail(
            "tracepoint fields",
            e.to_string(),
            "a kernel with CONFIG_FTRACE_SYSCALLS=y, or with BTF and tcp:tcp_sendmsg_locked \
             and tcp:tcp_rcv_space_adjust",
        ),
        Err(e @ PlanError::Tracepoints(_)) => Item::fail(
            "tracepoint fields",
            e.to_string(),
            "a kernel whose tracepoints have these fields (report it: the layout changed)",
        ),
    }
}

/// Whether `tcp_probe` can read what each segment acknowledged, which
/// decides whether a first token acknowledged just before the server's
/// close gets a delivery time.
pub(super) fn ack_timing_item(ack_timing: Result<(), String>) -> Item {
    match ack_timing {
        Ok(()) => Item::ok(
            "ACK timing",
            "each client segment's own acknowledgment number (tcp_probe skbaddr + BTF)",
        ),
        Err(why) => Item::warn(
            "ACK timing",
            format!(
                "at the next segment ({why}): a first token acknowledged by the last segment \
                 before the server's close gets no client estimate"
            ),
            "Linux with skbaddr in tcp:tcp_probe and BTF (CONFIG_DEBUG_INFO_BTF=y)",
        ),
    }
}

/// " (why)", or nothing where the hook is the default.
fn because(why: &Option<String>) -> String {
    why.as_ref().map(|w| format!(" ({w})")).unwrap_or_default()
}

/// The send hook this host gets, and what it costs everything else.
pub(super) fn send_hook_item(send: &Choice<SendHook>) -> Item {
    let hook = send.hook;
    match hook {
        SendHook::Tcp => Item::ok(
            "send hook",
            format!(
                "{}: the syscalls and UNIX-socket calls of processes not traced pay \
                 nothing; their TCP sends and receives run a program that returns after an \
                 array read, and their context switches the sched programs (see the event hook)",
                hook.describe()
            ),
        ),
        SendHook::Syscalls => Item::warn(
            "send hook",
            format!(
                "{}{}: about +0.5 µs per syscall for every task on the host while tracing",
                hook.describe(),
                because(&send.why)
            ),
            "a kernel with BTF (CONFIG_DEBUG_INFO_BTF=y) and the tcp:tcp_sendmsg_locked \
             tracepoint (Linux 6.2+); unset TTFT_TRACE_SEND_HOOK",
        ),
    }
}

/// How the per-event programs are attached, and what that costs tasks the
/// tracer does not follow.
pub(super) fn event_hook_item(event: &Choice<EventHook>) -> Item {
    let hook = event.hook;
    match hook {
        EventHook::Raw => Item::ok(
            "event hook",
            format!(
                "{}: a context switch or wakeup of untraced tasks runs a program that \
                 returns after an array read per task, with no hash lookup (docs/costs.md)",
                hook.describe()
            ),
        ),
        EventHook::Tracepoints => Item::warn(
            "event hook",
            format!(
                "{}{}: every context switch and socket call on the host pays for it",
                hook.describe(),
                because(&event.why)
            ),
            "a kernel with BTF (CONFIG_DEBUG_INFO_BTF=y), Linux 6.3+; unset \
             TTFT_TRACE_EVENT_HOOK",
        ),
    }
}

/// How TCP segments are seen, and what that costs connections the tracer
/// does not follow.
pub(super) fn segment_hook_item(hook: &SegmentHook) -> Item {
    const RAW: &str = "raw tracepoint tcp:tcp_probe: every TCP segment on the host runs a \
                       program; for a connection not followed it returns after a read of its \
                       local port and one array load (one hash lookup more where that port is \
                       a followed listening port)";
    match hook {
        SegmentHook::Cgroups(_) => Item::ok(
            "segment hook",
            "cgroup_skb ingress on the traced workloads' cgroups and their listening \
             sockets' cgroups: segments of processes outside them run no program (the \
             kernel's cgroup check only); host-wide on tcp:tcp_probe where a workload or its \
             listener is in the root cgroup, with --port, or when the self-check finds \
             followed connections whose segments it does not see",
        ),
        SegmentHook::Raw(why) if why.starts_with(SEGMENT_HOOK_ENV) => {
            Item::ok("segment hook", format!("{RAW} ({why})"))
        }
        SegmentHook::Raw(why) => Item::warn(
            "segment hook",
            format!("{RAW} (not on cgroups: {why})"),
            "a kernel with cgroup v2 mounted (cgroup_skb programs)",
        ),
        SegmentHook::Classic(why) => Item::warn(
            "segment hook",
            format!(
                "classic tracepoint tcp:tcp_probe ({why}): the kernel fills a perf record of \
                 every TCP segment on the host before the program runs"
            ),
            "a kernel with BTF (CONFIG_DEBUG_INFO_BTF=y); unset TTFT_TRACE_EVENT_HOOK",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::{Verdict, host::load_config};
    use crate::probes::{Hooks, Overrides, Plan, recorded_kernels::kernel};

    fn hooks(file: &str) -> Hooks {
        let planned = Plan::new(&kernel(file), &Overrides::default(), &load_config());
        planned.expect("a plan").hooks
    }

    #[test]
    fn the_items_give_the_plans_reasons() {
        let machine = hooks("this-machine.json");
        assert_eq!(send_hook_item(&machine.send).verdict, Verdict::Ok);
        assert_eq!(event_hook_item(&machine.event).verdict, Verdict::Ok);
        let no_btf = hooks("no-btf.json");
        let why = "(cannot read /sys/kernel/btf/vmlinux: No such file or directory (os error 2))";
        for item in [send_hook_item(&no_btf.send), event_hook_item(&no_btf.event)] {
            assert_eq!(item.verdict, Verdict::Warn);
            assert!(item.detail.contains(&format!("{why}: ")), "{}", item.detail);
        }
    }

    #[test]
    fn a_plan_that_cannot_be_made_fails_the_fields_item() {
        let k = kernel("no-tcp-tracepoints.json");
        let planned = Plan::new(&k, &Overrides::default(), &load_config());
        let item = fields_item(planned.as_ref().map(drop));
        assert_eq!(item.verdict, Verdict::Fail);
        assert!(
            item.detail.contains("tcp:tcp_retransmit_skb"),
            "{}",
            item.detail
        );
    }
}
