//! Filling the evidence.

use super::super::RETRANSMIT_TIMES_CAP;
use super::*;

#[test]
fn retransmits_are_all_counted_and_the_earliest_kept_in_order() {
    let mut ev = slow_request();
    for i in (0..100u64).rev() {
        ev.add_retransmit(T0 + ms(i));
    }
    ev.add_retransmit(T0 + ms(5));
    assert_eq!(ev.retransmits, 101);
    assert_eq!(ev.retransmit_times_ns.len(), RETRANSMIT_TIMES_CAP);
    assert!(ev.retransmit_times_ns.is_sorted());
    assert_eq!(ev.retransmit_times_ns.first(), Some(&T0));
    assert_eq!(
        ev.retransmit_times_ns.last(),
        Some(&(T0 + ms(RETRANSMIT_TIMES_CAP as u64 - 2)))
    );
    // A later one than every kept time is counted, not kept.
    ev.add_retransmit(T0 + ms(1_000));
    assert_eq!(ev.retransmits, 102);
    assert!(!ev.retransmit_times_ns.contains(&(T0 + ms(1_000))));
}

#[test]
fn evidence_serialises_its_signals_without_the_request_figures() {
    let mut ev = slow_request();
    ev.runq_ns = 7;
    ev.add_retransmit(T0 + 1);
    let v = serde_json::to_value(&ev).expect("json");
    assert_eq!(v["runq_ns"], 7);
    assert_eq!(v["retransmits"], 1);
    assert_eq!(v["retransmit_times_ns"][0], T0 + 1);
    assert!(v["gpu"].is_null());
    assert!(v.get("request").is_none());
}

#[test]
fn the_queue_window_ends_at_the_first_launch() {
    let ev = slow_request();
    assert_eq!(ev.request.t_gpu_start_ns(), Some(T0 + ms(100)));
    let mut none = ev.request.clone();
    none.queue_ns = None;
    assert_eq!(none.t_gpu_start_ns(), None);
}
