//! Memory stays bounded: idle connections go, caps hold, and what they
//! drop is counted.

use super::*;
use crate::requests::Outcome;

const MIN: u64 = 60_000;

#[test]
fn idle_connections_are_evicted() {
    let mut w = Wire::new();
    w.open(1, ms(1000));
    w.recv(1, ms(1000), 100); // a request never answered
    w.open(2, ms(1000)); // a connection never used
    w.open(3, ms(1000));
    assert!(w.drain(ms(9 * MIN)).is_empty());
    w.recv(3, ms(9 * MIN), 100);
    w.send(3, ms(9 * MIN + 5), &json_response("200 OK", "{}"));
    let r = w.one(ms(9 * MIN + 100));
    assert_eq!(r.outcome, Outcome::Ok);
    let r = w.one(ms(11 * MIN));
    assert_eq!((r.outcome, r.request_index, r.sk), (Outcome::Evicted, 0, 1));
    let s = w.c.stats();
    assert_eq!(
        (s.connections, s.connections_evicted),
        (1, 2),
        "the active one stays"
    );
}

#[test]
fn connection_cap_refuses_new_ones() {
    let mut w = Wire::with(CorrelatorConfig {
        max_connections: 2,
        ..CorrelatorConfig::default()
    });
    for sk in 1..=3 {
        w.open(sk, ms(sk));
    }
    w.recv(3, ms(10), 100);
    assert!(w.drain(ms(100)).is_empty());
    let s = w.c.stats();
    assert_eq!(
        (s.connections, s.connections_refused, s.unknown_conn_events),
        (2, 1, 1)
    );
    w.close(1, ms(200));
    w.open(3, ms(201));
    w.drain(ms(300));
    assert_eq!(w.c.stats().connections, 2, "room again after a close");
}

#[test]
fn episode_history_is_capped() {
    let mut w = Wire::with(CorrelatorConfig {
        episode_cap: 3,
        ..CorrelatorConfig::default()
    });
    for i in 0..10 {
        w.episode(ms(i), ms(i) + 500);
    }
    let s = w.c.stats();
    assert_eq!((s.episodes_held, s.episodes_dropped), (3, 7));
}

#[test]
fn held_events_are_capped() {
    let mut w = Wire::with(CorrelatorConfig {
        max_pending_events: 4,
        ..CorrelatorConfig::default()
    });
    w.open(1, ms(1));
    for i in 0..10 {
        w.recv(1, ms(2 + i), 10);
    }
    let s = w.c.stats();
    assert_eq!((s.pending_events, s.reorder_overflow), (4, 7));
    let r = w.c.flush();
    assert_eq!((r.len(), r[0].bytes_in), (1, 100), "applied, not lost");
}

#[test]
fn finished_requests_waiting_for_their_join_are_capped() {
    let mut w = Wire::with(CorrelatorConfig {
        max_finished: 2,
        ..CorrelatorConfig::default()
    });
    for sk in 1..=3 {
        w.open(sk, 0);
        w.recv(sk, ms(1000), 10);
        w.send(sk, ms(1001), &json_response("200 OK", "{}"));
    }
    assert!(w.drain(ms(1020)).is_empty(), "within the join grace");
    assert_eq!(w.c.stats().requests_dropped, 1);
    assert_eq!(w.drain(ms(2000)).len(), 2);
}

#[test]
fn late_events_beyond_the_window_are_applied_and_counted() {
    let mut w = Wire::new();
    w.open(1, ms(1000));
    w.recv(1, ms(1000), 10);
    w.send(1, ms(1001), SSE_HEADERS);
    w.open(2, ms(1090)); // applied up to 1090 ms
    assert!(w.drain(ms(1100)).is_empty());
    let late = w.send_event(1, ms(1050), &sse_chunk("a"));
    w.c.on_sock(&late);
    w.send(1, ms(1120), &sse_done());
    let r = w.one(ms(1300));
    assert_eq!((r.ttft_ns, r.chunks), (Some(ms(50)), 2));
    assert_eq!(w.c.stats().late_events, 1);
}
