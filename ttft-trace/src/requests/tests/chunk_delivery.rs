//! When each chunk reached the client: every body send's last byte against
//! the ACKs of the server's socket (`requests/chunk_delivery.rs`), the
//! record held for them at most `chunk_ack_wait_ns` after the last send,
//! and the close standing for ACKs `tcp_probe` no longer sees.

use super::*;
use crate::requests::{Outcome, chunk_delivery::MAX_PENDING_CHUNKS};

const SK: u64 = 0x3000;
const US: u64 = 1_000;

/// A connection whose segments carry their own acknowledgment numbers.
fn exact_wire() -> Wire {
    let mut w = Wire::new();
    w.exact_acks = true;
    w.open(SK, ms(999));
    w.seq_from(SK, 5_000);
    w
}

/// A request at `t0` (its segment 100 µs before), headers at +10 ms (ACKed
/// 20 µs after), then a chunk at each of `acked_ms` ACKed 50 µs after it,
/// then one at each of `unacked_ms` and the end (`[DONE]` and the
/// terminator) at +180 ms, neither ACKed yet.
fn stream(w: &mut Wire, t0: u64, acked_ms: &[u64], unacked_ms: &[u64]) {
    w.segment(SK, t0 - 100 * US, 300);
    w.recv(SK, t0, 300);
    w.send(SK, t0 + ms(10), SSE_HEADERS);
    w.segment(SK, t0 + ms(10) + 20 * US, 0);
    for &t in acked_ms {
        w.send(SK, t0 + ms(t), &sse_chunk("tok"));
        w.segment(SK, t0 + ms(t) + 50 * US, 0);
    }
    for &t in unacked_ms {
        w.send(SK, t0 + ms(t), &sse_chunk("tok"));
    }
    w.send(SK, t0 + ms(180), &sse_done());
}

#[test]
fn each_chunks_ack_dates_its_delivery() {
    let mut w = exact_wire();
    let t0 = ms(1000);
    stream(&mut w, t0, &[100, 120], &[140, 160]);
    // The wire stood still: the last three chunks are ACKed at once, late.
    w.segment(SK, t0 + ms(600), 0);
    let r = w.one(t0 + ms(700));
    assert_eq!((r.outcome, r.chunks), (Outcome::Ok, 5));
    assert_eq!(r.t_first_chunk_acked_ns, Some(t0 + ms(100) + 50 * US));
    assert_eq!(r.t_first_chunk_acked_ns, r.t_first_token_acked_ns);
    assert_eq!(r.chunk_ack_gaps_ns, [ms(20), ms(480) - 50 * US, 0, 0]);
    assert_eq!(r.chunk_ack_gap_by_close, None);
    assert!(!r.notes.contains(&"chunk_acks_incomplete"), "{:?}", r.notes);
}

#[test]
fn the_record_waits_for_its_chunks_acks_at_most_a_second() {
    let mut w = exact_wire();
    let t0 = ms(1000);
    stream(&mut w, t0, &[100, 120], &[140]);
    let last_send = t0 + ms(180);
    assert!(w.drain(last_send + ms(900)).is_empty(), "still waiting");
    let r = w.one(last_send + ms(1000) + ms(10));
    assert_eq!(r.chunk_ack_gaps_ns, [ms(20)]);
    assert!(r.notes.contains(&"chunk_acks_incomplete"), "{:?}", r.notes);
    // All ACKed: reported at once (after the join's grace).
    let mut w = exact_wire();
    stream(&mut w, t0, &[100, 120, 140], &[]);
    w.segment(SK, last_send + 50 * US, 0);
    let r = w.one(last_send + ms(20));
    assert_eq!(r.chunk_ack_gaps_ns, [ms(20), ms(20), ms(40)]);
}

#[test]
fn chunks_acknowledged_after_the_servers_close_are_dated_by_it() {
    let mut w = exact_wire();
    let t0 = ms(1000);
    stream(&mut w, t0, &[100, 120], &[140, 160]);
    w.state(CONN_CLOSE, SK, t0 + ms(181), TCP_ESTABLISHED, TCP_FIN_WAIT1);
    assert!(w.drain(t0 + ms(700)).is_empty(), "waiting for the ACKs");
    // Everything (the FIN included) acknowledged: no later than then.
    w.state(CONN_STATE, SK, t0 + ms(800), TCP_FIN_WAIT1, TCP_FIN_WAIT2);
    let r = w.one(t0 + ms(820));
    assert_eq!(r.chunk_ack_gaps_ns, [ms(20), ms(680) - 50 * US, 0, 0]);
    assert_eq!(r.chunk_ack_gap_by_close, Some(1));
    assert!(r.notes.contains(&"chunks_acked_by_close"), "{:?}", r.notes);
}

#[test]
fn without_exact_acks_chunks_before_the_last_segment_are_given_up_at_the_close() {
    let mut w = Wire::new();
    w.open(SK, ms(999));
    w.seq_from(SK, 5_000);
    let t0 = ms(1000);
    stream(&mut w, t0, &[100, 120], &[140]);
    // The segment at +120.05 ms may have acknowledged the chunk of +120 ms,
    // unseen (its ACK shows only at the next segment): that chunk's
    // delivery is unknown, and the dates stop before it.
    w.state(CONN_CLOSE, SK, t0 + ms(181), TCP_ESTABLISHED, TCP_FIN_WAIT1);
    w.state(CONN_STATE, SK, t0 + ms(800), TCP_FIN_WAIT1, TCP_FIN_WAIT2);
    let r = w.one(t0 + ms(820));
    assert_eq!(r.t_first_chunk_acked_ns, Some(t0 + ms(100) + 50 * US));
    assert!(r.chunk_ack_gaps_ns.is_empty());
    assert!(r.notes.contains(&"chunk_acks_incomplete"), "{:?}", r.notes);
}

#[test]
fn chunks_waiting_on_a_connection_are_capped_and_counted() {
    let mut w = exact_wire();
    let t0 = ms(1000);
    w.segment(SK, t0 - 100 * US, 300);
    w.recv(SK, t0, 300);
    w.send(SK, t0 + ms(10), SSE_HEADERS);
    for i in 0..=MAX_PENDING_CHUNKS as u64 {
        w.send(SK, t0 + ms(20) + i * US, &sse_chunk("t"));
    }
    w.drain(t0 + ms(100));
    assert_eq!(w.c.stats().chunk_acks_evicted, 1);
}
