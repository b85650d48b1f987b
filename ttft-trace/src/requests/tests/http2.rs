//! HTTP/2 streams end to end: frame bytes walked as the kernel walks them
//! (`ttft_trace_common::h2::walk_step`), the events in, one request per
//! stream out.

use ttft_trace_common::h2::{
    CutHeader, FrameBytes, H2_CONTINUED, H2_CUT_READ, H2_FRAME_HEAD, H2_HEADERS, H2_PEEK, H2_RECV,
    H2_SEND, H2BlockEvent, H2FramesEvent, Walk, WalkState, walk_call,
};

use super::*;
use crate::requests::{Outcome, response::Framing};

const SK: u64 = 0x7000;
const T0: u64 = ms(1_000);

struct Bytes<'a>(&'a [u8]);

impl FrameBytes for Bytes<'_> {
    fn peek(&mut self, at: u32, dst: &mut [u8; H2_PEEK]) -> u32 {
        let rest = self.0.get(at as usize..).unwrap_or_default();
        let n = rest.len().min(H2_PEEK);
        dst[..n].copy_from_slice(&rest[..n]);
        n as u32
    }

    fn small(&mut self, at: u32, dst: &mut [u8; H2_CUT_READ]) -> u32 {
        let rest = self.0.get(at as usize..).unwrap_or_default();
        let n = rest.len().min(H2_CUT_READ);
        dst[..n].copy_from_slice(&rest[..n]);
        n as u32
    }

    /// One slice: the peek never stops at a header's end inside it.
    fn head(&mut self, _at: u32, _dst: &mut [u8; H2_FRAME_HEAD]) -> u32 {
        0
    }
}

pub(super) fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The event the kernel sends for one call of whole frames.
pub(super) fn walked(dir: u32, t: u64, bytes: &[u8]) -> Box<H2FramesEvent> {
    walked_after(dir, t, bytes, &mut CutHeader::default())
}

/// [`walked`] for a send whose first byte is at sequence number `seq`, as
/// the TCP send hook reports it.
fn walked_at(t: u64, seq: u32, bytes: &[u8]) -> Box<H2FramesEvent> {
    let mut ev = walked(H2_SEND, t, bytes);
    ev.seq = seq;
    ev
}

/// The event the kernel sends for one call that starts on a frame header
/// or on the rest of the direction's cut one, `cut`, and ends on a
/// frame's end or in a header (then kept in `cut`): at most
/// `H2_MAX_FRAMES` frames here.
fn walked_after(dir: u32, t: u64, bytes: &[u8], cut: &mut CutHeader) -> Box<H2FramesEvent> {
    let mut evs = walked_events(dir, t, bytes, cut);
    assert_eq!(evs.len(), 1, "one event's frames");
    Box::new(evs.remove(0))
}

/// The events the kernel sends for one call: one per `H2_MAX_FRAMES`
/// frames, the later ones `H2_CONTINUED`.
fn walked_events(dir: u32, t: u64, bytes: &[u8], cut: &mut CutHeader) -> Vec<H2FramesEvent> {
    let mut ev = Box::new(H2FramesEvent {
        dir,
        sk: SK,
        t_ns: t,
        bytes: bytes.len() as u32,
        ..H2FramesEvent::default()
    });
    let w = Walk {
        from: 0,
        total: bytes.len() as u32,
        resync: false,
    };
    let mut st = WalkState::default();
    let mut full = Vec::new();
    let end = walk_call(&mut Bytes(bytes), &w, cut, &mut st, &mut ev, &mut |e| {
        full.push(*e);
    });
    assert_eq!(end, Some(w.total), "whole frames, or a header cut");
    full.push(*ev);
    full
}

/// Two requests in one segment at T0 (HEADERS with `:method: POST`, then
/// the request message with END_STREAM) on streams 1 and 3, read at
/// T0 + 1 ms.
fn two_requests(w: &mut Wire) {
    let mut req = frame(1, 4, 1, &[0x83, 0x86]);
    req.extend(frame(0, 1, 1, &[0, 0, 0, 0, 1, 7]));
    req.extend(frame(1, 4, 3, &[0x83, 0x86]));
    req.extend(frame(0, 1, 3, &[0, 0, 0, 0, 1, 7]));
    w.c.on_h2(walked(H2_RECV, T0, &req));
    w.recv(SK, T0 + ms(1), req.len() as i64);
}

/// [`two_requests`] on a connection whose sequence numbers start at `isn`
/// (exact ACKs), both answered with their response HEADERS at T0 + 5 ms.
fn headers_sent(isn: u32) -> Wire {
    let mut w = Wire::new();
    w.exact_acks = true;
    w.open(SK, 0);
    w.seq_from(SK, isn);
    two_requests(&mut w);
    let mut heads = frame(1, 4, 1, &[0x88]);
    heads.extend(frame(1, 4, 3, &[0x88]));
    send_at(&mut w, ms(5), &heads);
    w
}

/// A send at T0 + `dt` through the TCP send hook (its sequence number known).
fn send_at(w: &mut Wire, dt: u64, bytes: &[u8]) {
    let seq = w.seq[&SK].snd_nxt;
    w.send(SK, T0 + dt, bytes);
    w.c.on_h2(walked_at(T0 + dt, seq, bytes));
}

/// The connection closed at T0 + 100 ms: the records of streams 1 and 3.
fn streams_one_and_three(w: &mut Wire) -> Vec<RequestRecord> {
    w.close(SK, T0 + ms(100));
    let mut rs = w.drain(ms(10_000));
    rs.sort_by_key(|r| r.request_index);
    assert_eq!(rs.len(), 2, "{rs:#?}");
    rs
}

#[test]
fn each_stream_is_a_request_and_a_cancelled_one_is_reset() {
    let mut w = Wire::new();
    w.open(SK, 0);
    two_requests(&mut w);
    // Response headers of both in one send, then messages interleaved.
    let mut heads = frame(1, 4, 1, &[0x88]);
    heads.extend(frame(1, 4, 3, &[0x88]));
    let sends: Vec<(u64, Vec<u8>)> = vec![
        (ms(5), heads),
        (ms(20), frame(0, 0, 3, &[0, 0, 0, 0, 2, 1, 2])),
        (ms(30), frame(0, 0, 1, &[0, 0, 0, 0, 2, 1, 2])),
        (ms(40), frame(0, 0, 1, &[0, 0, 0, 0, 2, 3, 4])),
    ];
    for (dt, bytes) in &sends {
        w.send(SK, T0 + dt, bytes);
        w.c.on_h2(walked(H2_SEND, T0 + dt, bytes));
    }
    // The client cancels stream 3 (RST_STREAM, CANCEL = 8).
    let rst = frame(3, 0, 3, &8u32.to_be_bytes());
    w.c.on_h2(walked(H2_RECV, T0 + ms(45), &rst));
    w.recv(SK, T0 + ms(46), rst.len() as i64);
    // Stream 1 ends with its trailers.
    let trailers = frame(1, 5, 1, &[0x40, 0x0b]);
    w.send(SK, T0 + ms(50), &trailers);
    w.c.on_h2(walked(H2_SEND, T0 + ms(50), &trailers));
    let rs = streams_one_and_three(&mut w);
    let (one, three) = (&rs[0], &rs[1]);
    assert_eq!((one.http2_stream_id, one.outcome), (Some(1), Outcome::Ok));
    assert_eq!(one.framing, Some(Framing::Http2));
    assert_eq!(
        (one.t_arrive_ns, one.t_request_segment_ns),
        (T0 + ms(1), Some(T0))
    );
    assert_eq!(one.ttft_ns, Some(ms(29)));
    assert_eq!((one.chunks, one.itl_ns.clone()), (2, vec![ms(10)]));
    assert_eq!((one.http_status, one.e2e_ns), (Some(200), Some(ms(49))));
    assert_eq!(three.http2_stream_id, Some(3));
    assert_eq!(three.outcome, Outcome::Reset);
    assert_eq!(
        (three.http2_error_code, three.http2_ended_by),
        (Some(8), Some("client"))
    );
    assert_eq!(three.ttft_ns, Some(ms(19)));
    let json = serde_json::to_string(three).expect("json");
    assert!(json.contains(r#""http2_stream_id":3,"http2_error_code":8,"http2_ended_by":"client","grpc_status":null,"grpc_message":null,"tls":null,"retry_of":null,"user_ttft_ns":null,"outcome":"reset""#), "{json}");
}

#[test]
fn streams_open_at_the_close_are_cut() {
    let mut w = Wire::new();
    w.open(SK, 0);
    let req = frame(1, 5, 1, &[0x82]);
    w.c.on_h2(walked(H2_RECV, T0, &req));
    w.recv(SK, T0 + ms(1), req.len() as i64);
    let head = frame(1, 4, 1, &[0x88]);
    w.send(SK, T0 + ms(2), &head);
    w.c.on_h2(walked(H2_SEND, T0 + ms(2), &head));
    w.close(SK, T0 + ms(10));
    let rs = w.drain(ms(10_000));
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].outcome, Outcome::ClosedMidResponse);
    assert_eq!(rs[0].t_first_token_ns, None);
}

#[test]
fn frame_headers_cut_between_calls_keep_their_first_byte_time() {
    let mut w = Wire::new();
    w.open(SK, 0);
    let (mut rx, mut tx) = (CutHeader::default(), CutHeader::default());
    // The request's HEADERS frame header in two segments (4 bytes at T0,
    // the rest 3 ms later), read once whole.
    let mut req = frame(1, 4, 1, &[0x83, 0x86]);
    req.extend(frame(0, 1, 1, &[0, 0, 0, 0, 1, 7]));
    w.c.on_h2(walked_after(H2_RECV, T0, &req[..4], &mut rx));
    w.c.on_h2(walked_after(H2_RECV, T0 + ms(3), &req[4..], &mut rx));
    w.recv(SK, T0 + ms(4), req.len() as i64);
    // The response's HEADERS header cut after 5 bytes; the first DATA
    // frame's header after 2, its payload with the rest.
    let mut resp = frame(1, 4, 1, &[0x88]);
    let data_at = resp.len();
    resp.extend(frame(0, 0, 1, &[0, 0, 0, 0, 2, 1, 2]));
    let sends = [
        (ms(10), &resp[..5]),
        (ms(11), &resp[5..data_at + 2]),
        (ms(20), &resp[data_at + 2..]),
    ];
    for (dt, bytes) in sends {
        w.send(SK, T0 + dt, bytes);
        w.c.on_h2(walked_after(H2_SEND, T0 + dt, bytes, &mut tx));
    }
    let trailers = frame(1, 5, 1, &[0x40, 0x0b]);
    w.send(SK, T0 + ms(30), &trailers);
    w.c.on_h2(walked_after(H2_SEND, T0 + ms(30), &trailers, &mut tx));
    w.close(SK, T0 + ms(100));
    let rs = w.drain(ms(10_000));
    assert_eq!(rs.len(), 1, "{rs:#?}");
    let r = &rs[0];
    assert_eq!((r.http2_stream_id, r.outcome), (Some(1), Outcome::Ok));
    // Arrival: the segment with the header's first byte; first token:
    // the send with the DATA payload, not the one that began its header.
    assert_eq!(r.t_request_segment_ns, Some(T0));
    assert_eq!(r.t_arrive_ns, T0 + ms(4));
    assert_eq!(r.t_first_byte_ns, Some(T0 + ms(10)));
    assert_eq!(r.t_first_token_ns, Some(T0 + ms(20)));
    assert_eq!((r.http_status, r.chunks), (Some(200), 1));
}

/// Each stream's first token is acknowledged when the client's ACK reaches
/// past its first DATA frame's last byte (the frame, not the send that
/// carries it): the client TTFT estimate from the stream's request segment,
/// as on HTTP/1.1. A send whose sequence number is unknown (the syscall
/// hook) leaves the delivery unknown.
#[test]
fn a_streams_first_token_is_acknowledged_past_its_first_data_frame() {
    const ISN: u32 = u32::MAX - 40; // the response's sequence numbers wrap
    let mut w = headers_sent(ISN);
    // Stream 3's first message, acknowledged 2 ms later.
    send_at(&mut w, ms(20), &frame(0, 0, 3, &[0, 0, 0, 0, 2, 1, 2]));
    w.segment(SK, T0 + ms(22), 0);
    // Stream 1's first message behind a WINDOW_UPDATE in one send; an ACK
    // of part of its frame (the client's window, a segment boundary) is not
    // its delivery, the next one is.
    let mut one = frame(8, 0, 0, &[0, 0, 1, 0]);
    let data_at = one.len() as u32;
    one.extend(frame(0, 0, 1, &[0, 0, 0, 0, 2, 1, 2]));
    let base = w.seq[&SK].snd_nxt;
    send_at(&mut w, ms(30), &one);
    w.segment_acking(SK, T0 + ms(31), 0, base.wrapping_add(data_at + 9 + 3));
    w.segment(SK, T0 + ms(33), 0);
    // Stream 1's end; stream 3's end with a send whose sequence number is
    // unknown changes nothing of its delivery, already known.
    let trailers = frame(1, 5, 1, &[0x40, 0x0b]);
    send_at(&mut w, ms(40), &trailers);
    let end3 = frame(0, 1, 3, &[0, 0, 0, 0, 2, 3, 4]);
    w.send(SK, T0 + ms(41), &end3);
    w.c.on_h2(walked(H2_SEND, T0 + ms(41), &end3));
    let rs = streams_one_and_three(&mut w);
    let (one, three) = (&rs[0], &rs[1]);
    assert_eq!(one.t_first_token_ns, Some(T0 + ms(30)));
    assert_eq!(one.t_first_token_acked_ns, Some(T0 + ms(33)));
    assert_eq!(one.client_ttft_estimate_ns, Some(ms(33)));
    assert_eq!(three.t_first_token_acked_ns, Some(T0 + ms(22)));
    assert_eq!(three.client_ttft_estimate_ns, Some(ms(22)));

    // The same first message from the syscall hook: no sequence number.
    let mut w = Wire::new();
    w.exact_acks = true;
    w.open(SK, 0);
    w.seq_from(SK, ISN);
    let req = frame(1, 5, 1, &[0x83, 0x86]);
    w.c.on_h2(walked(H2_RECV, T0, &req));
    w.recv(SK, T0 + ms(1), req.len() as i64);
    let mut resp = frame(1, 4, 1, &[0x88]);
    resp.extend(frame(0, 1, 1, &[0, 0, 0, 0, 2, 1, 2]));
    w.send(SK, T0 + ms(20), &resp);
    w.c.on_h2(walked(H2_SEND, T0 + ms(20), &resp));
    w.segment(SK, T0 + ms(22), 0);
    w.close(SK, T0 + ms(100));
    let r = w.one(ms(10_000));
    assert_eq!(r.t_first_token_ns, Some(T0 + ms(20)));
    assert_eq!(
        (r.t_first_token_acked_ns, r.client_ttft_estimate_ns),
        (None, None)
    );
}

/// Every chunk of a stream is awaited like its first token: the gaps
/// between the ACKs of its DATA frames are the deliveries a stall is judged
/// on (the client's side of a stream that stood still after its first
/// token), in order across the streams sharing the connection's sequence
/// space.
#[test]
fn each_chunk_of_a_stream_is_dated_by_its_ack() {
    let mut w = headers_sent(7_000);
    w.segment(SK, T0 + ms(6), 0);
    let msg = |stream, flags| frame(0, flags, stream, &[0, 0, 0, 0, 2, 1, 2]);
    // Stream 1's chunks at 20, 30 and 40 ms, stream 3's at 25 and 35 ms;
    // the client acknowledges each at once until 31 ms, then nothing until
    // 90 ms (stream 1's third and stream 3's second wait).
    send_at(&mut w, ms(20), &msg(1, 0));
    w.segment(SK, T0 + ms(21), 0);
    send_at(&mut w, ms(25), &msg(3, 0));
    w.segment(SK, T0 + ms(26), 0);
    send_at(&mut w, ms(30), &msg(1, 0));
    w.segment(SK, T0 + ms(31), 0);
    send_at(&mut w, ms(35), &msg(3, 1));
    send_at(&mut w, ms(40), &msg(1, 1));
    w.segment(SK, T0 + ms(90), 0);
    let rs = streams_one_and_three(&mut w);
    let (one, three) = (&rs[0], &rs[1]);
    assert_eq!(one.chunks, 3);
    assert_eq!(one.t_first_chunk_acked_ns, Some(T0 + ms(21)));
    assert_eq!(one.chunk_ack_gaps_ns, vec![ms(10), ms(59)]);
    assert_eq!(three.t_first_chunk_acked_ns, Some(T0 + ms(26)));
    assert_eq!(three.chunk_ack_gaps_ns, vec![ms(64)]);
    assert!(one.notes.iter().all(|n| *n != "chunk_acks_incomplete"));
}

/// A client opening twelve calls in one segment, and a server answering
/// them in one send: 24 frames each way, each call in two kernel events
/// (16 frames, then the rest, `H2_CONTINUED`). Every stream is one
/// request, and a stream whose two DATA frames fall in the two events of
/// one send has one chunk from it, as a send is one chunk.
#[test]
fn a_call_of_more_frames_than_an_event_holds_loses_none() {
    let mut w = Wire::new();
    w.open(SK, 0);
    let streams: Vec<u32> = (0..12).map(|k| 2 * k + 1).collect();
    let req: Vec<u8> = streams
        .iter()
        .flat_map(|&s| {
            let mut r = frame(1, 4, s, &[0x83, 0x86]);
            r.extend(frame(0, 1, s, &[0, 0, 0, 0, 1, 7]));
            r
        })
        .collect();
    let evs = walked_events(H2_RECV, T0, &req, &mut CutHeader::default());
    assert_eq!(evs.len(), 2);
    for ev in evs {
        w.c.on_h2(Box::new(ev));
    }
    w.recv(SK, T0 + ms(1), req.len() as i64);
    // One send: every stream's HEADERS and first message, then stream 1's
    // second message (the 25th frame: the second event).
    let mut resp: Vec<u8> = streams
        .iter()
        .flat_map(|&s| {
            let mut r = frame(1, 4, s, &[0x88]);
            r.extend(frame(0, 0, s, &[0, 0, 0, 0, 2, 1, 2]));
            r
        })
        .collect();
    resp.extend(frame(0, 0, 1, &[0, 0, 0, 0, 2, 3, 4]));
    w.send(SK, T0 + ms(20), &resp);
    let evs = walked_events(H2_SEND, T0 + ms(20), &resp, &mut CutHeader::default());
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[1].flags, H2_CONTINUED);
    for ev in evs {
        w.c.on_h2(Box::new(ev));
    }
    let trailers: Vec<u8> = streams
        .iter()
        .flat_map(|&s| frame(1, 5, s, &[0x40, 0x0b]))
        .collect();
    w.send(SK, T0 + ms(30), &trailers);
    for ev in walked_events(H2_SEND, T0 + ms(30), &trailers, &mut CutHeader::default()) {
        w.c.on_h2(Box::new(ev));
    }
    w.close(SK, T0 + ms(100));
    let mut rs = w.drain(ms(10_000));
    rs.sort_by_key(|r| r.request_index);
    let got: Vec<(Option<u32>, Outcome, u32)> = rs
        .iter()
        .map(|r| (r.http2_stream_id, r.outcome, r.chunks))
        .collect();
    let want: Vec<(Option<u32>, Outcome, u32)> =
        streams.iter().map(|&s| (Some(s), Outcome::Ok, 1)).collect();
    assert_eq!(got, want);
}

/// A server send of `frames` at `t`, walked, with each HEADERS frame's
/// block after its event, as the kernel sends them (`index`: the
/// connection's count of blocks): the correlator decodes them first.
fn send_with_blocks(w: &mut Wire, t: u64, frames: &[Vec<u8>], index: &mut u32) {
    let bytes: Vec<u8> = frames.concat();
    w.send(SK, t, &bytes);
    w.c.on_h2(walked(H2_SEND, t, &bytes));
    let mut offset = 0u32;
    for f in frames {
        if f[3] == H2_HEADERS {
            let payload = &f[9..];
            let mut b = H2BlockEvent {
                stream: u32::from_be_bytes([f[5], f[6], f[7], f[8]]),
                sk: SK,
                t_ns: t,
                offset,
                len: payload.len() as u32,
                captured: payload.len() as u32,
                index: *index,
                flags: f[4],
                ..H2BlockEvent::default()
            };
            b.bytes[..payload.len()].copy_from_slice(payload);
            *index += 1;
            w.c.on_h2_block(Box::new(b));
        }
        offset += f.len() as u32;
    }
}

/// gRPC statuses from the trailers, through HPACK's dynamic table (a real
/// encoder's blocks: the second trailers refer to entries the first put
/// there): a call that failed is `error_status` with its code and
/// message, the one that succeeded `ok` with 0. With a block lost (a gap
/// in the kernel's count), nothing more is decoded: statuses unknown,
/// never wrong.
#[test]
fn grpc_status_and_message_come_from_the_trailers() {
    for lost in [false, true] {
        let mut w = Wire::new();
        w.open(SK, 0);
        two_requests(&mut w);
        let mut enc = fluke_hpack::Encoder::new();
        let mut enc_block =
            |h: &[(&str, &str)]| enc.encode(h.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        let resp = [(":status", "200"), ("content-type", "application/grpc")];
        let (r1, r3) = (enc_block(&resp), enc_block(&resp));
        let ok = enc_block(&[("grpc-status", "0")]);
        let failed = enc_block(&[("grpc-status", "8"), ("grpc-message", "KV%20cache%20full")]);
        let mut index = 0;
        send_with_blocks(
            &mut w,
            T0 + ms(5),
            &[frame(1, 4, 1, &r1), frame(1, 4, 3, &r3)],
            &mut index,
        );
        let msg = [0, 0, 0, 0, 1, 7];
        send_with_blocks(
            &mut w,
            T0 + ms(20),
            &[frame(0, 0, 1, &msg), frame(1, 5, 1, &ok)],
            &mut index,
        );
        if lost {
            index += 1;
        }
        send_with_blocks(&mut w, T0 + ms(30), &[frame(1, 5, 3, &failed)], &mut index);
        let rs = streams_one_and_three(&mut w);
        let (one, three) = (&rs[0], &rs[1]);
        assert_eq!((one.outcome, one.grpc_status), (Outcome::Ok, Some(0)));
        assert_eq!(one.http_status, Some(200));
        if lost {
            assert_eq!((three.outcome, three.grpc_status), (Outcome::Ok, None));
            assert_eq!(three.grpc_message, None);
        } else {
            assert_eq!(
                (three.outcome, three.grpc_status),
                (Outcome::ErrorStatus, Some(8))
            );
            assert_eq!(three.grpc_message.as_deref(), Some("KV cache full"));
        }
    }
}
