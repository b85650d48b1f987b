//! Interrupted retries: a request cut, reset or closed before its response,
//! followed from the same client address to the same port, is linked to
//! its retry with the TTFT the user saw.

use super::{SSE_HEADERS, Wire, ms, sse_chunk, sse_done};
use crate::requests::{AttemptId, Outcome, RequestRecord};

const T0: u64 = ms(1000);

/// A streamed request on connection `sk` arriving at `t` with `bytes`:
/// its headers at +10 ms, its first token at +`ttft_ms`; `cut`: the client
/// closes 20 ms after that token, else the stream ends.
fn request(w: &mut Wire, sk: u64, t: u64, bytes: i64, ttft_ms: u64, cut: bool) {
    w.open(sk, t.saturating_sub(ms(1)));
    w.recv(sk, t, bytes);
    w.send(sk, t + ms(10), SSE_HEADERS);
    w.send(sk, t + ms(ttft_ms), &sse_chunk("a"));
    if cut {
        w.close(sk, t + ms(ttft_ms + 20));
    } else {
        w.send(sk, t + ms(ttft_ms + 10), &sse_done());
    }
}

fn of(rs: &[RequestRecord], sk: u64) -> &RequestRecord {
    rs.iter()
        .find(|r| r.sk == sk)
        .expect("a record of the connection")
}

#[test]
fn a_cut_request_retried_is_linked_with_the_users_ttft() {
    let mut w = Wire::new();
    request(&mut w, 1, T0, 300, 200, true);
    // Another request of the gateway (another size) first, then the retry:
    // the same request on a new connection, 100 ms after the cut.
    request(&mut w, 3, T0 + ms(240), 280, 30, false);
    request(&mut w, 2, T0 + ms(320), 300, 30, false);
    // One of the same size long after the window.
    request(&mut w, 4, T0 + ms(20_000), 300, 30, false);
    let rs = w.drain(ms(60_000));
    assert_eq!(of(&rs, 1).outcome, Outcome::ClosedMidResponse);
    let retry = of(&rs, 2);
    assert_eq!(
        retry.retry_of,
        Some(AttemptId {
            conn: 1,
            request_index: 0,
            client_port: 40_001,
        })
    );
    assert_eq!(retry.ttft_ns, Some(ms(30)));
    assert_eq!(
        retry.user_ttft_ns,
        Some(ms(350)),
        "from the first attempt's arrival"
    );
    for sk in [1, 3, 4] {
        assert_eq!(of(&rs, sk).retry_of, None, "{sk}");
        assert_eq!(of(&rs, sk).user_ttft_ns, None, "{sk}");
    }
    let registry = prometheus::Registry::new();
    let m = crate::export::prometheus::RequestMetrics::new(&registry, &[]).expect("register");
    for r in &rs {
        m.observe(r, &[]);
    }
    let text = crate::export::prometheus::render(&registry);
    assert!(
        text.contains("ttft_trace_retried_requests_total 1"),
        "{text}"
    );
    let json = serde_json::to_string(retry).expect("json");
    assert!(
        json.contains(r#""retry_of":{"conn":"0x1","request_index":0,"client_port":40001},"user_ttft_ns":350000000"#),
        "{json}"
    );
}

#[test]
fn a_chain_of_retries_counts_from_the_first_attempt() {
    let mut w = Wire::new();
    request(&mut w, 1, T0, 300, 200, true);
    request(&mut w, 2, T0 + ms(300), 300, 200, true);
    request(&mut w, 3, T0 + ms(600), 300, 30, false);
    let rs = w.drain(ms(60_000));
    assert_eq!(of(&rs, 2).retry_of.map(|r| r.conn), Some(1));
    assert_eq!(of(&rs, 3).retry_of.map(|r| r.conn), Some(2));
    assert_eq!(of(&rs, 3).user_ttft_ns, Some(ms(630)));
}

#[test]
fn concurrent_requests_and_whole_ones_are_no_retries() {
    let mut w = Wire::new();
    // Arrived before the cut request ended: not its retry.
    request(&mut w, 1, T0, 300, 200, true);
    request(&mut w, 2, T0 + ms(100), 300, 30, false);
    let rs = w.drain(ms(60_000));
    assert!(rs.iter().all(|r| r.retry_of.is_none()), "{rs:#?}");
    // After a whole response, the next request is no retry.
    let mut w = Wire::new();
    request(&mut w, 3, T0, 300, 30, false);
    request(&mut w, 4, T0 + ms(100), 300, 30, false);
    let rs = w.drain(ms(60_000));
    assert!(rs.iter().all(|r| r.retry_of.is_none()), "{rs:#?}");
}

#[test]
fn interruptions_are_bounded_and_the_forgotten_counted() {
    let mut w = Wire::new();
    let n = crate::requests::retries::MAX_INTERRUPTIONS as u64 + 3;
    // Each cut request is 1 µs apart: all within one window.
    for i in 0..n {
        w.open(100 + i, T0 + i * 1000);
        w.recv(100 + i, T0 + i * 1000, 10 + i as i64);
        w.close(100 + i, T0 + i * 1000 + 500);
    }
    let _ = w.drain(ms(60_000));
    assert_eq!(w.c.stats().retry_candidates_dropped, 3);
}

#[test]
fn a_reset_stream_retried_on_the_same_connection_is_linked() {
    use super::http2::{frame, walked};
    use ttft_trace_common::h2::{H2_RECV, H2_SEND};
    let sk = 0x7000;
    let mut w = Wire::new();
    w.open(sk, 0);
    // Stream 1: a request; its response's headers and first message; the
    // client resets it (CANCEL).
    let req = |id: u32, hpack: &[u8]| {
        let mut r = frame(1, 4, id, hpack);
        r.extend(frame(0, 1, id, &[0, 0, 0, 0, 1, 7]));
        r
    };
    let first = req(1, &[0x83, 0x86, 0x44, 0x05, b'/', b'g', b'e', b'n', b'x']);
    w.c.on_h2(walked(H2_RECV, T0, &first));
    w.recv(sk, T0 + ms(1), first.len() as i64);
    let mut out = frame(1, 4, 1, &[0x88]);
    out.extend(frame(0, 0, 1, &[0, 0, 0, 0, 2, 1, 2]));
    w.send(sk, T0 + ms(200), &out);
    w.c.on_h2(walked(H2_SEND, T0 + ms(200), &out));
    let rst = frame(3, 0, 1, &8u32.to_be_bytes());
    w.c.on_h2(walked(H2_RECV, T0 + ms(250), &rst));
    w.recv(sk, T0 + ms(251), rst.len() as i64);
    // Stream 3: the retry, its header block shorter (HPACK indexed what
    // stream 1 sent), its first message 40 ms after.
    let again = req(3, &[0x83, 0x86, 0xbe]);
    w.c.on_h2(walked(H2_RECV, T0 + ms(300), &again));
    w.recv(sk, T0 + ms(301), again.len() as i64);
    let mut out = frame(1, 4, 3, &[0x88]);
    out.extend(frame(0, 0, 3, &[0, 0, 0, 0, 2, 1, 2]));
    out.extend(frame(1, 5, 3, &[0x40]));
    w.send(sk, T0 + ms(340), &out);
    w.c.on_h2(walked(H2_SEND, T0 + ms(340), &out));
    w.close(sk, T0 + ms(400));
    let rs = w.drain(ms(10_000));
    let stream = |id| {
        rs.iter()
            .find(|r| r.http2_stream_id == Some(id))
            .expect("stream")
    };
    assert_eq!(stream(1).outcome, Outcome::Reset);
    assert_eq!(stream(3).retry_of.map(|r| r.request_index), Some(1));
    // From stream 1's arrival (its receive, T0 + 1 ms).
    assert_eq!(stream(3).user_ttft_ns, Some(ms(339)), "{rs:#?}");
}

/// A client that times out on a request with no response: its retry is
/// timed from the client's close, however long it waited, and a request of
/// the same size that came while it waited is no retry of it.
#[test]
fn a_timed_out_request_is_timed_from_the_close() {
    let mut w = Wire::new();
    w.open(1, T0);
    w.recv(1, T0, 300);
    request(&mut w, 2, T0 + ms(1_000), 300, 30, false);
    // The client gives up after 20 s (longer than the 10 s window).
    w.close(1, T0 + ms(20_000));
    request(&mut w, 3, T0 + ms(20_050), 300, 30, false);
    let rs = w.drain(ms(60_000));
    assert_eq!(of(&rs, 1).outcome, Outcome::ClosedBeforeResponse);
    assert_eq!(of(&rs, 2).retry_of, None, "arrived while it waited");
    assert_eq!(of(&rs, 3).retry_of.map(|r| r.conn), Some(1));
    assert_eq!(of(&rs, 3).user_ttft_ns, Some(ms(20_080)));
}

/// A client that closes its side mid-response: the server may still end
/// the response, so the request is finished only at the server's close,
/// after the retry has finished; the retry, still waiting for its record,
/// takes the link.
#[test]
fn a_retry_finished_before_its_interruption_is_linked() {
    let mut w = Wire::new();
    w.open(1, T0);
    w.recv(1, T0, 300);
    w.send(1, T0 + ms(10), SSE_HEADERS);
    w.send(1, T0 + ms(200), &sse_chunk("a"));
    // The client's FIN (a receive of 0 bytes), its retry at once.
    w.recv(1, T0 + ms(220), 0);
    request(&mut w, 2, T0 + ms(250), 300, 30, false);
    w.close(1, T0 + ms(1_000));
    let rs = w.drain(ms(60_000));
    assert_eq!(of(&rs, 1).outcome, Outcome::ClosedMidResponse);
    assert_eq!(of(&rs, 2).retry_of.map(|r| r.conn), Some(1), "{rs:#?}");
    assert_eq!(of(&rs, 2).user_ttft_ns, Some(ms(280)));
}
