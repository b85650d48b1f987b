//! Gathering, for one finished request, the signals inside its windows:
//! what the attribution rules read.

use crate::{
    causes::{Evidence, NETWORK_LOOKBACK_NS, RequestTimes},
    host::targets,
    nvml::Sampler,
    requests::{Join, RequestRecord},
    signals::SignalStore,
};
use ttft_trace_common::signals::{SCHED_BLOCKED, TCP_RETRANSMIT, TcpEvent};

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
    let qe = ev.request.t_gpu_start_ns();
    fill_window(&mut ev, record, store, gpu, a, qe, ft);
    for e in store.tcp_events_in(record.sk, a, delivered) {
        add_tcp(&mut ev, e);
    }
    let pid = record.gpu_pid.unwrap_or(record.pid);
    let started = targets::start_time_ns(pid);
    ev.first_gpu_work_in_window = store
        .first_episode(pid)
        .is_some_and(|first| first >= a && first <= ft)
        && started.is_some_and(|s| s >= traced_since_ns);
    ev.gpu_process_age_ns = started.map(|s| a.saturating_sub(s));
    ev
}

/// Evidence over one stall `[start, end]` of `record`'s stream (`causes::StallEvidence`):
/// the TTFT evidence's signals with the stall as the TTFT window, split as TTFT is at the
/// GPU step that ended it (`join` of the stall's window: the last episode completed in it;
/// `None` for a request joined to no GPU work): *queue* from the stall's start to that
/// step's launch, *GPU* the step; without a step, no queue (only the run-queue delay is
/// read). Retransmits from `causes::NETWORK_LOOKBACK_NS` before the stall to its end.
pub fn gather_stall(
    record: &RequestRecord,
    store: &SignalStore,
    gpu: Option<&Sampler>,
    join: Option<&Join>,
    start: u64,
    end: u64,
) -> Evidence {
    let span = end.saturating_sub(start);
    // A step launched before the stall began counts from its start, as a
    // request that joined a running batch does.
    let step = join.and_then(|j| j.episode).map(|e| {
        let launch = e.t_first_launch_ns.clamp(start, end);
        (launch - start, e.t_copy_done_ns.clamp(launch, end) - launch)
    });
    let mut ev = Evidence::new(RequestTimes {
        t_arrive_ns: start,
        ttft_ns: Some(span),
        queue_ns: step.map(|s| s.0),
        gpu_ns: step.map(|s| s.1),
        gpu_steps_waited: join.map(|j| j.steps_waited),
        gpu_idle_before_start_ns: join.and_then(|j| j.idle_before_start_ns),
        ..RequestTimes::default()
    });
    let qe = ev.request.t_gpu_start_ns();
    fill_window(&mut ev, record, store, gpu, start, qe, end);
    for e in store.tcp_events_in(record.sk, start.saturating_sub(NETWORK_LOOKBACK_NS), end) {
        add_tcp(&mut ev, e);
    }
    ev
}

/// How long after a delivery stall's end a retransmit still counts: the tracepoint stamps a
/// retransmit after its transmission returns, and on loopback the ACK it draws can be
/// processed inside that call, so the retransmit that ended a stall is dated a few
/// microseconds after the stall's end (axum, which streams with Nagle on, under loss pulses:
/// 2 of 9 stalls ended by their only retransmit).
const RETRANSMIT_STAMP_SLACK_NS: u64 = 5_000_000;

/// Evidence over one stall seen only at the delivery, `[start, end]` between two chunks'
/// ACKs: the sends were on time, so only the request's connection is read (retransmits from
/// `causes::NETWORK_LOOKBACK_NS` before the stall to [`RETRANSMIT_STAMP_SLACK_NS`] after it).
pub fn gather_delivery_stall(
    record: &RequestRecord,
    store: &SignalStore,
    start: u64,
    end: u64,
) -> Evidence {
    let mut ev = Evidence::new(RequestTimes {
        t_arrive_ns: start,
        ttft_ns: Some(end.saturating_sub(start)),
        ..RequestTimes::default()
    });
    let (from, to) = (
        start.saturating_sub(NETWORK_LOOKBACK_NS),
        end.saturating_add(RETRANSMIT_STAMP_SLACK_NS),
    );
    for e in store.tcp_events_in(record.sk, from, to) {
        add_tcp(&mut ev, e);
    }
    ev
}

/// The signals of a window `[a, ft]` whose queue part ends at `qe` (when known): run-queue
/// delay, CPU-stage and GPU-thread time, copies, GPU readings. What TTFT and stall evidence
/// share.
fn fill_window(
    ev: &mut Evidence,
    record: &RequestRecord,
    store: &SignalStore,
    gpu: Option<&Sampler>,
    a: u64,
    qe: Option<u64>,
    ft: u64,
) {
    let runq = store.runq_in(a, ft, |_| true);
    ev.runq_ns = runq.total_ns;
    ev.runq_max_ns = runq.max_ns;
    if let Some(qe) = qe {
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
    let copies = store.copies_in(a, ft);
    ev.large_copies = copies.count;
    ev.large_copy_bytes = copies.bytes;
    ev.large_copy_h2d_bytes = copies.h2d_bytes;
    ev.large_copy_d2h_bytes = copies.d2h_bytes;
    ev.gpu = gpu.and_then(|g| g.window(record.gpu_pid.and_then(|p| g.gpu_of_pid(p)), a, ft));
}

/// A TCP event on the request's socket: a retransmit, or a reset.
fn add_tcp(ev: &mut Evidence, e: &TcpEvent) {
    if e.what == TCP_RETRANSMIT {
        ev.add_retransmit(e.t_ns);
    } else {
        ev.resets += 1;
    }
}
