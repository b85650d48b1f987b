//! Stalls after the first token: thresholds, windows, bounds, and the
//! pace of a stream's last quarter against its first.

use crate::requests::stream_stalls::{
    StallConfig, StallWindow, find_stalls, threshold_ns, tpot_ratio_permille,
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
            t_end_ns: 1_265 * MS
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
    assert_eq!(tpot_ratio_permille(&[5 * MS; 7]), None);
}

#[test]
fn a_stream_slowing_to_three_times_its_pace_reads_3000_permille() {
    let mut gaps = vec![5 * MS; 8];
    gaps.extend(vec![15 * MS; 8]);
    assert_eq!(tpot_ratio_permille(&gaps), Some(3000));
    assert_eq!(tpot_ratio_permille(&[5 * MS; 16]), Some(1000));
}
