//! A TLS connection: its sends are records, never read as HTTP or as an
//! opaque response whose first send would be a first token.

use super::{Wire, ms};
use crate::requests::{Framing, Outcome};

const SK: u64 = 0x715;
const T0: u64 = ms(1000);

/// `n` records of `kind` (22 handshake, 23 application data), each of
/// `len` bytes of payload, in one send.
fn records(kind: u8, n: usize, len: u16) -> Vec<u8> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.extend([kind, 3, 3]);
        v.extend(len.to_be_bytes());
        v.extend(std::iter::repeat_n(0x5a, usize::from(len)));
    }
    v
}

#[test]
fn a_tls_connection_is_named_and_never_counted() {
    let mut w = Wire::new();
    w.open(SK, 0);
    // ClientHello; the server's flight; the client's Finished and its
    // encrypted request; the encrypted response in several records.
    w.recv(SK, T0, 517);
    w.send(SK, T0 + ms(1), &records(22, 3, 120));
    w.recv(SK, T0 + ms(5), 80);
    w.recv(SK, T0 + ms(6), 300);
    for i in 0..5 {
        w.send(SK, T0 + ms(30 + i), &records(23, 1, 60));
    }
    // A second request on the connection, its response in one send.
    w.recv(SK, T0 + ms(100), 300);
    w.send(SK, T0 + ms(130), &records(23, 2, 900));
    w.close(SK, T0 + ms(200));
    let rs = w.drain(ms(10_000));
    assert!(rs.len() >= 2, "{rs:#?}");
    for r in &rs {
        assert_eq!(
            (r.framing, r.outcome),
            (Some(Framing::Tls), Outcome::TlsUnsupported),
            "{r:#?}"
        );
        assert_eq!(r.observations().count(), 0, "not a request's figures");
        assert_eq!((r.t_first_token_ns, r.ttft_ns), (None, None), "{r:#?}");
    }
    let json = serde_json::to_string(&rs[0]).expect("json");
    assert!(json.contains("\"framing\":\"tls\""), "{json}");
    assert!(json.contains("\"outcome\":\"tls_unsupported\""), "{json}");
}

/// The handshakes of real OpenSSL flights, through the correlator: timed
/// from the `ClientHello`'s segment to the client's `Finished` (TLS 1.3) or
/// the server's `Finished` (full TLS 1.2), on every request of the
/// connection, the first request after it marked.
#[test]
fn a_connection_seen_opening_has_its_handshake_timed() {
    use crate::requests::tls::{
        TlsVersion,
        tests::{TLS12_FULL, TLS12_FULL_SECOND, TLS13_FULL, TLS13_FULL_SECOND},
    };
    let us = |v: u64| v * 1000;
    // (flights, handshake end, version)
    let cases: [(&[&[u8]], u64, TlsVersion); 2] = [
        (&[TLS13_FULL, TLS13_FULL_SECOND], ms(7), TlsVersion::Tls13),
        (&[TLS12_FULL, TLS12_FULL_SECOND], ms(9), TlsVersion::Tls12),
    ];
    for (flights, end, version) in cases {
        let mut w = Wire::new();
        w.open_at_handshake(SK, T0 - ms(1), 1000);
        w.segment(SK, T0, 517);
        w.recv(SK, T0 + us(60), 517);
        w.send(SK, T0 + ms(2), flights[0]);
        // The client's second flight; the server's second.
        w.segment(SK, T0 + ms(7), 80);
        w.recv(SK, T0 + ms(7) + us(40), 80);
        w.send(SK, T0 + ms(9), flights[1]);
        // A request, its response.
        w.segment(SK, T0 + ms(20), 300);
        w.recv(SK, T0 + ms(20) + us(40), 300);
        w.send(SK, T0 + ms(40), &records(23, 1, 400));
        w.close(SK, T0 + ms(50));
        let rs = w.drain(ms(10_000));
        assert!(rs.len() >= 2, "{rs:#?}");
        for r in &rs {
            let tls = r.tls.expect("handshake facts");
            assert_eq!((tls.version, tls.resumed), (version, Some(false)), "{r:#?}");
            // Known from the first record finished after it ended on.
            let known = r.t_done_ns.is_some_and(|t| t >= T0 + end) || tls.counted;
            assert_eq!(tls.handshake_ns, known.then_some(end), "{r:#?}");
        }
        let counted = rs
            .iter()
            .filter(|r| r.tls.is_some_and(|t| t.counted))
            .count();
        assert_eq!(counted, 1, "{rs:#?}");
        let json = serde_json::to_string(&rs[0]).expect("json");
        assert!(
            json.contains(&format!(r#""tls":{{"version":"{}""#, version.as_str())),
            "{json}"
        );
        // One handshake in the histogram, whatever the records.
        let registry = prometheus::Registry::new();
        let m =
            crate::export::prometheus::RequestMetrics::new(&registry, &["comm"]).expect("register");
        for r in &rs {
            m.observe(r, &["srv"]);
        }
        let text = crate::export::prometheus::render(&registry);
        let v = version.as_str();
        for needle in [
            format!(
                r#"ttft_trace_tls_handshake_seconds_count{{comm="srv",resumed="false",version="{v}"}} 1"#
            ),
            format!(
                r#"ttft_trace_tls_handshake_seconds_bucket{{comm="srv",resumed="false",version="{v}",le="0.005"}} 0"#
            ),
            format!(
                r#"ttft_trace_tls_handshake_seconds_bucket{{comm="srv",resumed="false",version="{v}",le="0.01"}} 1"#
            ),
        ] {
            assert!(text.contains(&needle), "missing {needle} in\n{text}");
        }
        m.retire_workload(&["srv"]);
        assert!(!crate::export::prometheus::render(&registry).contains("srv"));
    }
    // The server's flight lost: the client's ClientHello retransmitted
    // (a segment never received: TCP drops the copy), then its Finished
    // after the flight's retransmission. Timed to the Finished.
    let mut w = Wire::new();
    w.open_at_handshake(SK, T0 - ms(1), 1000);
    w.segment(SK, T0, 517);
    w.recv(SK, T0 + us(60), 517);
    w.send(SK, T0 + ms(2), TLS13_FULL);
    w.segment(SK, T0 + ms(200), 517);
    w.segment(SK, T0 + ms(410), 80);
    w.recv(SK, T0 + ms(410) + us(40), 80);
    w.close(SK, T0 + ms(500));
    let rs = w.drain(ms(10_000));
    let tls = rs.iter().find_map(|r| r.tls).expect("facts");
    assert_eq!(tls.handshake_ns, Some(ms(410)), "{rs:#?}");
    // Adopted mid-life: nothing to time.
    let mut w = Wire::new();
    let mut ev = super::conn(ttft_trace_common::CONN_OPEN, SK, T0);
    ev.oldstate = crate::requests::connection::TCP_ESTABLISHED;
    w.c.on_conn(&ev);
    w.recv(SK, T0 + ms(1), 300);
    w.send(SK, T0 + ms(2), &records(23, 1, 400));
    w.close(SK, T0 + ms(50));
    assert!(w.drain(ms(10_000)).iter().all(|r| r.tls.is_none()));
}

/// A streamed response in plaintext, as sends inside `SSL_write` show it:
/// headers, then `n` SSE chunks, then the chunked terminator.
const HEADERS: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
const SSE_CHUNK: &[u8] = b"10\r\ndata: {\"t\": 1}\n\n\r\n";

fn plaintext_response(w: &mut Wire, t: u64, n: u64) {
    w.send(SK, t, HEADERS);
    for i in 0..n {
        w.send(SK, t + ms(10 * (i + 1)), SSE_CHUNK);
    }
    w.send(SK, t + ms(10 * (n + 1)), b"0\r\n\r\n");
}

/// The server's TLS calls seen (OpenSSL through a socket BIO): the records
/// of the handshake, the tickets and the close are TLS's own, and the
/// request in between is read as HTTP from its plaintext, timed by its
/// segment's arrival and the first send of its first token. The handshake
/// is `SSL_do_handshake`'s (nginx, CPython), or, as the kernel reports the
/// same, driven by `SSL_read` (gunicorn): what the read received before
/// each of its sends is reported as TLS's own.
#[test]
fn a_connection_whose_tls_calls_are_seen_is_read_as_http() {
    use crate::requests::tls::{
        TlsVersion,
        tests::{TLS13_FULL, TLS13_FULL_SECOND},
    };
    use ttft_trace_common::{SOCK_TLS_CONTROL, SOCK_TLS_PLAIN};
    let us = |v: u64| v * 1000;
    {
        let mut w = hello_answered(TLS13_FULL);
        w.segment(SK, T0 + ms(7), 80);
        w.recv(SK, T0 + ms(7) + us(40), 80);
        // Tickets after the handshake.
        w.tls_flags = SOCK_TLS_CONTROL;
        w.send(SK, T0 + ms(8), TLS13_FULL_SECOND);
        // The request, its streamed response.
        w.tls_flags = SOCK_TLS_PLAIN;
        w.segment(SK, T0 + ms(20), 300);
        w.recv(SK, T0 + ms(20) + us(40), 300);
        // The client acknowledges the first token 1 ms after its send
        // (and the headers before it).
        w.send(SK, T0 + ms(45), HEADERS);
        w.segment(SK, T0 + ms(46), 0);
        w.send(SK, T0 + ms(55), SSE_CHUNK);
        w.segment(SK, T0 + ms(56), 0);
        w.send(SK, T0 + ms(65), b"0\r\n\r\n");
        // close_notify, sent outside any data call.
        w.tls_flags = 0;
        w.send(SK, T0 + ms(100), &records(21, 1, 2));
        w.close(SK, T0 + ms(110));
        let rs = w.drain(ms(10_000));
        assert_eq!(rs.len(), 1, "one request, no handshake record: {rs:#?}");
        let r = &rs[0];
        assert_eq!(r.outcome, Outcome::Ok, "{r:#?}");
        assert_eq!(r.framing, Some(Framing::Http1), "{r:#?}");
        // Arrival: the request's receive, 20.04 ms; first token: the
        // first chunk's send, 55 ms.
        assert_eq!(r.ttft_ns, Some(ms(35) - us(40)), "{r:#?}");
        // Its ACK, counted past the handshake's records in sequence space
        // (the server's flight and tickets were acknowledged long before).
        assert_eq!(r.t_first_token_acked_ns, Some(T0 + ms(56)), "{r:#?}");
        let tls = r.tls.expect("handshake facts");
        assert_eq!(tls.version, TlsVersion::Tls13, "{r:#?}");
        assert_eq!(tls.handshake_ns, Some(ms(7)), "{r:#?}");
        assert!(tls.counted, "{r:#?}");
    }
}

/// A process whose TLS is not read (its calls unseen: a memory BIO, or
/// another library): nothing changes, every record is `tls_unsupported`.
/// And a plaintext connection of a process whose TLS is read (its threads
/// make no TLS call on it) is plain HTTP.
#[test]
fn unflagged_connections_keep_their_reading() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, T0, 517);
    w.send(SK, T0 + ms(1), &records(22, 3, 120));
    w.recv(SK, T0 + ms(6), 300);
    w.send(SK, T0 + ms(30), &records(23, 1, 60));
    w.close(SK, T0 + ms(200));
    let rs = w.drain(ms(10_000));
    assert!(!rs.is_empty());
    assert!(
        rs.iter().all(|r| r.outcome == Outcome::TlsUnsupported),
        "{rs:#?}"
    );
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, T0, 300);
    plaintext_response(&mut w, T0 + ms(5), 2);
    w.close(SK, T0 + ms(200));
    let rs = w.drain(ms(10_000));
    assert_eq!(rs.len(), 1, "{rs:#?}");
    assert_eq!((rs[0].outcome, rs[0].tls), (Outcome::Ok, None), "{rs:#?}");
}

/// A connection seen opening whose server's TLS calls are seen: the
/// `ClientHello` arrives at `T0` and is received inside the handshake, the
/// server answers with `flight` at 2 ms (exact ACKs).
fn hello_answered(flight: &[u8]) -> Wire {
    use ttft_trace_common::SOCK_TLS_CONTROL;
    let mut w = Wire::new();
    w.exact_acks = true;
    w.open_at_handshake(SK, T0 - ms(1), 1000);
    w.tls_flags = SOCK_TLS_CONTROL;
    w.segment(SK, T0, 517);
    w.recv(SK, T0 + ms(1), 517);
    w.send(SK, T0 + ms(2), flight);
    w
}

/// A memory BIO's connection (asyncio): the `ClientHello` received
/// outside any call at 1 ms, the server's first flight matched to its
/// handshake call's records (flagged TLS's own) at 2 ms.
fn memory_bio_hello_answered() -> Wire {
    use crate::requests::tls::tests::TLS13_FULL;
    use ttft_trace_common::SOCK_TLS_CONTROL;
    let mut w = Wire::new();
    w.exact_acks = true;
    w.open_at_handshake(SK, T0 - ms(1), 1000);
    w.segment(SK, T0, 517);
    w.recv(SK, T0 + ms(1), 517);
    w.tls_flags = SOCK_TLS_CONTROL;
    w.send(SK, T0 + ms(2), TLS13_FULL);
    w.tls_flags = 0;
    w
}

/// The server's plaintext response from 30 ms (the headers acknowledged at
/// 31 ms, its first chunk sent at 40 ms and acknowledged at 41 ms), the
/// connection closed: its one request.
fn sse_answered(w: &mut Wire) -> Vec<crate::requests::RequestRecord> {
    use ttft_trace_common::SOCK_TLS_PLAIN;
    w.tls_flags = SOCK_TLS_PLAIN;
    w.send(SK, T0 + ms(30), HEADERS);
    w.segment(SK, T0 + ms(31), 0);
    w.send(SK, T0 + ms(40), SSE_CHUNK);
    w.segment(SK, T0 + ms(41), 0);
    w.send(SK, T0 + ms(50), b"0\r\n\r\n");
    w.close(SK, T0 + ms(100));
    let rs = w.drain(ms(10_000));
    assert_eq!(rs.len(), 1, "{rs:#?}");
    rs
}

/// nginx's read-ahead: the client's `Finished` and its request arrive
/// together, and the handshake's receive takes both; the `SSL_read` that
/// returns the request receives nothing (its plaintext comes from
/// OpenSSL's buffer). The request arrived with the handshake's receive.
#[test]
fn a_request_read_ahead_with_the_handshake_arrived_then() {
    use crate::requests::tls::tests::{TLS13_FULL, TLS13_FULL_SECOND};
    use ttft_trace_common::{SOCK_TLS_BUFFERED, SOCK_TLS_PLAIN};
    let mut w = hello_answered(TLS13_FULL);
    w.segment(SK, T0 + ms(7), 380);
    w.recv(SK, T0 + ms(7), 380);
    w.send(SK, T0 + ms(8), TLS13_FULL_SECOND);
    // The event loop comes back to the connection 3 ms later.
    w.tls_flags = SOCK_TLS_PLAIN | SOCK_TLS_BUFFERED;
    w.recv(SK, T0 + ms(10), 250);
    let rs = sse_answered(&mut w);
    assert_eq!(rs[0].outcome, Outcome::Ok, "{rs:#?}");
    assert_eq!(rs[0].t_arrive_ns, T0 + ms(7), "{rs:#?}");
    assert_eq!(rs[0].ttft_ns, Some(ms(33)), "{rs:#?}");
    // The request's segment is the one its records came in (7 ms), its
    // response counted after the tickets sent since.
    assert_eq!(rs[0].t_first_token_acked_ns, Some(T0 + ms(41)), "{rs:#?}");
}

/// A TLS 1.2 resumed handshake driven by `SSL_read` with no send after the
/// client's `Finished`: the read returns the request with the `Finished`
/// in one receive (flagged plain: the call returned plaintext). It is a
/// request, dated by that receive; the handshake ends with it.
#[test]
fn a_request_received_with_the_clients_finished_is_a_request() {
    use crate::requests::tls::tests::TLS12_RESUMED;
    use ttft_trace_common::SOCK_TLS_PLAIN;
    let mut w = hello_answered(TLS12_RESUMED);
    w.tls_flags = SOCK_TLS_PLAIN;
    w.segment(SK, T0 + ms(9), 400);
    w.recv(SK, T0 + ms(9), 400);
    w.send(SK, T0 + ms(30), HEADERS);
    w.send(SK, T0 + ms(40), SSE_CHUNK);
    w.send(SK, T0 + ms(50), b"0\r\n\r\n");
    w.close(SK, T0 + ms(100));
    let rs = w.drain(ms(10_000));
    assert_eq!(rs.len(), 1, "{rs:#?}");
    assert_eq!(rs[0].outcome, Outcome::Ok, "{rs:#?}");
    assert_eq!(rs[0].ttft_ns, Some(ms(31)), "{rs:#?}");
    let tls = rs[0].tls.expect("handshake facts");
    assert_eq!(
        (tls.resumed, tls.handshake_ns),
        (Some(true), Some(ms(9))),
        "{rs:#?}"
    );
}

/// A memory BIO (asyncio): every receive is outside the TLS calls, so the
/// `ClientHello` reads as a request until the server's first flight is
/// matched to the records its handshake call wrote (flagged TLS's own).
/// That request is taken back; the client's `Finished` and its request are
/// received outside any call (TLS's own, on a connection whose calls are
/// seen), and the `SSL_read` that returns the request's plaintext is dated
/// by the last of them; the tickets, sent after it, come before the
/// response in sequence space.
#[test]
fn a_memory_bios_hello_is_no_request() {
    use crate::requests::tls::tests::TLS13_FULL_SECOND;
    use ttft_trace_common::{SOCK_TLS_BUFFERED, SOCK_TLS_CONTROL, SOCK_TLS_PLAIN};
    let us = |v: u64| v * 1000;
    let mut w = memory_bio_hello_answered();
    w.segment(SK, T0 + ms(7), 80);
    w.segment(SK, T0 + ms(7) + us(100), 300);
    w.recv(SK, T0 + ms(7) + us(200), 80);
    w.recv(SK, T0 + ms(7) + us(300), 300);
    w.tls_flags = SOCK_TLS_PLAIN | SOCK_TLS_BUFFERED;
    w.recv(SK, T0 + ms(8), 250);
    w.tls_flags = SOCK_TLS_CONTROL;
    w.send(SK, T0 + ms(9), TLS13_FULL_SECOND);
    let rs = sse_answered(&mut w);
    let r = &rs[0];
    assert_eq!((r.outcome, r.request_index), (Outcome::Ok, 0), "{r:#?}");
    assert_eq!(
        (r.t_arrive_ns, r.bytes_in),
        (T0 + ms(7) + us(300), 250),
        "{r:#?}"
    );
    assert_eq!(r.ttft_ns, Some(ms(33) - us(300)), "{r:#?}");
    assert_eq!(r.t_first_token_acked_ns, Some(T0 + ms(41)), "{r:#?}");
    // The handshake ends with the client's bytes read after the flight
    // (the request's segment came before that read: its time).
    let tls = r.tls.expect("handshake facts");
    assert_eq!(tls.handshake_ns, Some(ms(7) + us(100)), "{r:#?}");
}

/// uvloop's order (seen on 1 connection in 160, 2026-12-07): the client's
/// `Finished` is received alone, its request's segment arrives, the
/// tickets go out, and only then is the request's ciphertext received. The
/// segment's `snd_nxt` predates the tickets: the response starts after
/// them, and the client's ACK of the headers (and tickets) is not the
/// first token's.
#[test]
fn tickets_sent_between_a_requests_segment_and_its_receive_come_first() {
    use crate::requests::tls::tests::TLS13_FULL_SECOND;
    use ttft_trace_common::{SOCK_TLS_BUFFERED, SOCK_TLS_CONTROL, SOCK_TLS_PLAIN};
    let us = |v: u64| v * 1000;
    let mut w = memory_bio_hello_answered();
    w.segment(SK, T0 + ms(7), 80);
    w.recv(SK, T0 + ms(7) + us(100), 80);
    w.segment(SK, T0 + ms(7) + us(200), 300);
    w.tls_flags = SOCK_TLS_CONTROL;
    w.send(SK, T0 + ms(7) + us(800), TLS13_FULL_SECOND);
    w.tls_flags = 0;
    w.recv(SK, T0 + ms(8), 300);
    w.tls_flags = SOCK_TLS_PLAIN | SOCK_TLS_BUFFERED;
    w.recv(SK, T0 + ms(8) + us(100), 250);
    let rs = sse_answered(&mut w);
    let r = &rs[0];
    assert_eq!(r.outcome, Outcome::Ok, "{r:#?}");
    assert_eq!(r.t_request_segment_ns, Some(T0 + ms(7) + us(200)), "{r:#?}");
    assert_eq!(r.t_first_token_acked_ns, Some(T0 + ms(41)), "{r:#?}");
}
