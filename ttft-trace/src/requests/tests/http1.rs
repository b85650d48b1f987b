//! The HTTP/1.1 state machine: where requests start and end, which send is
//! the first token, what every outcome looks like.

use super::*;
use crate::requests::{Figure, Framing, Outcome};

const SK: u64 = 0xffff_8880_0000_1000;

/// A streamed SSE response: headers at +10 ms, chunks at +100, +120, +145,
/// `[DONE]` with the terminator at +150 (request at 1000 ms).
fn streamed(w: &mut Wire, sk: u64, t0: u64) {
    w.recv(sk, t0, 300);
    w.send(sk, t0 + ms(10), SSE_HEADERS);
    w.send(sk, t0 + ms(100), &sse_chunk("Hel"));
    w.send(sk, t0 + ms(120), &sse_chunk("lo"));
    w.send(sk, t0 + ms(145), &sse_chunk("!"));
    w.send(sk, t0 + ms(150), &sse_done());
}

#[test]
fn sse_headers_flushed_alone_then_chunks() {
    let mut w = Wire::new();
    w.open(SK, ms(999));
    streamed(&mut w, SK, ms(1000));
    let r = w.one(ms(2000));
    assert_eq!(r.t_arrive_ns, ms(1000));
    assert_eq!(r.t_first_byte_ns, Some(ms(1010)));
    assert_eq!(
        r.t_first_token_ns,
        Some(ms(1100)),
        "headers are not the first token"
    );
    assert_eq!(r.ttft_ns, Some(ms(100)));
    assert_eq!(r.itl_ns, vec![ms(20), ms(25), ms(5)]);
    assert_eq!(r.chunks, 4);
    assert_eq!(r.t_done_ns, Some(ms(1150)));
    assert_eq!(r.e2e_ns, Some(ms(150)));
    assert_eq!(r.tpot_ns, Some(ms(50) / 3));
    assert_eq!(
        (r.outcome, r.framing, r.http_status),
        (Outcome::Ok, Some(Framing::Http1), Some(200))
    );
    assert_eq!(r.content_type.as_deref(), Some("text/event-stream"));
    assert_eq!(r.bytes_in, 300);
    let chunks: usize = ["Hel", "lo", "!"].iter().map(|t| sse_chunk(t).len()).sum();
    let sent = SSE_HEADERS.len() + chunks + sse_done().len();
    assert_eq!(r.bytes_out, sent as u64);
    assert_eq!((r.pid, r.request_index), (SERVER_PID, 0));
}

#[test]
fn headers_and_first_chunk_in_one_send() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 300);
    let mut first = SSE_HEADERS.to_vec();
    first.extend(sse_chunk("Hi"));
    w.send(SK, ms(1080), &first);
    w.send(SK, ms(1100), &sse_chunk("!"));
    w.send(SK, ms(1101), b"0\r\n\r\n");
    let r = w.one(ms(2000));
    assert_eq!(r.t_first_byte_ns, Some(ms(1080)));
    assert_eq!(r.t_first_token_ns, Some(ms(1080)));
    assert_eq!(
        r.itl_ns,
        vec![ms(20)],
        "the terminator alone is not a chunk"
    );
    assert_eq!((r.chunks, r.t_done_ns), (2, Some(ms(1101))));
}

#[test]
fn content_length_json_in_one_send() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 200);
    w.send(
        SK,
        ms(1200),
        &json_response("200 OK", "{\"choices\":[{\"text\":\"hi\"}]}"),
    );
    let r = w.one(ms(2000));
    assert_eq!(r.ttft_ns, Some(ms(200)));
    assert_eq!(r.e2e_ns, Some(ms(200)));
    assert_eq!((r.chunks, r.tpot_ns, r.itl_ns.len()), (1, None, 0));
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    assert_eq!(r.outcome, Outcome::Ok);
}

#[test]
fn content_length_body_in_later_sends() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 200);
    w.send(
        SK,
        ms(1010),
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n",
    );
    w.send(SK, ms(1050), b"01234");
    assert!(w.drain(ms(1500)).is_empty(), "5 of 10 body bytes: not over");
    w.send(SK, ms(1600), b"56789");
    let r = w.one(ms(2000));
    assert_eq!(
        (r.ttft_ns, r.e2e_ns, r.chunks),
        (Some(ms(50)), Some(ms(600)), 2)
    );
}

#[test]
fn continue_100_is_not_the_response() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 150);
    w.send(SK, ms(1001), b"HTTP/1.1 100 Continue\r\n\r\n");
    w.recv(SK, ms(1005), 5000);
    w.recv(SK, ms(1006), 3000);
    let resp = json_response("200 OK", "{}");
    w.send(SK, ms(1300), &resp);
    let r = w.one(ms(2000));
    assert_eq!(r.t_arrive_ns, ms(1000));
    assert_eq!(r.bytes_in, 8150);
    assert_eq!(r.t_first_byte_ns, Some(ms(1300)));
    assert_eq!(r.ttft_ns, Some(ms(300)));
    assert_eq!(r.bytes_out, 25 + resp.len() as u64);
    assert_eq!((r.http_status, r.outcome), (Some(200), Outcome::Ok));
}

#[test]
fn keep_alive_three_requests_on_one_connection() {
    let mut w = Wire::new();
    w.open(SK, 0);
    let mut t = ms(1000);
    for i in 0..3u64 {
        w.recv(SK, t, 100);
        if i == 1 {
            streamed(&mut w, SK, t + ms(1));
        } else {
            w.send(SK, t + ms(40 + i), &json_response("200 OK", "{}"));
        }
        t += ms(500);
    }
    let rs = w.drain(ms(5000));
    assert_eq!(rs.len(), 3, "{rs:#?}");
    let idx: Vec<_> = rs.iter().map(|r| r.request_index).collect();
    assert_eq!(idx, [0, 1, 2]);
    assert!(rs.iter().all(|r| r.outcome == Outcome::Ok));
    assert_eq!(rs[0].ttft_ns, Some(ms(40)));
    // The streamed one: its own recv at +1 ms is more of the same request.
    assert_eq!((rs[1].ttft_ns, rs[1].bytes_in), (Some(ms(101)), 400));
    assert_eq!(rs[2].ttft_ns, Some(ms(42)));
    assert_eq!(w.c.stats().pipelined, 0);
}

/// hyper (axum) as run in tests/tests/stacks.rs: headers alone, each chunk
/// as one writev of size line, data and CRLF, and the last chunk with
/// `[DONE]` and the end `0\r\n\r\n` as further buffers of one writev, on a
/// kept-alive connection. Past the second send only the last buffer is
/// captured: the decoder is lost from the third send, and the end is read
/// from the last buffer alone (was: never `ok`, and the next request on the
/// connection taken as pipelined).
#[test]
fn hyper_vectored_chunks_and_the_end_in_a_buffer_of_its_own() {
    let mut w = Wire::new();
    w.open(SK, 0);
    let mut t = ms(1000);
    for _ in 0..2 {
        w.recv(SK, t, 300);
        w.send_vectored(SK, t + ms(1), &[SSE_HEADERS]);
        for (i, tok) in ["a", "b", "c"].iter().enumerate() {
            let data = format!("data: {tok}\n\n");
            let size = format!("{:X}\r\n", data.len());
            w.send_vectored(
                SK,
                t + ms(20 + 5 * i as u64),
                &[size.as_bytes(), data.as_bytes(), b"\r\n"],
            );
        }
        let data = b"data: d\n\n";
        let done = b"data: [DONE]\n\n";
        let (s1, s2) = (
            format!("{:X}\r\n", data.len()),
            format!("{:X}\r\n", done.len()),
        );
        w.send_vectored(
            SK,
            t + ms(40),
            &[
                s1.as_bytes(),
                data,
                b"\r\n",
                s2.as_bytes(),
                done,
                b"\r\n",
                b"0\r\n\r\n",
            ],
        );
        t += ms(500);
    }
    let rs = w.drain(ms(5000));
    assert_eq!(rs.len(), 2, "{rs:#?}");
    for r in &rs {
        assert_eq!(r.outcome, Outcome::Ok, "{r:#?}");
        assert_eq!((r.chunks, r.t_done_ns.is_some()), (4, true));
        assert_eq!(r.ttft_ns, Some(ms(20)));
        assert!(r.tpot_ns.is_some());
    }
    assert_eq!(w.c.stats().pipelined, 0);
}

#[test]
fn request_body_over_several_receives() {
    let mut w = Wire::new();
    w.open(SK, 0);
    for (i, n) in [1448, 1448, 1448, 200].into_iter().enumerate() {
        w.recv(SK, ms(1000) + i as u64 * 100_000, n);
    }
    w.send(SK, ms(1100), &json_response("200 OK", "{}"));
    let r = w.one(ms(2000));
    assert_eq!(
        (r.t_arrive_ns, r.bytes_in, r.ttft_ns),
        (ms(1000), 4544, Some(ms(100)))
    );
}

#[test]
fn client_closes_mid_stream() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 300);
    w.send(SK, ms(1010), SSE_HEADERS);
    w.send(SK, ms(1100), &sse_chunk("a"));
    w.send(SK, ms(1130), &sse_chunk("b"));
    w.close(SK, ms(1140));
    let r = w.one(ms(2000));
    assert_eq!(r.outcome, Outcome::ClosedMidResponse);
    assert_eq!((r.ttft_ns, r.itl_ns.clone()), (Some(ms(100)), vec![ms(30)]));
    assert_eq!((r.e2e_ns, r.tpot_ns), (None, None), "no end, no E2E");
    let figures: Vec<Figure> = r.observations().map(|(f, _)| f).collect();
    assert_eq!(
        figures,
        [Figure::Ttft, Figure::Itl],
        "no episode: no breakdown"
    );
    assert_eq!(w.c.stats().connections, 0, "closed connections are dropped");
}

#[test]
fn client_eof_mid_stream_and_later_close() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 300);
    w.send(SK, ms(1010), SSE_HEADERS);
    w.send(SK, ms(1100), &sse_chunk("a"));
    w.recv(SK, ms(1120), 0);
    // The server goes on streaming to a client that left: its sends are
    // still the response's, which the server's close leaves unfinished.
    w.send(SK, ms(1125), &sse_chunk("b"));
    w.close(SK, ms(1126));
    let r = w.one(ms(2000));
    assert_eq!((r.outcome, r.chunks), (Outcome::ClosedMidResponse, 2));
    assert_eq!(w.c.stats().sends_without_request, 0);
}

/// The `openai` client stops reading at `data: [DONE]` and closes: its FIN
/// can come before the server writes the chunked terminator (seen on
/// gunicorn, hypercorn and axum under load). The server finishing the
/// response after the FIN makes it `ok`; a server that closes without
/// finishing it leaves it `closed_mid_response`, at its close.
#[test]
fn the_client_closes_before_the_terminator_then_the_server_finishes() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 300);
    w.send(SK, ms(1010), SSE_HEADERS);
    w.send(SK, ms(1100), &sse_chunk("a"));
    w.send(SK, ms(1120), &sse_chunk("[DONE]"));
    w.state(CONN_CLOSE, SK, ms(1121), TCP_ESTABLISHED, TCP_CLOSE_WAIT);
    w.send(SK, ms(1122), b"0\r\n\r\n");
    w.state(CONN_STATE, SK, ms(1123), TCP_CLOSE_WAIT, TCP_LAST_ACK);
    let r = w.one(ms(2000));
    assert_eq!(r.outcome, Outcome::Ok, "{r:#?}");
    assert_eq!((r.chunks, r.t_done_ns), (2, Some(ms(1122))));
    assert!(r.tpot_ns.is_some());
    // The same, the server closing without the terminator; and a receive
    // returning EOF instead of the FIN's state change.
    for eof in [false, true] {
        let mut w = Wire::new();
        w.open(SK, 0);
        w.recv(SK, ms(1000), 300);
        w.send(SK, ms(1010), SSE_HEADERS);
        w.send(SK, ms(1100), &sse_chunk("a"));
        if eof {
            w.recv(SK, ms(1121), 0);
        } else {
            w.state(CONN_CLOSE, SK, ms(1121), TCP_ESTABLISHED, TCP_CLOSE_WAIT);
        }
        assert!(
            w.drain(ms(1150)).is_empty(),
            "the server may still finish it"
        );
        w.state(CONN_STATE, SK, ms(1160), TCP_CLOSE_WAIT, TCP_LAST_ACK);
        if eof {
            // The receive of EOF came before any state change: the close
            // itself ends it.
            w.state(CONN_CLOSE, SK, ms(1161), TCP_CLOSE_WAIT, TCP_CLOSE);
        }
        let r = w.one(ms(2000));
        assert_eq!(
            (r.outcome, r.chunks),
            (Outcome::ClosedMidResponse, 1),
            "eof {eof}"
        );
    }
}

#[test]
fn close_before_any_send() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 300);
    w.close(SK, ms(3000));
    let r = w.one(ms(4000));
    assert_eq!(r.outcome, Outcome::ClosedBeforeResponse);
    assert_eq!(
        (r.t_first_byte_ns, r.ttft_ns, r.framing),
        (None, None, None)
    );
    assert_eq!(r.observations().count(), 0);
}

#[test]
fn pipelined_request_during_a_chunked_response() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 300);
    w.send(SK, ms(1010), SSE_HEADERS);
    w.send(SK, ms(1100), &sse_chunk("a"));
    w.recv(SK, ms(1105), 300); // the next request, before the terminator
    w.send(SK, ms(1120), &sse_chunk("b"));
    w.send(SK, ms(1130), &sse_done());
    w.send(SK, ms(1140), SSE_HEADERS);
    w.send(SK, ms(1200), &sse_chunk("c"));
    w.send(SK, ms(1210), &sse_done());
    // After a response visibly ended, the connection is followed again.
    streamed(&mut w, SK, ms(2000));
    let rs = w.drain(ms(5000));
    let outcomes: Vec<_> = rs.iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        [
            Outcome::PipelinedUnsupported,
            Outcome::PipelinedUnsupported,
            Outcome::Ok
        ]
    );
    assert_eq!(rs[0].ttft_ns, Some(ms(100)), "measured before the overlap");
    assert_eq!(rs[0].observations().count(), 0, "but not counted");
    assert_eq!(rs[1].t_arrive_ns, ms(1105));
    assert_eq!((rs[1].ttft_ns, rs[1].framing), (None, None), "never merged");
    assert!(rs[1].bytes_out > 0);
    assert_eq!(rs[2].ttft_ns, Some(ms(100)));
    assert_eq!(rs[2].request_index, 2);
    assert_eq!(w.c.stats().pipelined, 1);
}

#[test]
fn opaque_bytes_that_start_like_tls() {
    let record = |n: usize| {
        let mut r = vec![0x17, 0x03, 0x03, 0x00, 0x40];
        r.resize(n, 0xab);
        r
    };
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 517);
    w.send(SK, ms(1010), &record(120)); // encrypted headers: taken as body
    w.send(SK, ms(1100), &record(90));
    w.send(SK, ms(1130), &record(90));
    assert!(
        w.drain(ms(2000)).is_empty(),
        "the end of an opaque response is not known"
    );
    w.recv(SK, ms(3000), 517);
    w.send(SK, ms(3050), &record(300));
    let r = w.one(ms(3500));
    assert_eq!((r.framing, r.outcome), (Some(Framing::Opaque), Outcome::Ok));
    assert_eq!(
        (r.ttft_ns, r.itl_ns.clone()),
        (Some(ms(10)), vec![ms(90), ms(30)])
    );
    assert_eq!((r.t_done_ns, r.http_status), (Some(ms(1130)), None));
    // The second ends at the close: an opaque response cannot be cut short.
    w.close(SK, ms(3060));
    let r = w.one(ms(4000));
    assert_eq!((r.outcome, r.ttft_ns), (Outcome::Ok, Some(ms(50))));
}

#[test]
fn opaque_response_ends_after_a_quiet_period() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 517);
    w.send(SK, ms(1010), &[0x05, 0x03, 0x03, 0, 1, 0]);
    assert!(w.drain(ms(5000)).is_empty());
    let r = w.one(ms(7000));
    assert_eq!(r.outcome, Outcome::Ok);
    assert!(r.notes.contains(&"end_by_idle"), "{:?}", r.notes);
}

#[test]
fn a_missing_head_is_read_as_opaque() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 100);
    let mut ev = w.send_event(SK, ms(1010), &json_response("200 OK", "{}"));
    ev.head_len = 0;
    w.c.on_sock(&ev);
    w.close(SK, ms(1020));
    let r = w.one(ms(2000));
    assert_eq!(
        (r.framing, r.ttft_ns),
        (Some(Framing::Opaque), Some(ms(10)))
    );
    assert!(r.notes.contains(&"head_not_captured"), "{:?}", r.notes);
}

#[test]
fn error_status_500() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 100);
    w.send(
        SK,
        ms(1003),
        &json_response("500 Internal Server Error", "{\"error\":\"x\"}"),
    );
    let r = w.one(ms(2000));
    assert_eq!(
        (r.outcome, r.http_status),
        (Outcome::ErrorStatus, Some(500))
    );
    assert_eq!(r.ttft_ns, Some(ms(3)), "logged as measured");
    assert_eq!(r.observations().count(), 0, "but not a serving figure");
}

#[test]
fn two_interleaved_connections() {
    let (a, b) = (0xa0, 0xb0);
    let mut w = Wire::new();
    w.open(a, 0);
    w.open(b, 1);
    w.recv(a, ms(1000), 100);
    w.recv(b, ms(1005), 200);
    w.send(a, ms(1010), SSE_HEADERS);
    w.send(b, ms(1012), SSE_HEADERS);
    w.send(b, ms(1050), &sse_chunk("b1"));
    w.send(a, ms(1060), &sse_chunk("a1"));
    w.send(a, ms(1070), &sse_chunk("a2"));
    w.send(b, ms(1090), &sse_chunk("b2"));
    w.send(b, ms(1095), &sse_done());
    w.send(a, ms(1100), &sse_done());
    let rs = w.drain(ms(2000));
    assert_eq!(rs.len(), 2);
    let by = |sk: u64| {
        rs.iter()
            .find(|r| r.sk == sk)
            .expect("request of the connection")
    };
    let (ra, rb) = (by(a), by(b));
    assert_eq!(
        (ra.ttft_ns, ra.itl_ns.clone()),
        (Some(ms(60)), vec![ms(10), ms(30)])
    );
    assert_eq!(
        (rb.ttft_ns, rb.itl_ns.clone()),
        (Some(ms(45)), vec![ms(40), ms(5)])
    );
    assert_eq!(
        (ra.client_port, rb.client_port),
        (40000 + 0xa0, 40000 + 0xb0)
    );
    assert_eq!((ra.bytes_in, rb.bytes_in), (100, 200));
}

#[test]
fn events_delivered_out_of_order_within_the_window() {
    let mut w = Wire::new();
    let recv = w.recv_event(SK, ms(1000), 100);
    let headers = w.send_event(SK, ms(1001), SSE_HEADERS);
    let chunk = w.send_event(SK, ms(1002), &sse_chunk("a"));
    let done = w.send_event(SK, ms(1003), b"0\r\n\r\n");
    // Another CPU's events overtake: the send and the open come late.
    w.c.on_sock(&recv);
    w.c.on_sock(&chunk);
    w.c.on_sock(&headers);
    w.open(SK, ms(999));
    w.c.on_sock(&done);
    let r = w.one(ms(1100));
    assert_eq!(
        (r.ttft_ns, r.chunks, r.outcome),
        (Some(ms(2)), 1, Outcome::Ok)
    );
    assert_eq!(w.c.stats().late_events, 0);
}

#[test]
fn socket_errors_and_unknown_connections_are_counted_not_fatal() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), -11); // EAGAIN
    let mut ev = w.send_event(SK, ms(1001), b"x");
    ev.bytes = -32; // EPIPE
    w.c.on_sock(&ev);
    w.recv(0xdead, ms(1002), 10);
    w.send(SK, ms(1003), b"stray");
    w.close(0xbeef, ms(1004));
    assert!(w.drain(ms(2000)).is_empty());
    let s = w.c.stats();
    assert_eq!(
        (
            s.socket_errors,
            s.unknown_conn_events,
            s.sends_without_request
        ),
        (2, 2, 1)
    );
}

#[test]
fn reused_socket_without_a_close() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 100);
    w.open(SK, ms(2000));
    w.recv(SK, ms(2001), 100);
    w.send(SK, ms(2002), &json_response("200 OK", "{}"));
    let rs = w.drain(ms(3000));
    let got: Vec<_> = rs.iter().map(|r| (r.outcome, r.request_index)).collect();
    assert_eq!(got, [(Outcome::ClosedBeforeResponse, 0), (Outcome::Ok, 0)]);
    assert_eq!(w.c.stats().connections_reopened, 1);
}

#[test]
fn a_connection_the_kernel_stopped_following_is_counted() {
    // Open here, adopted again by the kernel (an open from ESTABLISHED):
    // its map evicted it meanwhile. The request in flight is cut, the next
    // one followed.
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 100);
    w.state(CONN_OPEN, SK, ms(2000), TCP_ESTABLISHED, TCP_ESTABLISHED);
    w.recv(SK, ms(2001), 100);
    w.send(SK, ms(2002), &json_response("200 OK", "{}"));
    let rs = w.drain(ms(3000));
    let got: Vec<_> = rs.iter().map(|r| r.outcome).collect();
    assert_eq!(got, [Outcome::ClosedBeforeResponse, Outcome::Ok]);
    let s = w.c.stats();
    assert_eq!(
        (s.connections_lost_in_kernel, s.connections_reopened),
        (1, 0)
    );
}

#[test]
fn bodyless_and_until_close_responses() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 100);
    w.send(SK, ms(1001), b"HTTP/1.1 204 No Content\r\n\r\n");
    let r = w.one(ms(1100));
    assert_eq!(
        (r.outcome, r.ttft_ns, r.e2e_ns),
        (Outcome::Ok, None, Some(ms(1)))
    );
    // HTTP/1.0 style: no length, no chunking, the body runs to the close.
    w.recv(SK, ms(2000), 100);
    w.send(
        SK,
        ms(2010),
        b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n",
    );
    w.send(SK, ms(2020), b"hello");
    w.close(SK, ms(2030));
    let r = w.one(ms(3000));
    assert_eq!(
        (r.outcome, r.ttft_ns, r.request_index),
        (Outcome::Ok, Some(ms(20)), 1)
    );
}

#[test]
fn a_connection_opened_before_tracing_is_adopted_at_its_next_request() {
    // The kernel announces it at its first data segment, as opened from
    // `ESTABLISHED`: requests on it are followed from there.
    let mut w = Wire::new();
    w.state(CONN_OPEN, 0x77, ms(1000), TCP_ESTABLISHED, TCP_ESTABLISHED);
    w.recv(0x77, ms(1000), 200);
    w.send(0x77, ms(1050), &json_response("200 OK", "{}"));
    let r = w.one(ms(2000));
    assert_eq!((r.request_index, r.ttft_ns), (0, Some(ms(50))));
    let s = w.c.stats();
    assert_eq!((s.connections_adopted, s.connections), (1, 1));
}
