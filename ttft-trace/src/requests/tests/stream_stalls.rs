//! Stalls after the first token: thresholds, windows, bounds, and the
//! pace of a stream's last quarter against its first.

use crate::requests::stream_stalls::{
    SeenAt, StallConfig, StallWindow, find_stalls, quarter_ratio_permille, threshold_ns,
};

const MS: u64 = 1_000_000;

#[test]
fn a_steady_stream_has_no_stall() {
    let gaps = vec![5 * MS; 64];
    let stalls = find_stalls(1_000 * MS, &gaps, &StallConfig::default());
    assert_eq!(stalls.count, 0);
    assert_eq!(
        stalls.threshold_ns,
        100 * MS,
        "the 100 ms floor beats 4 × 5 ms"
    );
}

#[test]
fn a_gap_over_the_floor_is_a_stall_with_its_window() {
    let mut gaps = vec![5 * MS; 10];
    gaps[3] = 250 * MS;
    let stalls = find_stalls(1_000 * MS, &gaps, &StallConfig::default());
    assert_eq!(stalls.count, 1);
    assert_eq!(stalls.total_ns, 250 * MS);
    assert_eq!(stalls.longest_ns, 250 * MS);
    // chunk 0 at 1000 ms, chunks 1..3 at 1005, 1010, 1015; the stall follows chunk 3
    assert_eq!(
        stalls.windows,
        vec![StallWindow {
            t_start_ns: 1_015 * MS,
            t_end_ns: 1_265 * MS,
            seen_at: SeenAt::Send,
        }]
    );
}

#[test]
fn a_slow_steady_stream_is_judged_on_its_own_median() {
    let mut gaps = vec![60 * MS; 20];
    gaps[5] = 200 * MS; // over the 100 ms floor, under 4 × 60 ms
    assert_eq!(threshold_ns(&gaps, &StallConfig::default()), 240 * MS);
    assert_eq!(find_stalls(0, &gaps, &StallConfig::default()).count, 0);
}

#[test]
fn a_fixed_threshold_overrides_the_median_rule() {
    let gaps = vec![5 * MS, 30 * MS, 5 * MS];
    let config = StallConfig {
        fixed_ns: Some(20 * MS),
        ..StallConfig::default()
    };
    assert_eq!(find_stalls(0, &gaps, &config).count, 1);
}

#[test]
fn windows_past_the_cap_are_counted_as_dropped() {
    let gaps = vec![5 * MS, 500 * MS, 5 * MS, 500 * MS, 5 * MS, 500 * MS, 5 * MS];
    let config = StallConfig {
        max_listed: 2,
        ..StallConfig::default()
    };
    let stalls = find_stalls(0, &gaps, &config);
    assert_eq!(
        (stalls.count, stalls.windows.len(), stalls.dropped),
        (3, 2, 1)
    );
    assert_eq!(stalls.total_ns, 1_500 * MS);
}

#[test]
fn no_gaps_no_stalls_no_ratio() {
    let stalls = find_stalls(0, &[], &StallConfig::default());
    assert_eq!(stalls.count, 0);
    assert_eq!(quarter_ratio_permille(&[5 * MS; 7]), None);
}

#[test]
fn a_stream_slowing_to_three_times_its_pace_reads_3000_permille() {
    let mut gaps = vec![5 * MS; 8];
    gaps.extend(vec![15 * MS; 8]);
    assert_eq!(quarter_ratio_permille(&gaps), Some(3000));
    assert_eq!(quarter_ratio_permille(&[5 * MS; 16]), Some(1000));
}

/// End to end, from the kernel's events: request A streams, request B
/// arrives on another connection and its prefill holds A's next chunk for
/// 425 ms; B finishes first. Judged in the order the correlator finishes
/// them, A's stall is `prefill_interference` naming B by its connection
/// and index, with the GPU's steps from the correlator's own episodes.
#[test]
fn another_requests_prefill_stalls_a_stream_end_to_end() {
    use super::{SSE_HEADERS, Wire, ms, sse_chunk, sse_done};
    use crate::{
        causes::{CauseClass, CauseConfig, RequestId},
        judging::{Judge, WorkloadSignals},
        signals::SignalStore,
    };

    const A: u64 = 0xa000;
    const B: u64 = 0xb000;
    let mut w = Wire::new();
    w.open(A, ms(999));
    w.open(B, ms(999));
    w.recv(A, ms(1000), 300);
    w.episode(ms(1010), ms(1050)); // A's prefill
    w.send(A, ms(1055), SSE_HEADERS);
    for t in [1060, 1080, 1100, 1120, 1140] {
        w.send(A, ms(t), &sse_chunk("a"));
    }
    w.recv(B, ms(1150), 300);
    w.episode(ms(1160), ms(1560)); // B's prefill, A's decode held
    w.send(B, ms(1561), SSE_HEADERS);
    w.send(B, ms(1562), &sse_chunk("b"));
    w.send(B, ms(1600), &sse_done());
    for t in [1565, 1585, 1605, 1625, 1645, 1665, 1685] {
        w.send(A, ms(t), &sse_chunk("a"));
    }
    w.send(A, ms(1700), &sse_done());
    let mut done = w.drain(ms(10_000));
    done.sort_by_key(|r| r.t_done_ns);
    assert_eq!(
        done.iter().map(|r| r.sk).collect::<Vec<_>>(),
        [B, A],
        "B ends first"
    );
    let store = SignalStore::default();
    let signals = WorkloadSignals {
        root: 1,
        store: &store,
        episodes: Some(w.c.episodes()),
    };
    let mut judge = Judge::new(CauseConfig::default(), StallConfig::default(), None);
    let judged: Vec<_> = done
        .into_iter()
        .map(|r| judge.request(r, &signals, ms(10_000)))
        .collect();
    assert_eq!(judged[0].stalls.count, 0, "B streamed without a stall");
    let s = &judged[1].stalls;
    assert_eq!((s.count, s.longest_ns), (1, ms(425)), "{s:?}");
    let stall = &s.windows[0];
    assert_eq!((stall.t_start_ns, stall.t_end_ns), (ms(1140), ms(1565)));
    let classes: Vec<CauseClass> = stall.causes.iter().map(|c| c.class).collect();
    assert_eq!(classes, [CauseClass::PrefillInterference]);
    // B's prefill: its GPU episode, 1160 to 1560 ms (not its egress after).
    assert_eq!(stall.causes[0].explained_ns, ms(400));
    assert_eq!(
        stall.interfering_request,
        Some(RequestId {
            conn: B,
            request_index: 0
        })
    );
}
