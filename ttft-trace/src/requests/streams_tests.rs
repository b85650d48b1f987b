//! Streams from frame summaries: interleaved across sends, several in one
//! send, padding, resets either side, GOAWAY, the connection's end.

use ttft_trace_common::h2::{
    H2_CONTINUATION, H2_DATA, H2_END_HEADERS, H2_END_STREAM, H2_GOAWAY, H2_HEADERS, H2_PADDED,
    H2_PRIORITY_FLAG, H2_RECV, H2_RST_STREAM, H2_SEND, H2Frame, H2FramesEvent,
};

use super::*;

/// A frame: (type, flags, stream, payload length, first payload bytes).
type F<'a> = (u8, u8, u32, u32, &'a [u8]);

fn call(dir: u32, t_ns: u64, frames: &[F]) -> H2FramesEvent {
    let mut ev = H2FramesEvent {
        dir,
        t_ns,
        n_frames: frames.len() as u32,
        ..H2FramesEvent::default()
    };
    for (i, (kind, flags, stream, len, head)) in frames.iter().enumerate() {
        let mut f = H2Frame {
            kind: *kind,
            flags: *flags,
            stream: *stream,
            len: *len,
            head_len: head.len() as u8,
            ..H2Frame::default()
        };
        f.head[..head.len()].copy_from_slice(head);
        ev.frames[i] = f;
    }
    ev
}

const MSG: &[u8] = &[0, 0, 0, 0, 5, b't', b'o', b'k'];

fn run(table: &mut StreamTable, ev: &H2FramesEvent) -> Vec<(Stream, StreamEnd)> {
    let mut done = Vec::new();
    table.on_frames(ev, &mut done);
    done
}

#[test]
fn interleaved_streams_each_get_their_own_times() {
    let mut t = StreamTable::new(16);
    // Two requests in one segment, read at 110.
    let hdrs = H2_HEADERS;
    run(
        &mut t,
        &call(
            H2_RECV,
            100,
            &[
                (hdrs, H2_END_HEADERS, 1, 30, &[0x83]),
                (H2_DATA, H2_END_STREAM, 1, 10, MSG),
                (hdrs, H2_END_HEADERS, 3, 30, &[0x83]),
                (H2_DATA, H2_END_STREAM, 3, 10, MSG),
            ],
        ),
    );
    t.on_recv(110, 7, 8);
    // A third one, a later segment, read later.
    run(
        &mut t,
        &call(H2_RECV, 150, &[(hdrs, H2_END_HEADERS, 5, 30, &[0x83])]),
    );
    t.on_recv(160, 7, 9);
    // Both responses' HEADERS in one send; stream 3's first message
    // first; then one send with a message of each.
    run(
        &mut t,
        &call(
            H2_SEND,
            200,
            &[
                (H2_HEADERS, H2_END_HEADERS, 1, 5, &[0x88]),
                (H2_HEADERS, H2_END_HEADERS, 3, 5, &[0x88]),
            ],
        ),
    );
    run(&mut t, &call(H2_SEND, 300, &[(H2_DATA, 0, 3, 10, MSG)]));
    run(
        &mut t,
        &call(
            H2_SEND,
            400,
            &[
                (H2_DATA, 0, 1, 10, MSG),
                (H2_DATA, 0, 3, 10, MSG),
                (H2_DATA, 0, 1, 10, MSG),
            ],
        ),
    );
    // Stream 1 ends on DATA, 3 on its trailers.
    let done = run(
        &mut t,
        &call(H2_SEND, 500, &[(H2_DATA, H2_END_STREAM, 1, 10, MSG)]),
    );
    assert_eq!(done.len(), 1);
    let (s1, end) = &done[0];
    assert_eq!((s1.id, *end), (1, StreamEnd::Ended));
    assert_eq!((s1.t_segment, s1.t_arrive, s1.tid), (100, Some(110), 8));
    assert_eq!((s1.t_first_byte, s1.t_first_token), (Some(200), Some(400)));
    // Two DATA frames in one send are one chunk.
    assert_eq!((s1.chunks, s1.itl.clone()), (2, vec![100]));
    // Its request: HEADERS (30) and DATA (10), with their frame headers.
    assert_eq!((s1.status, s1.bytes_out, s1.bytes_in), (Some(200), 30, 58));
    let trailers = (
        H2_HEADERS,
        H2_END_HEADERS | H2_END_STREAM,
        3,
        20,
        &[0x40][..],
    );
    let done = run(&mut t, &call(H2_SEND, 600, &[trailers]));
    let (s3, end) = &done[0];
    assert_eq!((s3.id, *end, s3.t_arrive), (3, StreamEnd::Ended, Some(110)));
    assert_eq!(
        (s3.t_first_token, s3.chunks, s3.itl.clone()),
        (Some(300), 2, vec![100])
    );
    assert_eq!(s3.t_last_send, Some(600));
    // Stream 5 still open, arrived at its own receive.
    let mut cut = Vec::new();
    t.cut(&mut cut);
    assert_eq!(cut.len(), 1);
    let (s5, end) = &cut[0];
    assert_eq!(
        (s5.id, *end, s5.t_arrive, s5.tid),
        (5, StreamEnd::Cut, Some(160), 9)
    );
    assert_eq!((s5.t_first_byte, s5.bytes_in), (None, 39));
}

#[test]
fn padding_alone_is_no_chunk_and_status_skips_pad_and_priority() {
    let mut t = StreamTable::new(16);
    run(
        &mut t,
        &call(H2_RECV, 1, &[(H2_HEADERS, H2_END_HEADERS, 1, 9, &[0x83])]),
    );
    // Pad length 2, priority fields, then `:status: 404` (index 13).
    let flags = H2_END_HEADERS | H2_PADDED | H2_PRIORITY_FLAG;
    let head = [2, 0, 0, 0, 0, 16, 0x8d, 0];
    run(
        &mut t,
        &call(H2_SEND, 2, &[(H2_HEADERS, flags, 1, 12, &head)]),
    );
    // A DATA frame of padding only: pad length 4 in 5 bytes.
    run(
        &mut t,
        &call(H2_SEND, 3, &[(H2_DATA, H2_PADDED, 1, 5, &[4, 0, 0, 0, 0])]),
    );
    // A CONTINUATION changes nothing.
    run(
        &mut t,
        &call(
            H2_SEND,
            4,
            &[(H2_CONTINUATION, H2_END_HEADERS, 1, 3, &[1, 2, 3])],
        ),
    );
    let done = run(
        &mut t,
        &call(
            H2_SEND,
            5,
            &[(
                H2_DATA,
                H2_PADDED | H2_END_STREAM,
                1,
                9,
                &[3, 0, 0, 0, 0, 1, b'x'],
            )],
        ),
    );
    let (s, end) = &done[0];
    assert_eq!(*end, StreamEnd::Ended);
    assert_eq!(
        (s.status, s.t_first_token, s.chunks, s.bytes_out),
        (Some(404), Some(5), 1, 5)
    );
}

/// nginx's first response on a connection: a dynamic table size update
/// to 0 (`0x20`), then `:status: 200`; a size update with a multi-byte
/// integer (4096: `0x3f 0xe1 0x1f`) is passed over too.
#[test]
fn status_follows_dynamic_table_size_updates() {
    let headers = |head: &[u8]| {
        let mut f = H2Frame {
            kind: H2_HEADERS,
            len: 20,
            head_len: head.len() as u8,
            ..H2Frame::default()
        };
        f.head[..head.len()].copy_from_slice(head);
        status(&f)
    };
    assert_eq!(headers(&[0x20, 0x88]), Some(200));
    assert_eq!(headers(&[0x3f, 0xe1, 0x1f, 0x8d]), Some(404));
    assert_eq!(headers(&[0x20, 0x3f, 0xe1, 0x1f, 0x88]), Some(200));
    // An integer that runs past what was captured: not guessed.
    assert_eq!(headers(&[0x3f, 0xe1, 0x9f, 0x80, 0x80]), None);
}

#[test]
fn literal_status_is_not_guessed() {
    let f = H2Frame {
        kind: H2_HEADERS,
        len: 4,
        head_len: 4,
        head: [0x48, 0x03, b'2', b'0', 0, 0, 0, 0],
        ..H2Frame::default()
    };
    assert_eq!(status(&f), None);
}

#[test]
fn resets_either_side_and_goaway() {
    let mut t = StreamTable::new(16);
    let open = |id| (H2_HEADERS, H2_END_HEADERS, id, 9, &[0x83][..]);
    run(
        &mut t,
        &call(H2_RECV, 1, &[open(1), open(3), open(5), open(7)]),
    );
    run(&mut t, &call(H2_SEND, 2, &[(H2_DATA, 0, 1, 10, MSG)]));
    // The client cancels stream 1 (CANCEL = 8) mid-response.
    let done = run(
        &mut t,
        &call(H2_RECV, 3, &[(H2_RST_STREAM, 0, 1, 4, &8u32.to_be_bytes())]),
    );
    let (s, end) = &done[0];
    assert_eq!(s.id, 1);
    assert_eq!(
        *end,
        StreamEnd::Reset {
            code: 8,
            by: Side::Client
        }
    );
    assert_eq!(s.t_first_token, Some(2));
    // The server refuses stream 3 (REFUSED_STREAM = 7).
    let done = run(
        &mut t,
        &call(H2_SEND, 4, &[(H2_RST_STREAM, 0, 3, 4, &7u32.to_be_bytes())]),
    );
    assert_eq!(
        done[0].1,
        StreamEnd::Reset {
            code: 7,
            by: Side::Server
        }
    );
    // The client's GOAWAY(0) (a graceful shutdown) ends none of its own
    // streams: its last stream id counts the server's.
    let client_goaway = [0u8; 8];
    let done = run(
        &mut t,
        &call(H2_RECV, 5, &[(H2_GOAWAY, 0, 0, 8, &client_goaway)]),
    );
    assert!(done.is_empty(), "{done:?}");
    // The server's GOAWAY with last stream 5: stream 7 was not processed.
    let mut goaway = [0u8; 8];
    goaway[..4].copy_from_slice(&5u32.to_be_bytes());
    goaway[4..].copy_from_slice(&0u32.to_be_bytes());
    let done = run(&mut t, &call(H2_SEND, 5, &[(H2_GOAWAY, 0, 0, 8, &goaway)]));
    assert_eq!(done.len(), 1);
    assert_eq!(
        (done[0].0.id, done[0].1),
        (
            7,
            StreamEnd::GoAway {
                code: 0,
                by: Side::Server
            }
        )
    );
    // Frames of a stream never seen opening are counted, not guessed.
    run(&mut t, &call(H2_SEND, 6, &[(H2_DATA, 0, 9, 10, MSG)]));
    assert_eq!(t.unseen_frames, 1);
}

#[test]
fn streams_are_bounded() {
    let mut t = StreamTable::new(16);
    let mut evicted = Vec::new();
    for id in 0..MAX_STREAMS as u32 + 3 {
        let stream = 2 * id + 1;
        evicted.extend(run(
            &mut t,
            &call(
                H2_RECV,
                1,
                &[(H2_HEADERS, H2_END_HEADERS, stream, 9, &[0x83])],
            ),
        ));
    }
    // The oldest give way (ends that were missed must not hold the table
    // for the connection's life), counted.
    assert_eq!(t.dropped, 3);
    let ids: Vec<(u32, StreamEnd)> = evicted.iter().map(|(s, e)| (s.id, *e)).collect();
    assert_eq!(
        ids,
        [
            (1, StreamEnd::Evicted),
            (3, StreamEnd::Evicted),
            (5, StreamEnd::Evicted)
        ]
    );
    assert_eq!(t.open.len(), MAX_STREAMS);
    // Server-initiated (even) ids never open a request.
    run(
        &mut t,
        &call(H2_RECV, 1, &[(H2_HEADERS, H2_END_HEADERS, 2, 9, &[0x83])]),
    );
    assert_eq!(t.dropped, 3);
}

#[test]
fn itl_is_capped() {
    let mut t = StreamTable::new(2);
    run(
        &mut t,
        &call(H2_RECV, 1, &[(H2_HEADERS, H2_END_HEADERS, 1, 9, &[0x83])]),
    );
    for ts in 10..15 {
        run(&mut t, &call(H2_SEND, ts, &[(H2_DATA, 0, 1, 10, MSG)]));
    }
    let mut done = Vec::new();
    t.cut(&mut done);
    let s = &done[0].0;
    assert_eq!((s.chunks, s.itl.len(), s.itl_truncated), (5, 2, true));
}
