//! Scheduler tracepoints that keep the traced process tree current: a child
//! forked by a traced process is traced from its first instruction, and
//! per-thread state is dropped when a thread exits.

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::tracepoint, programs::TracePointContext,
};
use ttft_trace_common::{QUOTA_THREADS, Stat, offsets::ABSENT};

use crate::{
    cuda::send_discover,
    maps::{
        EXITED, SCHED_STATE, SEND_ARGS, THREADS, TLS_CALLS, TRACKED, bump_stat, discover,
        is_tracked, mark_traced, offsets, over_share, workload_of,
    },
    mem::now_ns,
};

/// `sched:sched_process_fork`: runs in the parent's context, so the parent
/// process is the current tgid (the tracepoint's `parent_pid` is the forking
/// *thread*, which is not in TRACKED when it predates tracing). Fires for new
/// threads too; a thread's id lands in TRACKED and is removed at its exit.
/// The child joins its parent's workload, unless the workload's tenant
/// holds its share of `TRACKED` (counted): then the child is not traced.
#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    let Some(workload) = workload_of((bpf_get_current_pid_tgid() >> 32) as u32) else {
        return 0;
    };
    if over_share(workload, QUOTA_THREADS) {
        bump_stat(Stat::TrackedQuota);
        return 0;
    }
    // SAFETY: offset from this kernel's tracefs format file.
    if let Ok(child) = unsafe { ctx.read_at::<i32>(offsets().fork_child_pid as usize) } {
        mark_traced(child as u32, true);
        if TRACKED.insert(child as u32, workload, 0).is_err() {
            bump_stat(Stat::TrackedFull);
        } else if !discover() {
            // `attach` binds the uprobes to each traced process: a child
            // (or a thread, which userspace skips) gets its own at once,
            // not at the next /proc scan. Its inherited breakpoints do not
            // fire for it until then.
            send_discover(child as u32, now_ns());
        }
    }
    0
}

/// `sched:sched_process_exit`: fires once per exiting thread, in its context.
#[tracepoint]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((id >> 32) as u32, id as u32);
    if !is_tracked(tgid) {
        return 0;
    }
    let _ = THREADS.remove(tid);
    let _ = SCHED_STATE.remove(tid);
    // A send noted but never completed, or a TLS call never returned from
    // (the thread died in it).
    let _ = SEND_ARGS.remove(tid);
    let _ = TLS_CALLS.remove(tid);
    let off = offsets();
    let group_dead = if off.exit_group_dead == ABSENT {
        tid == tgid
    } else {
        // SAFETY: offset from this kernel's tracefs format file.
        unsafe { ctx.read_at::<u8>(off.exit_group_dead as usize) }.is_ok_and(|v| v != 0)
    };
    if tid != tgid {
        let _ = TRACKED.remove(tid);
        mark_traced(tid, false);
    }
    if group_dead {
        if let Some(workload) = workload_of(tgid) {
            let _ = EXITED.insert(tgid, workload, 0);
        }
        let _ = TRACKED.remove(tgid);
        // The leader's id stays marked while other threads live: it is the
        // process's id, which they are checked by.
        mark_traced(tgid, false);
    }
    0
}
