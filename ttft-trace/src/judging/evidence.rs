//! Gathering, for one finished request, the signals inside its windows:
//! what the attribution rules read.

use crate::{
    causes::{Evidence, RequestTimes},
    host::targets,
    nvml::Sampler,
    requests::RequestRecord,
    signals::SignalStore,
};
use ttft_trace_common::signals::{SCHED_BLOCKED, TCP_RETRANSMIT};

/// How soon after a stalled CPU stage wakes the request's GPU work may start
/// for the stall to count (tokenizing ends, the request joins the next step).
const STALL_HANDOFF_NS: u64 = 100_000_000;

/// Evidence for `record`; `traced_since_ns` is when tracing began (a
/// process started before it has no known first episode).
pub fn gather(
    record: &RequestRecord,
    store: &SignalStore,
    gpu: Option<&Sampler>,
    traced_since_ns: u64,
) -> Evidence {
    let mut ev = Evidence::new(RequestTimes::from(record));
    let a = record.t_arrive_ns;
    let Some(ttft) = ev.request.ttft_ns else {
        return ev;
    };
    let ft = a.saturating_add(ttft);
    let delivered = ev.request.t_delivered_ns().unwrap_or(ft);
    let runq = store.runq_in(a, ft, |_| true);
    ev.runq_ns = runq.total_ns;
    ev.runq_max_ns = runq.max_ns;
    if let Some(qe) = ev.request.t_gpu_start_ns() {
        let cpu_stage = |e: &ttft_trace_common::signals::SchedEvent| !store.is_gpu_thread(e.tid);
        ev.cpu_stage_oncpu_ns = store.oncpu_in(a, qe, cpu_stage).total_ns;
        // Only spells that end inside the wait: a thread that woke up then
        // was part of the work; idle pool threads block throughout.
        ev.cpu_stage_blocked_ns = store
            .blocked_in(a, qe, |e| cpu_stage(e) && e.t_end_ns <= qe)
            .total_ns;
        // A stalled stage blocks, then hands the request on: its spell ends
        // shortly before the GPU work starts. A thread idle for lack of work
        // also blocks inside the window, but wakes whenever work comes.
        ev.cpu_stage_thread_max_ns = store.max_thread_total(a, qe, |e| {
            cpu_stage(e)
                && (e.what != SCHED_BLOCKED
                    || (e.t_end_ns <= qe && e.t_end_ns.saturating_add(STALL_HANDOFF_NS) >= qe))
        });
        ev.gpu_thread_blocked_ns =
            store.max_thread_overlap(SCHED_BLOCKED, a, qe, |e| store.is_gpu_thread(e.tid));
        ev.large_copy_queue_span_ns = store.copies_in(a, qe).span_ns;
    }
    for e in store.tcp_events_in(record.sk, a, delivered) {
        if e.what == TCP_RETRANSMIT {
            ev.add_retransmit(e.t_ns);
        } else {
            ev.resets += 1;
        }
    }
    let copies = store.copies_in(a, ft);
    ev.large_copies = copies.count;
    ev.large_copy_bytes = copies.bytes;
    ev.large_copy_h2d_bytes = copies.h2d_bytes;
    ev.large_copy_d2h_bytes = copies.d2h_bytes;
    let pid = record.gpu_pid.unwrap_or(record.pid);
    ev.gpu = gpu.and_then(|g| g.window(record.gpu_pid.and_then(|p| g.gpu_of_pid(p)), a, ft));
    let started = targets::start_time_ns(pid);
    ev.first_gpu_work_in_window = store
        .first_episode(pid)
        .is_some_and(|first| first >= a && first <= ft)
        && started.is_some_and(|s| s >= traced_since_ns);
    ev.gpu_process_age_ns = started.map(|s| a.saturating_sub(s));
    ev
}
