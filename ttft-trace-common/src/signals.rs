//! Events and kernel state of the "why was it slow" signals: scheduler
//! intervals of the traced threads, TCP trouble on followed connections, and
//! large host/device copies.

/// Tag of [`SchedEvent`].
pub const EVENT_SCHED: u32 = 4;
/// Tag of [`TcpEvent`].
pub const EVENT_TCP: u32 = 5;
/// Tag of [`CopyEvent`].
pub const EVENT_COPY: u32 = 6;

/// [`SchedEvent::what`]: the thread ran on a CPU over the interval.
pub const SCHED_ONCPU: u32 = 1;
/// [`SchedEvent::what`]: runnable but waiting for a CPU (woken, or
/// preempted) over the interval: run-queue delay.
pub const SCHED_RUNQ: u32 = 2;
/// [`SchedEvent::what`]: off CPU and not runnable (sleeping, waiting on a
/// lock or I/O) over the interval.
pub const SCHED_BLOCKED: u32 = 3;

/// One scheduler interval of a traced thread, sent only when it lasted at
/// least the load-time threshold (shorter ones are only summed in the
/// kernel, in [`SchedTotals`] and the run-queue histogram).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedEvent {
    /// [`EVENT_SCHED`].
    pub kind: u32,
    /// [`SCHED_ONCPU`], [`SCHED_RUNQ`] or [`SCHED_BLOCKED`].
    pub what: u32,
    pub tgid: u32,
    pub tid: u32,
    pub t_start_ns: u64,
    pub t_end_ns: u64,
}

/// [`TcpEvent::what`]: `tcp:tcp_retransmit_skb`.
pub const TCP_RETRANSMIT: u32 = 1;
/// [`TcpEvent::what`]: `tcp:tcp_receive_reset`.
pub const TCP_RESET_RECEIVED: u32 = 2;
/// [`TcpEvent::what`]: `tcp:tcp_send_reset`.
pub const TCP_RESET_SENT: u32 = 3;

/// TCP trouble on a followed server connection (keyed like [`crate::ConnEvent`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpEvent {
    /// [`EVENT_TCP`].
    pub kind: u32,
    pub what: u32,
    pub sk: u64,
    pub t_ns: u64,
}

/// A host/device copy call of at least the load-time threshold (swap-like
/// traffic, model loading). Counted whatever its size in
/// [`crate::GpuCounters`]; sent as an event only when large.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyEvent {
    /// [`EVENT_COPY`].
    pub kind: u32,
    pub tgid: u32,
    pub tid: u32,
    /// A [`crate::Direction`] value.
    pub direction: u32,
    pub bytes: u64,
    /// Entry of the copy call.
    pub t_ns: u64,
}

/// Scheduler state of one traced thread (value of the kernel's map).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedState {
    pub tgid: u32,
    /// 1 while off CPU and not runnable.
    pub blocked: u32,
    /// Switched in (0: not on a CPU).
    pub t_on_ns: u64,
    /// Switched out.
    pub t_off_ns: u64,
    /// Became runnable (woken or preempted); 0 while running or blocked.
    pub t_runnable_ns: u64,
    /// 1 when the kernel set `sched_info.last_arrival` as it switched the
    /// thread in at `t_on_ns` (it does only for a thread that was queued):
    /// the two then date one moment on both clocks.
    pub arrival_dated: u32,
    pub _pad: u32,
}

/// Per-process scheduler totals (one copy per CPU; userspace sums).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedTotals {
    pub oncpu_ns: u64,
    pub runq_ns: u64,
    pub runq_count: u64,
    pub blocked_ns: u64,
}

impl SchedTotals {
    pub fn add(&mut self, o: &SchedTotals) {
        self.oncpu_ns = self.oncpu_ns.wrapping_add(o.oncpu_ns);
        self.runq_ns = self.runq_ns.wrapping_add(o.runq_ns);
        self.runq_count = self.runq_count.wrapping_add(o.runq_count);
        self.blocked_ns = self.blocked_ns.wrapping_add(o.blocked_ns);
    }
}

/// Buckets of the run-queue delay histogram kept in the kernel: bucket `i`
/// counts waits in `[2^i, 2^(i+1))` ns; the last one also counts longer.
pub const RUNQ_BUCKETS: u32 = 40;
/// Slot of the run-queue histogram array that holds the sum in ns.
pub const RUNQ_SUM_SLOT: u32 = RUNQ_BUCKETS;

/// The histogram bucket of a wait (floor of log2, clamped).
#[inline(always)]
pub fn runq_bucket(ns: u64) -> u32 {
    let b = 63 - (ns | 1).leading_zeros();
    if b >= RUNQ_BUCKETS {
        RUNQ_BUCKETS - 1
    } else {
        b
    }
}

const _: () = {
    assert!(core::mem::size_of::<SchedEvent>() == 32);
    assert!(core::mem::offset_of!(SchedEvent, t_start_ns) == 16);
    assert!(core::mem::size_of::<TcpEvent>() == 24);
    assert!(core::mem::offset_of!(TcpEvent, sk) == 8);
    assert!(core::mem::size_of::<CopyEvent>() == 32);
    assert!(core::mem::offset_of!(CopyEvent, bytes) == 16);
    assert!(core::mem::size_of::<SchedState>() == 40);
    assert!(core::mem::size_of::<SchedTotals>() == 32);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2_and_clamped() {
        assert_eq!(runq_bucket(0), 0);
        assert_eq!(runq_bucket(1), 0);
        assert_eq!(runq_bucket(2), 1);
        assert_eq!(runq_bucket(1023), 9);
        assert_eq!(runq_bucket(1024), 10);
        assert_eq!(runq_bucket(1_000_000), 19);
        assert_eq!(runq_bucket(u64::MAX), RUNQ_BUCKETS - 1);
    }

    #[test]
    fn totals_add() {
        let mut a = SchedTotals {
            oncpu_ns: 1,
            runq_ns: 2,
            runq_count: 3,
            blocked_ns: 4,
        };
        a.add(&SchedTotals {
            oncpu_ns: 10,
            runq_ns: 20,
            runq_count: 30,
            blocked_ns: 40,
        });
        assert_eq!(
            a,
            SchedTotals {
                oncpu_ns: 11,
                runq_ns: 22,
                runq_count: 33,
                blocked_ns: 44
            }
        );
    }
}
