//! Scheduler and TCP signals for "why was it slow": run-queue delay,
//! on-CPU and blocked time of the traced threads, and TCP retransmits and
//! resets on followed connections.
//!
//! Every interval is summed per process and run-queue waits are counted in
//! a log2 histogram, all in the kernel; only intervals of at least
//! `SCHED_MIN_NS` become events (the scheduler can switch a million times a
//! second on a busy host; the long intervals are the ones that explain a
//! slow request).

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::tracepoint,
    programs::TracePointContext,
};
use ttft_trace_common::{
    Stat,
    signals::{
        EVENT_SCHED, EVENT_TCP, RUNQ_SUM_SLOT, SCHED_BLOCKED, SCHED_ONCPU, SCHED_RUNQ, SchedEvent,
        SchedState, SchedTotals, TCP_RESET_RECEIVED, TCP_RESET_SENT, TCP_RETRANSMIT, TcpEvent,
        runq_bucket,
    },
};

use crate::maps::{
    CONNS, EVENTS, RUNQ_HIST, SCHED_STATE, SCHED_TOTALS, bump_stat, is_tracked, offsets,
    sched_min_ns, wakeup_flag,
};

/// `prev_state` bits that mean "not runnable"; a preempted task reports 0
/// or `TASK_REPORT_MAX` (0x100), both with these bits clear.
const BLOCKED_STATE_MASK: u64 = 0xff;
/// `prev_state` of a thread's last switch, as the tracepoint reports it:
/// `EXIT_DEAD` (0x10) or `EXIT_ZOMBIE` (0x20). Its state goes with it, so
/// that threads that come and go leave no entry behind.
const EXITING_STATE_MASK: u64 = 0x30;

#[inline(always)]
fn now_ns() -> u64 {
    // SAFETY: plain helper call.
    unsafe { bpf_ktime_get_ns() }
}

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

/// `sched:sched_switch`, in the context of the task switched out.
#[tracepoint]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    let off = offsets();
    let now = now_ns();
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if tid != 0 && is_tracked(tgid) {
        // SAFETY: offset from this kernel's tracefs format file.
        let prev_state = unsafe { ctx.read_at::<u64>(off.switch_prev_state as usize) }.unwrap_or(0);
        if prev_state & EXITING_STATE_MASK != 0 {
            // The thread's last switch: sched_process_exit dropped its
            // state already; updating it here would make it again.
            let _ = SCHED_STATE.remove(tid);
        } else {
            switched_out(tgid, tid, now, prev_state & BLOCKED_STATE_MASK != 0);
        }
    }
    // SAFETY: as above.
    if let Ok(next) = unsafe { ctx.read_at::<i32>(off.switch_next_pid as usize) } {
        switched_in(next as u32, now);
    }
    0
}

#[inline(always)]
fn switched_out(tgid: u32, tid: u32, now: u64, blocked: bool) {
    let st = match SCHED_STATE.get_ptr_mut(tid) {
        Some(p) => p,
        None => {
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
fn switched_in(tid: u32, now: u64) {
    let Some(st) = SCHED_STATE.get_ptr_mut(tid) else {
        return;
    };
    // SAFETY: live map value.
    let st = unsafe { &mut *st };
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

#[inline(always)]
fn woken(ctx: &TracePointContext) -> u32 {
    // SAFETY: offset from this kernel's tracefs format file.
    let Ok(pid) = (unsafe { ctx.read_at::<i32>(offsets().wakeup_pid as usize) }) else {
        return 0;
    };
    let tid = pid as u32;
    let Some(st) = SCHED_STATE.get_ptr_mut(tid) else {
        return 0;
    };
    // SAFETY: live map value.
    let st = unsafe { &mut *st };
    if st.blocked == 0 {
        return 0;
    }
    let now = now_ns();
    let slept = now.saturating_sub(st.t_off_ns);
    if let Some(t) = totals(st.tgid) {
        // SAFETY: this CPU's copy.
        unsafe { (*t).blocked_ns += slept };
    }
    emit(SCHED_BLOCKED, st.tgid, tid, st.t_off_ns, now);
    st.blocked = 0;
    st.t_runnable_ns = now;
    0
}

/// `sched:sched_wakeup`.
#[tracepoint]
pub fn sched_wakeup(ctx: TracePointContext) -> u32 {
    woken(&ctx)
}

/// `sched:sched_wakeup_new`.
#[tracepoint]
pub fn sched_wakeup_new(ctx: TracePointContext) -> u32 {
    woken(&ctx)
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
