//! Scheduler and TCP signals for "why was it slow": run-queue delay,
//! on-CPU and blocked time of the traced threads, and TCP retransmits and
//! resets on followed connections.
//!
//! Every interval is summed per process and run-queue waits are counted in
//! a log2 histogram, all in the kernel; only intervals of at least
//! `SCHED_MIN_NS` become events (the scheduler can switch a million times a
//! second on a busy host; the long intervals are the ones that explain a
//! slow request).
//!
//! The switch and wakeup programs run for every task on the host, so they
//! are BTF tracepoints (the scheduler's own arguments, `struct task_struct
//! *`, read in place at the thread id's offset from the kernel's BTF) where
//! the prototypes check out, and the classic tracepoints (which fill a perf
//! record before the program runs) otherwise. Where the kernel keeps
//! `sched_info` (CONFIG_SCHED_INFO) the BTF switch program also tells when
//! a sleeping thread was woken, from when the kernel queued it, and no
//! wakeup program runs at all: a wakeup costs tasks on the host nothing. A task is looked up only when
//! [`TRACED_IDS`](crate::maps::TRACED_IDS) says it may be traced: for
//! untraced tasks, an array read per task instead of a hash lookup.

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{btf_tracepoint, tracepoint},
    programs::{BtfTracePointContext, TracePointContext},
};
use ttft_trace_common::{
    Stat,
    signals::{
        EVENT_SCHED, EVENT_TCP, RUNQ_SUM_SLOT, SCHED_BLOCKED, SCHED_ONCPU, SCHED_RUNQ, SchedEvent,
        SchedState, SchedTotals, TCP_RESET_RECEIVED, TCP_RESET_SENT, TCP_RETRANSMIT, TcpEvent,
        runq_bucket,
    },
};

use crate::{
    maps::{
        CONNS, EVENTS, RUNQ_HIST, SCHED_CLOCK, SCHED_STATE, SCHED_TOTALS, TASK_OFFSETS, bump_stat,
        is_tracked, mark_traced, may_be_traced, offset, offsets, sched_min_ns, wakeup_flag,
    },
    mem::now_ns,
};

/// `prev_state` bits that mean "not runnable"; a preempted task reports 0
/// or `TASK_REPORT_MAX` (0x100), both with these bits clear.
const BLOCKED_STATE_MASK: u64 = 0xff;
/// `prev_state` of a thread's last switch, as the tracepoint reports it:
/// `EXIT_DEAD` (0x10) or `EXIT_ZOMBIE` (0x20). Its state goes with it, so
/// that threads that come and go leave no entry behind.
const EXITING_STATE_MASK: u64 = 0x30;
/// The raw tracepoint's `prev_state` is the task's own state: `TASK_DEAD`
/// on its last switch, and the sleeping states within `TASK_REPORT`
/// (interruptible, uninterruptible, stopped, traced, parked), the bits the
/// classic tracepoint reports as blocked. Kernel ABI since 4.14.
const TASK_DEAD: u32 = 0x80;
const TASK_REPORT: u32 = 0x7f;

#[inline(always)]
fn totals(tgid: u32) -> Option<*mut SchedTotals> {
    if let Some(p) = SCHED_TOTALS.get_ptr_mut(tgid) {
        return Some(p);
    }
    let _ = SCHED_TOTALS.insert(tgid, SchedTotals::default(), 0);
    SCHED_TOTALS.get_ptr_mut(tgid)
}

#[inline(always)]
fn emit(what: u32, tgid: u32, tid: u32, start: u64, end: u64) {
    if end.saturating_sub(start) < sched_min_ns() {
        return;
    }
    match EVENTS.reserve::<SchedEvent>(0) {
        Some(mut entry) => {
            entry.write(SchedEvent {
                kind: EVENT_SCHED,
                what,
                tgid,
                tid,
                t_start_ns: start,
                t_end_ns: end,
            });
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
}

#[inline(always)]
fn runq_histogram(ns: u64) {
    if let Some(p) = RUNQ_HIST.get_ptr_mut(runq_bucket(ns)) {
        // SAFETY: this CPU's slot.
        unsafe { *p += 1 };
    }
    if let Some(p) = RUNQ_HIST.get_ptr_mut(RUNQ_SUM_SLOT) {
        // SAFETY: as above.
        unsafe { *p = (*p).wrapping_add(ns) };
    }
}

/// How the task switched out left the CPU.
enum Left {
    /// Still runnable (preempted, or yielded): run-queue wait starts.
    Runnable,
    /// Asleep: blocked time starts.
    Blocked,
    /// Its last switch: the thread is dead.
    Exiting,
}

/// The two tasks of a BTF `sched_switch`, whose `sched_info` the program
/// reads where the kernel has it (see [`SchedInfo::woken_at`]).
#[derive(Clone, Copy)]
struct SchedInfo {
    prev: *const u8,
    next: *const u8,
}

impl SchedInfo {
    /// When `prev` last got the CPU, on the run queue's clock.
    #[inline(always)]
    fn prev_arrival(&self) -> u64 {
        // SAFETY: reading a static we own; userspace rewrites it before load.
        let off = unsafe { core::ptr::read_volatile(&TASK_OFFSETS.last_arrival) };
        task_u64(self.prev, off)
    }

    /// When `next` was put on its run queue (0: it was not), on the run
    /// queue's clock.
    #[inline(always)]
    fn next_queued(&self) -> u64 {
        // SAFETY: as above.
        let off = unsafe { core::ptr::read_volatile(&TASK_OFFSETS.last_queued) };
        task_u64(self.next, off)
    }

    /// When a thread switched in after sleeping, and queued at `queued`
    /// ([`SchedInfo::next_queued`]), was woken, read in place of
    /// a wakeup program (which would run for every wakeup on the host):
    /// the kernel puts a woken task on its run queue and notes when
    /// (`sched_info.last_queued`, still set as the switch is traced), on
    /// the run queue's clock. That clock is mapped to `bpf_ktime_get_ns` by
    /// the last moment this CPU dated on both (see [`date_clock`]). None
    /// where there is no such moment yet, or the task was not queued.
    /// A task moved to another CPU while it waited was queued again there:
    /// its wait before the move counts as blocked.
    #[inline(always)]
    fn woken_at(queued: u64) -> Option<u64> {
        if queued == 0 {
            return None;
        }
        // SAFETY: this CPU's copies, read at once.
        let (k, c) = unsafe { (*SCHED_CLOCK.get_ptr(0)?, *SCHED_CLOCK.get_ptr(1)?) };
        if k == 0 {
            return None;
        }
        Some(k.wrapping_add(queued.wrapping_sub(c)))
    }
}

/// Whether the BTF switch program reads wakeups from `sched_info`
/// (userspace then attaches no wakeup program).
#[inline(always)]
fn wakeups_from_sched_info() -> bool {
    // SAFETY: reading a static we own; userspace rewrites it before load.
    let off = unsafe { core::ptr::read_volatile(&TASK_OFFSETS) };
    off.has_sched_info()
}

/// An 8-byte member of a BTF `struct task_struct *` at `off` (from this
/// kernel's BTF; a constant to the verifier, which checks the load).
#[inline(always)]
fn task_u64(task: *const u8, off: u32) -> u64 {
    // SAFETY: a BTF-typed pointer of the tracepoint's arguments; the
    // verifier allows only a load of a member of that size here, and the
    // kernel turns a fault into a zero.
    unsafe { core::ptr::read_volatile(task.add(off as usize).cast::<u64>()) }
}

/// Notes, for this CPU, one moment on both clocks: `ktime` where a traced
/// thread switched in, and `sched_info.last_arrival`, which the kernel set
/// at the same switch.
#[inline(always)]
fn date_clock(ktime: u64, clock: u64) {
    if clock == 0 {
        return;
    }
    if let (Some(k), Some(c)) = (SCHED_CLOCK.get_ptr_mut(0), SCHED_CLOCK.get_ptr_mut(1)) {
        // SAFETY: this CPU's copies; the switch runs with preemption off.
        unsafe {
            *k = ktime;
            *c = clock;
        }
    }
}

/// One context switch, in the context of the task switched out: `left`
/// tells how it left (read only when it is traced), `next` is the thread
/// switched in (0 for the idle task), `info` its `sched_info` where the
/// wakeups come from it. An untraced task switching to an untraced thread
/// pays two array reads (`TRACED_IDS`), no hash lookup.
#[inline(always)]
fn on_switch(left: impl FnOnce() -> Left, next: u32, info: Option<SchedInfo>) {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    let mut now = 0;
    if tid != 0 && is_tracked(tgid) {
        now = now_ns();
        match left() {
            // sched_process_exit dropped its state already; updating it
            // here would make it again.
            Left::Exiting => {
                let _ = SCHED_STATE.remove(tid);
            }
            Left::Blocked => switched_out(tgid, tid, now, true, info),
            Left::Runnable => switched_out(tgid, tid, now, false, info),
        }
    }
    if next != 0 {
        switched_in(next, now, info);
    }
}

/// `sched:sched_switch` (the classic tracepoint: the fallback where the
/// raw one cannot be had).
#[tracepoint]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    let at = offset!(switch_next_pid);
    // SAFETY: offset from this kernel's tracefs format file.
    let next = unsafe { ctx.read_at::<i32>(at) }.unwrap_or(0);
    on_switch(
        || {
            let at = offset!(switch_prev_state);
            // SAFETY: as above.
            let state = unsafe { ctx.read_at::<u64>(at) }.unwrap_or(0);
            if state & EXITING_STATE_MASK != 0 {
                Left::Exiting
            } else if state & BLOCKED_STATE_MASK != 0 {
                Left::Blocked
            } else {
                Left::Runnable
            }
        },
        next as u32,
        None,
    );
    0
}

/// Thread id of a `struct task_struct *` argument of a BTF tracepoint: a
/// plain load, which the verifier checks against the kernel's layout (the
/// offset, from this kernel's BTF, is a constant to it: `.rodata` is frozen
/// before the programs load).
#[inline(always)]
fn task_tid(task: *const u8) -> u32 {
    // SAFETY: reading a static we own; userspace rewrites it before load.
    let off = unsafe { core::ptr::read_volatile(&TASK_OFFSETS.pid) } as usize;
    // SAFETY: a BTF-typed pointer of the tracepoint's arguments; the
    // verifier allows only a load of `task_struct.pid` here, and the kernel
    // turns a fault into a zero.
    unsafe { core::ptr::read_volatile(task.add(off).cast::<i32>()) as u32 }
}

/// BTF `sched_switch(bool preempt, struct task_struct *prev, struct
/// task_struct *next, unsigned int prev_state)`: the arguments as the
/// scheduler passes them, without the perf record the classic tracepoint
/// fills first. `prev_state` is the raw task state here, not the
/// tracepoint's reported one.
#[btf_tracepoint(function = "sched_switch")]
pub fn btf_sched_switch(ctx: BtfTracePointContext) -> i32 {
    let next: *const u8 = ctx.arg(2);
    let info = wakeups_from_sched_info().then(|| SchedInfo {
        prev: ctx.arg(1),
        next,
    });
    on_switch(
        || {
            let preempt: u64 = ctx.arg(0);
            let state = ctx.arg::<u64>(3) as u32;
            if state & TASK_DEAD != 0 {
                Left::Exiting
            } else if preempt & 0xff == 0 && state & TASK_REPORT != 0 {
                Left::Blocked
            } else {
                Left::Runnable
            }
        },
        task_tid(next),
        info,
    );
    0
}

#[inline(always)]
fn switched_out(tgid: u32, tid: u32, now: u64, blocked: bool, info: Option<SchedInfo>) {
    let st = match SCHED_STATE.get_ptr_mut(tid) {
        Some(p) => p,
        None => {
            // Marked first: a wakeup on another CPU must not skip it.
            mark_traced(tid, true);
            let _ = SCHED_STATE.insert(
                tid,
                SchedState {
                    tgid,
                    ..SchedState::default()
                },
                0,
            );
            match SCHED_STATE.get_ptr_mut(tid) {
                Some(p) => p,
                None => return,
            }
        }
    };
    // SAFETY: live map value of this thread, touched only while it switches.
    let st = unsafe { &mut *st };
    if st.t_on_ns != 0 {
        let ran = now.saturating_sub(st.t_on_ns);
        if let Some(t) = totals(tgid) {
            // SAFETY: this CPU's copy.
            unsafe { (*t).oncpu_ns += ran };
        }
        emit(SCHED_ONCPU, tgid, tid, st.t_on_ns, now);
        if let Some(info) = info
            && st.arrival_dated != 0
        {
            date_clock(st.t_on_ns, info.prev_arrival());
        }
    }
    st.tgid = tgid;
    st.t_on_ns = 0;
    st.t_off_ns = now;
    if blocked {
        st.blocked = 1;
        st.t_runnable_ns = 0;
    } else {
        st.blocked = 0;
        st.t_runnable_ns = now;
    }
}

#[inline(always)]
fn switched_in(tid: u32, now: u64, info: Option<SchedInfo>) {
    if !may_be_traced(tid) {
        return;
    }
    let Some(st) = SCHED_STATE.get_ptr_mut(tid) else {
        return;
    };
    let now = if now == 0 { now_ns() } else { now };
    // SAFETY: live map value.
    let st = unsafe { &mut *st };
    st.arrival_dated = 0;
    if let Some(info) = info {
        let queued = info.next_queued();
        st.arrival_dated = u32::from(queued != 0);
        if st.blocked != 0 {
            // No wakeup program ran: asleep until queued, waiting since.
            // Within the time it was off the CPU, whatever the clocks say.
            let woke = SchedInfo::woken_at(queued)
                .unwrap_or(now)
                .min(now)
                .max(st.t_off_ns);
            wake(st, tid, woke);
        }
    }
    if st.t_runnable_ns != 0 {
        let waited = now.saturating_sub(st.t_runnable_ns);
        if let Some(t) = totals(st.tgid) {
            // SAFETY: this CPU's copy.
            unsafe {
                (*t).runq_ns += waited;
                (*t).runq_count += 1;
            }
        }
        runq_histogram(waited);
        emit(SCHED_RUNQ, st.tgid, tid, st.t_runnable_ns, now);
    }
    st.t_runnable_ns = 0;
    st.blocked = 0;
    st.t_on_ns = now;
}

/// A wakeup of thread `tid`: ends its blocked time if it is a traced
/// thread asleep. One map lookup for any other thread.
#[inline(always)]
fn woken(tid: u32) -> u32 {
    if tid == 0 || !may_be_traced(tid) {
        return 0;
    }
    let Some(st) = SCHED_STATE.get_ptr_mut(tid) else {
        return 0;
    };
    // SAFETY: live map value.
    let st = unsafe { &mut *st };
    if st.blocked != 0 {
        wake(st, tid, now_ns());
    }
    0
}

/// A traced thread asleep since it switched out was woken at `at`: its
/// blocked time ends, its run-queue wait starts.
#[inline(always)]
fn wake(st: &mut SchedState, tid: u32, at: u64) {
    let slept = at.saturating_sub(st.t_off_ns);
    if let Some(t) = totals(st.tgid) {
        // SAFETY: this CPU's copy.
        unsafe { (*t).blocked_ns += slept };
    }
    emit(SCHED_BLOCKED, st.tgid, tid, st.t_off_ns, at);
    st.blocked = 0;
    st.t_runnable_ns = at;
}

#[inline(always)]
fn woken_pid(ctx: &TracePointContext) -> u32 {
    let at = offset!(wakeup_pid);
    // SAFETY: offset from this kernel's tracefs format file.
    match unsafe { ctx.read_at::<i32>(at) } {
        Ok(pid) => woken(pid as u32),
        Err(_) => 0,
    }
}

/// `sched:sched_wakeup` (classic: the fallback).
#[tracepoint]
pub fn sched_wakeup(ctx: TracePointContext) -> u32 {
    woken_pid(&ctx)
}

/// `sched:sched_wakeup_new` (classic: the fallback).
#[tracepoint]
pub fn sched_wakeup_new(ctx: TracePointContext) -> u32 {
    woken_pid(&ctx)
}

/// BTF `sched_wakeup(struct task_struct *p)`.
#[btf_tracepoint(function = "sched_wakeup")]
pub fn btf_sched_wakeup(ctx: BtfTracePointContext) -> i32 {
    woken(task_tid(ctx.arg(0))) as i32
}

/// BTF `sched_wakeup_new(struct task_struct *p)`.
#[btf_tracepoint(function = "sched_wakeup_new")]
pub fn btf_sched_wakeup_new(ctx: BtfTracePointContext) -> i32 {
    woken(task_tid(ctx.arg(0))) as i32
}

#[inline(always)]
fn tcp_event(ctx: &TracePointContext, sk_offset: u32, what: u32) -> u32 {
    // SAFETY: offset from this kernel's tracefs format file.
    let Ok(sk) = (unsafe { ctx.read_at::<u64>(sk_offset as usize) }) else {
        return 0;
    };
    if CONNS.get_ptr(sk).is_none() {
        return 0;
    }
    match EVENTS.reserve::<TcpEvent>(0) {
        Some(mut entry) => {
            entry.write(TcpEvent {
                kind: EVENT_TCP,
                what,
                sk,
                t_ns: now_ns(),
            });
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
    0
}

/// `tcp:tcp_retransmit_skb`.
#[tracepoint]
pub fn tcp_retransmit_skb(ctx: TracePointContext) -> u32 {
    tcp_event(&ctx, offsets().retransmit_sk, TCP_RETRANSMIT)
}

/// `tcp:tcp_receive_reset`.
#[tracepoint]
pub fn tcp_receive_reset(ctx: TracePointContext) -> u32 {
    tcp_event(&ctx, offsets().reset_received_sk, TCP_RESET_RECEIVED)
}

/// `tcp:tcp_send_reset`.
#[tracepoint]
pub fn tcp_send_reset(ctx: TracePointContext) -> u32 {
    tcp_event(&ctx, offsets().reset_sent_sk, TCP_RESET_SENT)
}
