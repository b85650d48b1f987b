//! Stalls after the first token, judged through [`Judge::request`] on
//! synthetic signal stores: one test per cause, a clean stream, and a stall
//! with no evidence (unexplained).

use ttft_trace_common::{
    Direction, EpisodeEvent,
    signals::{
        CopyEvent, EVENT_COPY, EVENT_SCHED, EVENT_TCP, SCHED_BLOCKED, SCHED_RUNQ, SchedEvent,
        TCP_RETRANSMIT, TcpEvent,
    },
};

use super::*;
use crate::{
    causes::{CauseClass, CauseConfig, RequestId},
    report::tests::{MS, T0, record},
    requests::{
        Outcome,
        stream_stalls::{SeenAt, StallConfig},
    },
};

/// The stall of [`stalled`]: the sixth gap, after five of 20 ms from the
/// first token at T0 + 10 ms.
const START: u64 = T0 + 110 * MS;
const MIB: u64 = 1 << 20;

/// A stream of twelve 20 ms gaps, the sixth `stall_ms` long.
fn stalled(stall_ms: u64) -> RequestRecord {
    let mut r = record(Outcome::Ok);
    r.itl_ns = vec![20 * MS; 12];
    r.itl_ns[5] = stall_ms * MS;
    r
}

fn judge() -> Judge {
    Judge::new(CauseConfig::default(), StallConfig::default(), None)
}

fn judged(j: &mut Judge, r: RequestRecord, store: &SignalStore) -> JudgedStalls {
    judged_on(j, r, store, None)
}

fn judged_on(
    j: &mut Judge,
    r: RequestRecord,
    store: &SignalStore,
    episodes: Option<&EpisodeHistory>,
) -> JudgedStalls {
    let w = WorkloadSignals {
        root: 1,
        store,
        episodes,
    };
    j.request(r, &w, T0).stalls
}

/// The one stall's causes, by class.
fn classes(s: &JudgedStalls) -> Vec<CauseClass> {
    assert_eq!(s.count, 1, "{s:?}");
    s.windows[0].causes.iter().map(|c| c.class).collect()
}

fn explained(s: &JudgedStalls, class: CauseClass) -> Option<u64> {
    s.windows[0]
        .causes
        .iter()
        .find(|c| c.class == class)
        .map(|c| c.explained_ns)
}

fn sched(what: u32, tid: u32, a: u64, b: u64) -> SchedEvent {
    SchedEvent {
        kind: EVENT_SCHED,
        what,
        tgid: 1,
        tid,
        t_start_ns: a,
        t_end_ns: b,
    }
}

fn retransmit(sk: u64, t_ns: u64) -> TcpEvent {
    TcpEvent {
        kind: EVENT_TCP,
        what: TCP_RETRANSMIT,
        sk,
        t_ns,
    }
}

#[test]
fn a_steady_stream_has_no_stall() {
    let mut r = stalled(20);
    r.itl_ns[11] = 50 * MS;
    let s = judged(&mut judge(), r, &SignalStore::default());
    assert_eq!((s.count, s.total_ns, s.longest_ns), (0, 0, 0));
    assert!(s.windows.is_empty());
    assert_eq!(s.threshold_ns, 100 * MS, "max(100 ms, 4 x 20 ms)");
    assert!(!s.degrading);
}

#[test]
fn a_stall_without_evidence_is_unexplained() {
    let s = judged(&mut judge(), stalled(500), &SignalStore::default());
    assert_eq!((s.count, s.total_ns, s.longest_ns), (1, 500 * MS, 500 * MS));
    let w = &s.windows[0];
    assert_eq!((w.t_start_ns, w.t_end_ns), (START, START + 500 * MS));
    assert_eq!(w.duration_ns, 500 * MS);
    assert!(w.causes.is_empty());
    assert_eq!(w.labels(), vec!["unexplained"]);
    assert_eq!(w.interfering_request, None);
}

#[test]
fn another_requests_prefill_in_the_gap_is_named() {
    let other = |root: u32, arrive_ms: u64, queue_ms: u64, gpu_pid: u32| {
        let mut b = record(Outcome::Ok);
        b.sk = 0xdef;
        b.request_index = 3;
        b.t_arrive_ns = T0 + arrive_ms * MS;
        b.queue_ns = Some(queue_ms * MS);
        // Its GPU step ends at 600 ms, its first token sent at 605 ms.
        b.gpu_ns = Some((600 - arrive_ms - queue_ms) * MS);
        b.t_first_token_ns = Some(T0 + 605 * MS);
        b.gpu_pid = Some(gpu_pid);
        (root, b)
    };
    let store = SignalStore::default();
    // Prefill [160, 600] ms: 440 of the stall's 500 ms.
    let mut j = judge();
    let (_, b) = other(1, 100, 60, 1);
    judged(&mut j, b, &store);
    let s = judged(&mut j, stalled(500), &store);
    assert_eq!(classes(&s), vec![CauseClass::PrefillInterference]);
    assert_eq!(
        explained(&s, CauseClass::PrefillInterference),
        Some(440 * MS)
    );
    let id = RequestId {
        conn: 0xdef,
        request_index: 3,
    };
    assert_eq!(s.windows[0].interfering_request, Some(id));
    // Not when it covers under half the stall, ran on another GPU process,
    // or belongs to another workload.
    for (root, arrive, queue, pid) in [(1, 400, 100, 1), (1, 100, 60, 99), (2, 100, 60, 1)] {
        let mut j = judge();
        let (root, b) = other(root, arrive, queue, pid);
        let w = WorkloadSignals {
            root,
            store: &store,
            episodes: None,
        };
        j.request(b, &w, T0);
        let s = judged(&mut j, stalled(500), &store);
        assert!(s.windows[0].causes.is_empty(), "{root} {arrive} {pid}");
        assert_eq!(s.windows[0].interfering_request, None);
    }
}

#[test]
fn run_queue_delay_in_the_gap_is_cpu() {
    // The GPU-launching thread waited for a CPU (on a CPU-stage thread the
    // TTFT rule counts the wait as stage time too).
    let mut store = SignalStore::default();
    store.on_episode(1, 2, T0);
    store.on_sched(&sched(SCHED_RUNQ, 2, START + 10 * MS, START + 200 * MS));
    // Outside the gap: not counted.
    store.on_sched(&sched(SCHED_RUNQ, 2, T0 + 700 * MS, T0 + 900 * MS));
    let s = judged(&mut judge(), stalled(500), &store);
    assert_eq!(classes(&s), vec![CauseClass::Cpu]);
    assert_eq!(explained(&s, CauseClass::Cpu), Some(190 * MS));
}

#[test]
fn copies_in_the_gap_are_gpu_memory() {
    let mut store = SignalStore::default();
    for (dir, t) in [
        (Direction::HostToDevice, START + 50 * MS),
        (Direction::DeviceToHost, START + 350 * MS),
    ] {
        store.on_copy(&CopyEvent {
            kind: EVENT_COPY,
            tgid: 1,
            tid: 9,
            direction: dir as u32,
            bytes: 150 * MIB,
            t_ns: t,
        });
    }
    // The step that ended the stall: launched at +400 ms, done at +495.
    let episodes = history(&[(400, 495)]);
    let s = judged_on(&mut judge(), stalled(500), &store, Some(&episodes));
    assert_eq!(classes(&s), vec![CauseClass::GpuMemory]);
    // The step (95 ms) and the copies' span before it (300 ms), as for TTFT.
    assert_eq!(explained(&s, CauseClass::GpuMemory), Some(395 * MS));
}

#[test]
fn a_retransmit_in_or_just_before_the_gap_is_network() {
    let r = stalled(500);
    let sk = r.sk;
    let with = |events: &[TcpEvent]| {
        let mut store = SignalStore::default();
        for e in events {
            store.on_tcp(e);
        }
        judged(&mut judge(), r.clone(), &store)
    };
    let s = with(&[retransmit(sk, START + 40 * MS)]);
    assert_eq!(classes(&s), vec![CauseClass::Network]);
    assert_eq!(explained(&s, CauseClass::Network), Some(460 * MS));
    // Shortly before: the whole stall.
    let s = with(&[retransmit(sk, START - 100 * MS)]);
    assert_eq!(explained(&s, CauseClass::Network), Some(500 * MS));
    // Long before, near its end, or on another connection: not network.
    for e in [
        retransmit(sk, START - 1_000 * MS),
        retransmit(sk, START + 450 * MS),
        retransmit(sk + 1, START + 40 * MS),
    ] {
        assert!(with(&[e]).windows[0].causes.is_empty(), "{e:?}");
    }
}

/// Episodes of the GPU thread (tid 2), `(launch, done)` in ms after the
/// stall's start.
fn history(steps: &[(u64, u64)]) -> EpisodeHistory {
    let mut h = EpisodeHistory::new(60_000 * MS, 64);
    for &(launch, done) in steps {
        h.insert(&EpisodeEvent {
            tgid: 1,
            tid: 2,
            t_first_launch_ns: START + launch * MS,
            t_copy_done_ns: START + done * MS,
            ..EpisodeEvent::default()
        });
    }
    h
}

#[test]
fn an_idle_gpu_and_a_blocked_launcher_in_the_gap_is_batching() {
    let mut store = SignalStore::default();
    store.on_episode(1, 2, T0);
    store.on_sched(&sched(SCHED_BLOCKED, 2, START - 10 * MS, START + 478 * MS));
    // The GPU idle until the step that ended the stall, at +480 ms.
    let episodes = history(&[(480, 495)]);
    let s = judged_on(&mut judge(), stalled(500), &store, Some(&episodes));
    assert_eq!(classes(&s), vec![CauseClass::Batching]);
    assert_eq!(explained(&s, CauseClass::Batching), Some(480 * MS));
    // Without the request's GPU work known, the GPU's idle time is not.
    let mut r = stalled(500);
    r.queue_ns = None;
    let s = judged_on(&mut judge(), r, &store, Some(&episodes));
    assert!(s.windows[0].causes.is_empty());
}

/// The stream's own connection thread sleeps until its next token is
/// handed over, after the step that ended the stall: that wait is not a
/// CPU stage that held the request (the queue ends at the step's launch,
/// as for TTFT). Seen live on the demo before the split.
#[test]
fn the_streams_own_thread_waiting_for_its_token_is_not_cpu() {
    let mut store = SignalStore::default();
    store.on_episode(1, 2, T0);
    store.on_sched(&sched(SCHED_BLOCKED, 9, START + MS, START + 497 * MS));
    let episodes = history(&[(400, 495)]);
    let s = judged_on(&mut judge(), stalled(500), &store, Some(&episodes));
    assert!(s.windows[0].causes.is_empty(), "{s:?}");
}

#[test]
fn a_long_gap_the_gpu_spent_on_others_is_queueing() {
    let steps: Vec<(u64, u64)> = (0..25).map(|i| (i * 100, (i + 1) * 100)).collect();
    let episodes = history(&steps);
    let store = SignalStore::default();
    let s = judged_on(&mut judge(), stalled(2_500), &store, Some(&episodes));
    assert_eq!(classes(&s), vec![CauseClass::Queueing]);
    // The wait before the step that ended it (launched at +2400 ms), all busy.
    assert_eq!(explained(&s, CauseClass::Queueing), Some(2_400 * MS));
    // Under the queueing threshold (2 s), the same busy GPU is no cause.
    let s = judged_on(&mut judge(), stalled(1_500), &store, Some(&episodes));
    assert!(s.windows[0].causes.is_empty());
}

#[test]
fn a_slowing_stream_is_degrading_and_dropped_windows_are_counted() {
    let mut r = stalled(20);
    for (i, g) in r.itl_ns.iter_mut().enumerate().skip(9) {
        *g = 50 * MS + i as u64;
    }
    let s = judged(&mut judge(), r, &SignalStore::default());
    assert!(s.degrading, "{s:?}");
    assert!(s.pace_ratio_permille.is_some_and(|p| p >= 2500));
    let mut r = stalled(20);
    r.itl_ns = [20 * MS, 400 * MS].repeat(20);
    let mut j = Judge::new(
        CauseConfig::default(),
        StallConfig {
            fixed_ns: Some(200 * MS),
            ..StallConfig::default()
        },
        None,
    );
    let s = judged(&mut j, r, &SignalStore::default());
    assert_eq!((s.count, s.windows.len(), s.windows_dropped), (20, 16, 4));
    assert_eq!(j.stall_windows_dropped, 4);
}

/// A stream sent on time (twelve 20 ms gaps from T0 + 10 ms) whose chunks'
/// ACKs, from 50 µs after the first send, stand still `gap_ms` after the
/// sixth chunk (a stall on the wire), the rest 20 ms apart.
fn delivered_late(gap_ms: u64) -> RequestRecord {
    let mut r = record(Outcome::Ok);
    r.itl_ns = vec![20 * MS; 12];
    r.t_first_chunk_acked_ns = r.t_first_token_ns.map(|t| t + MS / 20);
    r.chunk_ack_gaps_ns = vec![20 * MS; 12];
    r.chunk_ack_gaps_ns[5] = gap_ms * MS;
    r
}

/// The sixth chunk's ACK: where the delivery stall of [`delivered_late`] starts.
const ACK_START: u64 = START + MS / 20;

#[test]
fn a_late_delivery_after_a_retransmit_is_network() {
    let r = delivered_late(500);
    let sk = r.sk;
    let mut store = SignalStore::default();
    store.on_tcp(&retransmit(sk, ACK_START + 10 * MS));
    let s = judged(&mut judge(), r, &store);
    assert_eq!((s.count, s.total_ns), (1, 500 * MS), "{s:?}");
    let w = &s.windows[0];
    assert_eq!(w.seen_at, SeenAt::Delivery);
    assert_eq!(
        (w.t_start_ns, w.t_end_ns),
        (ACK_START, ACK_START + 500 * MS)
    );
    assert_eq!(classes(&s), vec![CauseClass::Network]);
    assert_eq!(
        explained(&s, CauseClass::Network),
        Some(500 * MS),
        "all of it"
    );
    // The retransmit that repaired the loss, at the stall's end, is enough:
    // the loss began before it.
    let mut store = SignalStore::default();
    store.on_tcp(&retransmit(sk, ACK_START + 495 * MS));
    let s = judged(&mut judge(), delivered_late(500), &store);
    assert_eq!(explained(&s, CauseClass::Network), Some(500 * MS));
    // Stamped just after the ACK it drew (on loopback, inside its own
    // transmission): up to 5 ms after the stall's end counts, not later.
    let mut store = SignalStore::default();
    store.on_tcp(&retransmit(sk, ACK_START + 502 * MS));
    let s = judged(&mut judge(), delivered_late(500), &store);
    assert_eq!(classes(&s), vec![CauseClass::Network]);
    let mut store = SignalStore::default();
    store.on_tcp(&retransmit(sk, ACK_START + 510 * MS));
    let s = judged(&mut judge(), delivered_late(500), &store);
    assert_eq!(classes(&s), vec![]);
    // Up to 200 ms before it counts; not before, nor on another connection.
    let mut store = SignalStore::default();
    store.on_tcp(&retransmit(sk, ACK_START - 150 * MS));
    assert_eq!(
        classes(&judged(&mut judge(), delivered_late(500), &store)),
        vec![CauseClass::Network]
    );
    let mut store = SignalStore::default();
    store.on_tcp(&retransmit(sk, ACK_START - 250 * MS));
    store.on_tcp(&retransmit(sk + 1, ACK_START + 10 * MS));
    assert_eq!(
        classes(&judged(&mut judge(), delivered_late(500), &store)),
        vec![]
    );
}

#[test]
fn a_late_delivery_without_a_retransmit_is_unexplained_whatever_else_ran() {
    // Run-queue delay in the window would be `cpu` for a send stall: the
    // sends were on time, so it did not hold this one.
    let mut store = SignalStore::default();
    store.on_episode(1, 2, T0);
    store.on_sched(&sched(
        SCHED_RUNQ,
        2,
        ACK_START + 10 * MS,
        ACK_START + 300 * MS,
    ));
    let s = judged(&mut judge(), delivered_late(500), &store);
    assert_eq!(s.windows[0].seen_at, SeenAt::Delivery);
    assert_eq!(classes(&s), vec![]);
    assert_eq!(s.windows[0].labels(), vec!["unexplained"]);
}

#[test]
fn a_stall_seen_at_the_send_and_the_delivery_is_one_stall() {
    // The sixth send gap is 500 ms and so is the gap between those chunks' ACKs.
    let mut r = delivered_late(500);
    r.itl_ns[5] = 500 * MS;
    let s = judged(&mut judge(), r, &SignalStore::default());
    assert_eq!((s.count, s.total_ns), (1, 500 * MS), "{s:?}");
    assert_eq!(s.windows[0].seen_at, SeenAt::Send);
    assert_eq!(s.windows[0].t_start_ns, START);
}

#[test]
fn delivery_gaps_under_the_threshold_are_no_stall() {
    // 90 ms: under the 100 ms floor; and a delivery stall is judged against
    // the send side's threshold too (its pace: 4 x 40 ms here), even when
    // ACKs that cover several chunks make the delivery median 0.
    let s = judged(&mut judge(), delivered_late(90), &SignalStore::default());
    assert_eq!(s.count, 0, "{s:?}");
    let mut r = delivered_late(150);
    r.itl_ns = vec![40 * MS; 12];
    for (i, g) in r.chunk_ack_gaps_ns.iter_mut().enumerate() {
        if i != 5 {
            *g = if i % 2 == 0 { 0 } else { 80 * MS };
        }
    }
    let s = judged(&mut judge(), r, &SignalStore::default());
    assert_eq!((s.count, s.threshold_ns), (0, 160 * MS), "{s:?}");
}

#[test]
fn send_and_delivery_stalls_are_listed_in_time_order_and_capped() {
    let mut r = delivered_late(500);
    r.itl_ns[1] = 300 * MS;
    // The delivery gaps follow the sends: 300 ms at the second as well.
    r.chunk_ack_gaps_ns[1] = 300 * MS;
    let s = judged(&mut judge(), r.clone(), &SignalStore::default());
    let seen: Vec<SeenAt> = s.windows.iter().map(|w| w.seen_at).collect();
    assert_eq!(seen, [SeenAt::Send, SeenAt::Delivery]);
    assert_eq!((s.count, s.total_ns, s.longest_ns), (2, 800 * MS, 500 * MS));
    let capped = StallConfig {
        max_listed: 1,
        ..StallConfig::default()
    };
    let mut j = Judge::new(CauseConfig::default(), capped, None);
    let s = judged(&mut j, r, &SignalStore::default());
    assert_eq!((s.count, s.windows.len(), s.windows_dropped), (2, 1, 1));
    assert_eq!(s.windows[0].seen_at, SeenAt::Send);
}
