//! When the client acknowledged the first token: the server socket's
//! sequence numbers (`tcp_probe`) against the response bytes sent.

use super::*;
use crate::requests::{Outcome, delivery::seq_at_or_after};

const SK: u64 = 0x2000;
const US: u64 = 1_000;

/// A streamed request whose first segment arrives at `t0 - 100 µs`: headers
/// at +10 ms, the first token at +100 ms (acknowledged `ack_after` later),
/// more at +120 ms, the end at +150 ms; every other send acknowledged 20 µs
/// after it.
fn streamed(w: &mut Wire, t0: u64, ack_after: u64) {
    w.segment(SK, t0 - 100 * US, 300);
    w.recv(SK, t0, 300);
    w.send(SK, t0 + ms(10), SSE_HEADERS);
    w.segment(SK, t0 + ms(10) + 20 * US, 0);
    w.send(SK, t0 + ms(100), &sse_chunk("Hel"));
    w.segment(SK, t0 + ms(100) + ack_after, 0);
    w.send(
        SK,
        t0 + ms(120).max(ms(100) + ack_after + US),
        &sse_chunk("lo"),
    );
    w.segment(SK, t0 + ms(120).max(ms(100) + ack_after + US) + 20 * US, 0);
    w.send(
        SK,
        t0 + ms(150).max(ms(100) + ack_after + 2 * US),
        &sse_done(),
    );
    w.segment(
        SK,
        t0 + ms(150).max(ms(100) + ack_after + 2 * US) + 20 * US,
        0,
    );
}

/// A request whose segment arrives 100 µs before its receive at `t0`,
/// answered whole at `t_send`.
fn answered(w: &mut Wire, t0: u64, t_send: u64) {
    w.segment(SK, t0 - 100 * US, 300);
    w.recv(SK, t0, 300);
    w.send(SK, t_send, &json_response("200 OK", "{}"));
}

fn wire(isn: u32) -> Wire {
    let mut w = Wire::new();
    w.open(SK, ms(999));
    w.seq_from(SK, isn);
    w
}

/// The first request's data came with the ACK that completed the
/// handshake, which the probe does not see: the handshake dates the request
/// and gives where its response starts; the first token's ACK is found.
#[test]
fn a_request_with_the_handshake_is_dated_by_it() {
    let mut w = Wire::new();
    let t0 = ms(1000);
    w.open_at_handshake(SK, t0 - 200 * US, 7_000);
    w.recv(SK, t0, 300);
    w.send(SK, t0 + ms(10), SSE_HEADERS);
    w.segment(SK, t0 + ms(10) + 20 * US, 0);
    w.send(SK, t0 + ms(100), &sse_chunk("Hel"));
    w.segment(SK, t0 + ms(100) + 30 * US, 0);
    w.send(SK, t0 + ms(150), &sse_done());
    w.segment(SK, t0 + ms(150) + 20 * US, 0);
    let r = w.one(ms(3000));
    assert_eq!(r.t_request_segment_ns, Some(t0 - 200 * US));
    assert!(r.notes.contains(&"request_segment_at_handshake"));
    assert_eq!(r.t_first_token_acked_ns, Some(t0 + ms(100) + 30 * US));
    assert_eq!(r.client_ttft_estimate_ns, Some(ms(100) + 230 * US));
}

/// A data segment seen is the request's, not the handshake; and only the
/// connection's first request may start at the handshake.
#[test]
fn a_seen_segment_wins_over_the_handshake() {
    let mut w = Wire::new();
    let t0 = ms(1000);
    w.open_at_handshake(SK, t0 - ms(5), 7_000);
    answered(&mut w, t0, t0 + ms(20));
    w.segment(SK, t0 + ms(20) + 20 * US, 0);
    // The next request's segment is not seen (an event lost).
    w.recv(SK, t0 + ms(50), 300);
    w.send(SK, t0 + ms(60), &json_response("200 OK", "{}"));
    w.segment(SK, t0 + ms(60) + 20 * US, 0);
    let rs = w.drain(ms(3000));
    assert_eq!(rs.len(), 2);
    assert_eq!(rs[0].t_request_segment_ns, Some(t0 - 100 * US));
    assert!(
        rs.iter()
            .all(|r| !r.notes.contains(&"request_segment_at_handshake"))
    );
    assert_eq!(rs[1].t_request_segment_ns, None);
}

#[test]
fn sequence_numbers_compare_modulo_2_32() {
    assert!(seq_at_or_after(10, 10));
    assert!(seq_at_or_after(11, 10));
    assert!(!seq_at_or_after(9, 10));
    assert!(seq_at_or_after(5, u32::MAX - 5), "past the wrap");
    assert!(!seq_at_or_after(u32::MAX - 5, 5));
}

#[test]
fn the_ack_time_is_the_previous_segments() {
    // The advance past the first token shows at the segment after the ACK
    // (the probe reads snd_una before processing): the ACK's own time counts.
    let mut w = wire(1_000);
    streamed(&mut w, ms(1000), 20 * US);
    let r = w.one(ms(3000));
    assert_eq!(r.ttft_ns, Some(ms(100)));
    assert_eq!(r.t_request_segment_ns, Some(ms(1000) - 100 * US));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1100) + 20 * US));
    assert_eq!(r.client_ttft_estimate_ns, Some(ms(100) + 120 * US));
    assert_eq!(r.srtt_ns, Some(50 * US));
}

#[test]
fn a_late_ack_makes_the_estimate_late() {
    let mut w = wire(1_000);
    streamed(&mut w, ms(1000), ms(400));
    let r = w.one(ms(3000));
    assert_eq!(r.ttft_ns, Some(ms(100)));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1500)));
    assert_eq!(r.client_ttft_estimate_ns, Some(ms(500) + 100 * US));
}

#[test]
fn sequence_numbers_wrap() {
    // The first token's last byte lies past 2^32.
    let mut w = wire(u32::MAX - 40);
    streamed(&mut w, ms(1000), ms(7));
    let r = w.one(ms(3000));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1107)));
}

#[test]
fn a_keep_alive_request_counts_from_its_own_segment() {
    let mut w = wire(77);
    streamed(&mut w, ms(1000), 20 * US);
    streamed(&mut w, ms(2000), ms(300));
    let v = w.drain(ms(5000));
    assert_eq!(v.len(), 2);
    assert_eq!(v[1].request_index, 1);
    assert_eq!(v[1].t_request_segment_ns, Some(ms(2000) - 100 * US));
    assert_eq!(v[1].t_first_token_acked_ns, Some(ms(2400)));
    assert_eq!(v[0].t_first_token_acked_ns, Some(ms(1100) + 20 * US));
}

#[test]
fn a_request_without_its_own_segment_has_no_estimate() {
    let mut w = wire(5);
    // A request body in two segments and two receives: the second segment is
    // more of the same request, not the next one's start.
    w.segment(SK, ms(1000) - 100 * US, 1000);
    w.recv(SK, ms(1000), 1000);
    w.segment(SK, ms(1001), 500);
    w.recv(SK, ms(1001) + 50 * US, 500);
    w.send(SK, ms(1050), &json_response("200 OK", "{}"));
    w.segment(SK, ms(1050) + 20 * US, 0);
    // The next request's segment was lost (ring buffer full): its ACKs still
    // come, but there is no start to count from.
    w.recv(SK, ms(2000), 300);
    w.send(SK, ms(2050), &json_response("200 OK", "{}"));
    w.segment(SK, ms(2050) + 20 * US, 0);
    w.segment(SK, ms(2060), 0);
    let v = w.drain(ms(5000));
    assert_eq!(v.len(), 2);
    assert_eq!(v[0].t_request_segment_ns, Some(ms(1000) - 100 * US));
    assert_eq!(v[0].bytes_in, 1500);
    assert_eq!(v[1].t_request_segment_ns, None, "never the previous one's");
    assert_eq!(v[1].t_first_token_acked_ns, None);
    assert_eq!(v[1].client_ttft_estimate_ns, None);
}

#[test]
fn a_first_token_acknowledged_before_its_send_returned_counts() {
    // Loopback: the client's ACKs are processed inside the server's send
    // (socket backlog at release), stamped before the send returns.
    let mut w = wire(1_000);
    answered(&mut w, ms(1000), ms(1080));
    w.segment(SK, ms(1080) - 30 * US, 0);
    w.segment(SK, ms(1080) - 10 * US, 0);
    let r = w.one(ms(3000));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1080) - 30 * US));
    assert_eq!(r.client_ttft_estimate_ns, Some(ms(80) + 70 * US));
}

#[test]
fn the_record_waits_for_the_ack_then_gives_up() {
    let mut w = wire(1_000);
    answered(&mut w, ms(1000), ms(1080));
    // Ended, joined, but not acknowledged yet: held.
    assert!(w.drain(ms(2000)).is_empty());
    // The ACK (seen at the next segment) releases it.
    w.segment(SK, ms(2100), 0);
    w.segment(SK, ms(2200), 0);
    let r = w.one(ms(2300));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(2100)));
    assert_eq!(r.t_first_token_unacked_ns, None);

    // Never acknowledged: reported after the wait, without a delivery.
    answered(&mut w, ms(3000) + 100 * US, ms(3080));
    let wait = CorrelatorConfig::default().ack_wait_ns;
    assert!(w.drain(ms(3080) + wait - 1).is_empty());
    let r = w.one(ms(3080) + wait);
    assert_eq!(r.request_index, 1);
    assert_eq!(r.t_first_token_acked_ns, None);
    // Said so: unacknowledged the whole wait after the first token.
    assert_eq!(r.t_first_token_unacked_ns, Some(ms(3080) + wait));
    // Its ACK after all, too late: nothing more, nothing kept.
    w.segment(SK, ms(3080) + wait + ms(1), 0);
    w.segment(SK, ms(3080) + wait + ms(2), 0);
    assert!(w.drain(ms(3080) + wait + ms(100)).is_empty());
}

#[test]
fn a_close_ends_the_wait() {
    let mut w = wire(1_000);
    answered(&mut w, ms(1000), ms(1080));
    w.close(SK, ms(1090));
    let r = w.one(ms(2000));
    assert_eq!(r.t_first_token_acked_ns, None);
    assert_eq!(r.t_first_token_unacked_ns, None, "not awaited to the end");
    assert_eq!(r.client_ttft_estimate_ns, None);
}

#[test]
fn a_reused_socket_address_keeps_each_connections_ack() {
    // The kernel hands a freed socket's address to the next connection
    // while the first one's record still waits out the join grace: both
    // requests are index 0 on the same `sk`, each with its own ACK.
    let mut w = wire(1_000);
    streamed(&mut w, ms(1000), 20 * US);
    w.close(SK, ms(1200));
    w.open(SK, ms(1250));
    w.seq_from(SK, 9_000_000);
    streamed(&mut w, ms(1300), ms(3));
    let v = w.drain(ms(5000));
    assert_eq!(v.len(), 2, "{v:#?}");
    assert_eq!((v[0].request_index, v[1].request_index), (0, 0));
    assert_eq!(v[0].t_first_token_acked_ns, Some(ms(1100) + 20 * US));
    assert_eq!(v[1].t_first_token_acked_ns, Some(ms(1403)));
    assert_eq!(v[1].client_ttft_estimate_ns, Some(ms(103) + 100 * US));
}

#[test]
fn without_segment_events_nothing_waits() {
    // A kernel without the probe (or events lost): requests as before.
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 300);
    w.send(SK, ms(1080), &json_response("200 OK", "{}"));
    let r = w.one(ms(1200));
    assert_eq!(
        (r.t_request_segment_ns, r.t_first_token_acked_ns),
        (None, None)
    );
}

/// A short response, then the server's close: the client's ACK of it comes
/// after the close, where `tcp_probe` no longer sees it.
fn answered_then_closed(w: &mut Wire, t_send: u64) {
    answered(w, ms(1000), t_send);
    w.state(CONN_CLOSE, SK, t_send + US, TCP_ESTABLISHED, TCP_FIN_WAIT1);
}

#[test]
fn after_the_servers_close_everything_acknowledged_stands_for_the_ack() {
    let mut w = wire(1_000);
    answered_then_closed(&mut w, ms(1100));
    // The retransmitted response and FIN, acknowledged 400 ms later.
    assert!(w.drain(ms(1400)).is_empty(), "held for its ACK");
    let acked = ms(1500);
    w.state(CONN_STATE, SK, acked, TCP_FIN_WAIT1, TCP_FIN_WAIT2);
    let r = w.one(ms(1600));
    assert_eq!(r.outcome, Outcome::Ok);
    assert_eq!(r.t_first_token_acked_ns, Some(acked));
    assert_eq!(
        r.client_ttft_estimate_ns,
        Some(acked - (ms(1000) - 100 * US))
    );
    assert!(
        r.notes.contains(&"first_token_acked_by_close"),
        "{:?}",
        r.notes
    );
    assert_eq!(
        w.c.stats().connections,
        1,
        "followed until the kernel is done"
    );
    w.state(CONN_STATE, SK, ms(1700), TCP_FIN_WAIT2, TCP_CLOSE);
    assert!(w.drain(ms(1800)).is_empty());
    assert_eq!(w.c.stats().connections, 0);
}

#[test]
fn after_the_clients_close_the_last_ack_stands_for_the_ack() {
    let mut w = wire(1_000);
    answered(&mut w, ms(1000), ms(1100));
    w.state(CONN_CLOSE, SK, ms(1101), TCP_ESTABLISHED, TCP_CLOSE_WAIT);
    w.state(CONN_STATE, SK, ms(1102), TCP_CLOSE_WAIT, TCP_LAST_ACK);
    // A socket event after the close starts no request.
    w.recv(SK, ms(1103), 10);
    w.state(CONN_STATE, SK, ms(1300), TCP_LAST_ACK, TCP_CLOSE);
    let r = w.one(ms(2000));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1300)));
    let s = w.c.stats();
    assert_eq!((s.connections, s.unknown_conn_events), (0, 1));
}

#[test]
fn a_socket_done_without_everything_acknowledged_gives_no_ack() {
    // The server's close, then the socket ends without the FIN acknowledged
    // (a reset, or the orphan's retries ran out).
    let mut w = wire(1_000);
    answered_then_closed(&mut w, ms(1100));
    w.state(CONN_STATE, SK, ms(1200), TCP_FIN_WAIT1, TCP_CLOSE);
    let r = w.one(ms(1300));
    assert_eq!((r.outcome, r.t_first_token_acked_ns), (Outcome::Ok, None));
    assert!(r.notes.iter().all(|n| *n != "first_token_acked_by_close"));
}

#[test]
fn an_ack_seen_before_the_close_is_kept() {
    let mut w = wire(1_000);
    answered(&mut w, ms(1000), ms(1100));
    w.segment(SK, ms(1100) + 30 * US, 0);
    w.segment(SK, ms(1100) + 60 * US, 0);
    w.state(CONN_CLOSE, SK, ms(1101), TCP_ESTABLISHED, TCP_FIN_WAIT1);
    w.state(CONN_STATE, SK, ms(1102), TCP_FIN_WAIT1, TCP_FIN_WAIT2);
    let r = w.one(ms(2000));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1100) + 30 * US));
    assert!(!r.notes.contains(&"first_token_acked_by_close"));
}

#[test]
fn a_closed_connection_is_dropped_once_no_ack_is_awaited() {
    // The socket's last state change never comes (lost, or the kernel keeps
    // an orphan for minutes): nothing is awaited after `ack_wait_ns`.
    let mut w = wire(1_000);
    answered_then_closed(&mut w, ms(1100));
    assert!(w.drain(ms(5000)).is_empty());
    let r = w.one(ms(6200));
    assert_eq!(r.t_first_token_acked_ns, None);
    assert!(w.drain(ms(7300)).is_empty());
    let s = w.c.stats();
    assert_eq!((s.connections, s.connections_evicted), (0, 0));
}

#[test]
fn a_segment_after_the_first_token_may_have_been_its_ack() {
    // The client's ACK came at +30 µs, the connection's last segment before
    // the close: what it acknowledged never shows. The state change 200 ms
    // later would make the delivery far too late: it stays unknown.
    let mut w = wire(1_000);
    answered(&mut w, ms(1000), ms(1100));
    w.segment(SK, ms(1100) + 30 * US, 0);
    w.state(CONN_CLOSE, SK, ms(1101), TCP_ESTABLISHED, TCP_FIN_WAIT1);
    w.state(CONN_STATE, SK, ms(1300), TCP_FIN_WAIT1, TCP_FIN_WAIT2);
    let r = w.one(ms(2000));
    assert_eq!((r.outcome, r.t_first_token_acked_ns), (Outcome::Ok, None));
}

fn exact_wire(isn: u32) -> Wire {
    let mut w = wire(isn);
    w.exact_acks = true;
    w
}

#[test]
fn an_exact_ack_is_dated_to_its_own_segment() {
    let mut w = exact_wire(1_000);
    streamed(&mut w, ms(1000), 20 * US);
    let r = w.one(ms(3000));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1100) + 20 * US));
    assert_eq!(r.client_ttft_estimate_ns, Some(ms(100) + 120 * US));
}

#[test]
fn an_exact_ack_just_before_the_close_is_known() {
    // The same last segment as above, read exactly: it was the ACK.
    let mut w = exact_wire(1_000);
    answered(&mut w, ms(1000), ms(1100));
    w.segment(SK, ms(1100) + 30 * US, 0);
    w.state(CONN_CLOSE, SK, ms(1101), TCP_ESTABLISHED, TCP_FIN_WAIT1);
    w.state(CONN_STATE, SK, ms(1300), TCP_FIN_WAIT1, TCP_FIN_WAIT2);
    let r = w.one(ms(2000));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1100) + 30 * US));
    assert!(!r.notes.contains(&"first_token_acked_by_close"));
}

#[test]
fn with_exact_acks_a_segment_that_acknowledged_nothing_keeps_the_wait() {
    // A duplicate ACK (the client saw a later segment, the first token was
    // lost) before the close: the first token's ACK came after the close,
    // and everything acknowledged stands for it.
    let mut w = exact_wire(1_000);
    answered(&mut w, ms(1000), ms(1100));
    w.dup_ack(SK, ms(1100) + 30 * US);
    w.state(CONN_CLOSE, SK, ms(1101), TCP_ESTABLISHED, TCP_FIN_WAIT1);
    assert!(w.drain(ms(1200)).is_empty(), "held for its ACK");
    w.state(CONN_STATE, SK, ms(1300), TCP_FIN_WAIT1, TCP_FIN_WAIT2);
    let r = w.one(ms(2000));
    assert_eq!(r.t_first_token_acked_ns, Some(ms(1300)));
    assert!(r.notes.contains(&"first_token_acked_by_close"));
}
