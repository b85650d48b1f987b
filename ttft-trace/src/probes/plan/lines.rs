//! What the start log says about the plan: before loading, each job served
//! otherwise than by default and why; after, each hook attached.

use super::{Hooks, Plan, SegmentChoice};
use crate::probes::{EventHook, SendHook};

impl Plan {
    /// The plan's fallbacks, each with its reason, said before loading.
    pub fn reasons(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let Err(why) = &self.ack_timing {
            lines.push(format!("ACK timing: at the next segment ({why})"));
        }
        if let Err(why) = &self.namespaces {
            lines.push(format!(
                "listening ports: matched in every network namespace ({why})"
            ));
        }
        if let Some(why) = &self.hooks.send.why {
            lines.push(format!("send hook: syscall tracepoints ({why})"));
        }
        if let Some(why) = &self.hooks.event.why {
            lines.push(format!("event hook: classic tracepoints ({why})"));
        }
        lines
    }

    /// Where wakeups come from, once the BTF programs are attached.
    pub fn wakeups_line(&self) -> &'static str {
        if self.wakeup_programs {
            "wakeups: BTF tracepoints sched_wakeup, sched_wakeup_new (no sched_info in this \
             kernel's task_struct)"
        } else {
            "wakeups: read from the woken task's sched_info where it switches in (no wakeup \
             program)"
        }
    }
}

impl Hooks {
    /// How segments are seen, once attached.
    pub fn segments_line(&self) -> String {
        match &self.segments {
            SegmentChoice::Cgroups(_) => "segments: cgroup_skb ingress on the traced workloads' \
                                          cgroups (tcp:tcp_probe host-wide where a workload has \
                                          none of its own)"
                .into(),
            SegmentChoice::Raw(_) => "segments: raw tracepoint tcp:tcp_probe (the socket and \
                                      segment, read only for followed connections)"
                .into(),
            SegmentChoice::Classic(why) => format!(
                "segments: classic tracepoint tcp:tcp_probe ({why}): the kernel fills a perf \
                 record of every TCP segment on the host first"
            ),
        }
    }

    /// How the per-event programs are attached.
    pub fn event_line(&self, sched_programs: bool) -> String {
        let hook = self.event.hook.describe();
        if sched_programs {
            format!("event hook: {hook}")
        } else {
            format!(
                "event hook: no scheduler program (--sched sampled: sched_switch and the wakeups \
                 get none); the others as in: {hook}"
            )
        }
    }

    /// Where sends and receives are seen.
    pub fn send_line(&self) -> String {
        format!("send hook: {}", self.send.hook.describe())
    }

    /// The socket-length programs are attached: the syscall send hook's.
    pub fn socket_lengths(&self) -> bool {
        self.send.hook == SendHook::Syscalls
    }

    /// The per-event programs are the BTF and raw ones.
    pub fn raw_events(&self) -> bool {
        self.event.hook == EventHook::Raw
    }
}
