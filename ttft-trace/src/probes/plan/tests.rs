//! The plan on the kept kernel descriptions (see `recorded_kernels`): which
//! hook serves each job, and the reason given.

use std::path::PathBuf;

use ttft_trace_common::offsets::ABSENT;

use super::*;
use crate::probes::recorded_kernels::kernel;

/// A daemon's settings with `--sched sampled`: each goes to a global.
fn settings() -> LoadConfig {
    LoadConfig {
        ringbuf_bytes: 1 << 20,
        sched_min_ns: 50_000,
        large_copy_bytes: 4096,
        discover: true,
        map_entries: vec![("CONNS", 1024)],
        sched_programs: false,
    }
}

fn plan(file: &str, overrides: Overrides) -> Plan {
    Plan::new(&kernel(file), &overrides, &settings()).expect("a plan")
}

/// What reading the BTF of a kernel without it says.
const NO_BTF: &str = "cannot read /sys/kernel/btf/vmlinux: No such file or directory (os error 2)";

const CGROUPS_LINE: &str = "segments: cgroup_skb ingress on the traced workloads' cgroups \
                            (tcp:tcp_probe host-wide where a workload has none of its own)";
const RAW_LINE: &str = "segments: raw tracepoint tcp:tcp_probe (the socket and segment, read \
                        only for followed connections)";

#[test]
fn this_machine_gets_every_default_hook() {
    let p = plan("this-machine.json", Overrides::default());
    assert_eq!(p.hooks.send, Choice::default_hook(SendHook::Tcp));
    assert_eq!(p.hooks.event, Choice::default_hook(EventHook::Raw));
    // A hybrid hierarchy, this machine's: v2 beside v1.
    assert_eq!(
        p.hooks.segments,
        SegmentChoice::Cgroups(PathBuf::from("/sys/fs/cgroup/unified"))
    );
    assert!(p.reasons().is_empty(), "{:?}", p.reasons());
    assert_eq!(p.hooks.segments_line(), CGROUPS_LINE);
    assert!(
        p.hooks
            .send_line()
            .starts_with("send hook: raw tracepoints tcp:tcp_sendmsg_locked")
    );
    assert!(
        p.hooks
            .event_line(true)
            .starts_with("event hook: BTF tracepoints sched_switch")
    );
    assert!(
        p.wakeups_line()
            .starts_with("wakeups: read from the woken task's sched_info")
    );
    assert!(p.syscalls_ready && !p.wakeup_programs);
    let o = &p.globals.offsets;
    for read in [
        o.skb_ack_seq,
        o.sk_net,
        o.net_inum,
        o.write_buf,
        o.probe_skb,
    ] {
        assert_ne!(read, ABSENT);
    }
    assert!(p.globals.task.has_sched_info());
    let g = &p.globals;
    assert_eq!(g.wakeup_bytes, (1 << 20) / 8);
    assert_eq!(
        (g.sched_min_ns, g.large_copy_bytes, g.discover),
        (50_000, 4096, 1)
    );
    assert_eq!(
        (g.ringbuf_bytes, g.map_entries.as_slice()),
        (1 << 20, &[("CONNS", 1024)][..])
    );
    assert!(!p.sched_programs);
}

#[test]
fn without_btf_every_hook_falls_back_saying_why() {
    let p = plan("no-btf.json", Overrides::default());
    assert_eq!(p.hooks.send, Choice::fallback(SendHook::Syscalls, NO_BTF));
    assert_eq!(
        p.hooks.event,
        Choice::fallback(EventHook::Tracepoints, NO_BTF)
    );
    assert_eq!(p.hooks.segments, SegmentChoice::Classic(NO_BTF.into()));
    assert_eq!(
        p.reasons(),
        [
            format!("ACK timing: at the next segment ({NO_BTF})"),
            format!("listening ports: matched in every network namespace ({NO_BTF})"),
            format!("send hook: syscall tracepoints ({NO_BTF})"),
            format!("event hook: classic tracepoints ({NO_BTF})"),
        ]
    );
    assert_eq!(
        p.hooks.segments_line(),
        format!(
            "segments: classic tracepoint tcp:tcp_probe ({NO_BTF}): the kernel fills a perf \
             record of every TCP segment on the host first"
        )
    );
    let o = &p.globals.offsets;
    assert_eq!((o.skb_ack_seq, o.sk_net), (ABSENT, ABSENT));
    assert_ne!(o.write_buf, ABSENT);
}

#[test]
fn without_the_tcp_send_tracepoints_sends_take_the_syscalls() {
    let p = plan("no-tcp-send-tracepoints.json", Overrides::default());
    let why = "BTF has no btf_trace_tcp_sendmsg_locked";
    assert_eq!(p.hooks.send, Choice::fallback(SendHook::Syscalls, why));
    assert_eq!(
        p.reasons(),
        [format!("send hook: syscall tracepoints ({why})")]
    );
    assert_eq!(p.hooks.event, Choice::default_hook(EventHook::Raw));
    assert!(matches!(p.hooks.segments, SegmentChoice::Cgroups(_)));
    assert!(p.hooks.socket_lengths());
}

#[test]
fn without_the_tcp_tracepoints_nothing_loads() {
    let k = kernel("no-tcp-tracepoints.json");
    let err = Plan::new(&k, &Overrides::default(), &settings()).expect_err("no tcp:*");
    assert!(matches!(err, PlanError::Tracepoints(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "tracepoint tcp:tcp_retransmit_skb not found in tracefs: this kernel lacks it (No such \
         file or directory (os error 2))"
    );
}

#[test]
fn without_cgroup_v2_segments_are_seen_host_wide() {
    let p = plan("no-cgroup2.json", Overrides::default());
    let why = "no cgroup v2 hierarchy is mounted";
    assert_eq!(p.hooks.segments, SegmentChoice::Raw(why.into()));
    assert_eq!(p.hooks.segments_line(), RAW_LINE);
    assert_eq!(p.hooks.send, Choice::default_hook(SendHook::Tcp));
    assert!(p.reasons().is_empty());
}

#[test]
fn without_btf_nor_syscall_tracepoints_sends_cannot_be_seen() {
    let mut k = kernel("no-btf.json");
    if let Ok(tracepoints) = &mut k.tracefs {
        tracepoints
            .formats
            .retain(|tp, _| !tp.starts_with("syscalls:"));
    }
    let err = Plan::new(&k, &Overrides::default(), &settings()).expect_err("no send hook");
    assert!(matches!(err, PlanError::SyscallFields(_)), "{err:?}");
    assert!(
        err.to_string().contains("syscalls:sys_enter_write"),
        "{err}"
    );
}

#[test]
fn the_switches_force_each_fallback() {
    let forced = |o: Overrides| plan("this-machine.json", o);
    let p = forced(Overrides {
        syscall_sends: true,
        ..Overrides::default()
    });
    let why = "TTFT_TRACE_SEND_HOOK=syscalls";
    assert_eq!(p.hooks.send, Choice::fallback(SendHook::Syscalls, why));
    let p = forced(Overrides {
        classic_events: true,
        ..Overrides::default()
    });
    let why = "TTFT_TRACE_EVENT_HOOK=tracepoints";
    assert_eq!(p.hooks.event, Choice::fallback(EventHook::Tracepoints, why));
    assert_eq!(p.hooks.segments, SegmentChoice::Classic(why.into()));
    let p = forced(Overrides {
        wakeup_programs: true,
        ..Overrides::default()
    });
    assert!(p.wakeup_programs);
    assert!(
        p.wakeups_line()
            .starts_with("wakeups: BTF tracepoints sched_wakeup")
    );
    let p = forced(Overrides {
        host_wide_segments: true,
        ..Overrides::default()
    });
    let why = "TTFT_TRACE_SEGMENT_HOOK=tcp_probe";
    assert_eq!(p.hooks.segments, SegmentChoice::Raw(why.into()));
}

#[test]
fn a_refused_attach_amends_the_hooks() {
    let mut hooks = plan("this-machine.json", Overrides::default()).hooks;
    hooks.cgroups_fell_back("EPERM");
    assert_eq!(hooks.segments, SegmentChoice::Raw("EPERM".into()));
    hooks.events_fell_back("EINVAL");
    let why = "attaching the raw tracepoints failed: EINVAL";
    assert_eq!(hooks.event, Choice::fallback(EventHook::Tracepoints, why));
    assert_eq!(hooks.segments, SegmentChoice::Classic(why.into()));
    hooks.sends_fell_back("ENOENT");
    assert_eq!(hooks.send.hook, SendHook::Syscalls);
    assert_eq!(
        hooks.send.why.as_deref(),
        Some("attaching tcp:tcp_sendmsg_locked or tcp_rcv_space_adjust failed: ENOENT")
    );
    let sampled = hooks.event_line(false);
    assert!(sampled.starts_with("event hook: no scheduler program (--sched sampled"));
}
