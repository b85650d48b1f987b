//! The frame walk over byte slices, as the kernel runs it over a send's
//! buffer or a segment's payload.

extern crate std;
use std::vec::Vec;

use super::*;

/// A call's bytes as one slice, or cut into pieces (iovec entries: a
/// read stops at a piece's end, as the kernel's does).
struct Pieces(Vec<Vec<u8>>);

impl Pieces {
    /// Up to `N` bytes at `at`, to the end of its piece.
    fn read<const N: usize>(&self, at: u32, dst: &mut [u8; N]) -> u32 {
        let mut start = 0;
        for p in &self.0 {
            let at = at as usize;
            if at >= start && at < start + p.len() {
                let from = &p[at - start..];
                let n = from.len().min(N);
                dst[..n].copy_from_slice(&from[..n]);
                return n as u32;
            }
            start += p.len();
        }
        0
    }
}

impl FrameBytes for Pieces {
    fn peek(&mut self, at: u32, dst: &mut [u8; H2_PEEK]) -> u32 {
        self.read(at, dst)
    }

    fn small(&mut self, at: u32, dst: &mut [u8; H2_CUT_READ]) -> u32 {
        self.read(at, dst)
    }

    fn head(&mut self, at: u32, dst: &mut [u8; H2_FRAME_HEAD]) -> u32 {
        self.read(at, dst)
    }
}

/// How a call's walk ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Walked {
    /// The offset just past the last frame begun (past `total` when that
    /// frame goes on in a later call); `None` where the walk lost its
    /// place (a header cut by the call's end or unreadable, an implausible
    /// header where resyncing, more than `H2_WALK_MAX` frames).
    pub end: Option<u32>,
    /// Events that filled and were sent before the one in `ev`, with
    /// their frames.
    pub full: u32,
    pub frames_sent: u32,
}

/// Walks the frame headers of one call into `ev.frames` (setting
/// `n_frames`; events that filled counted in `Walked`), with no
/// cut header carried in: `walk_call`, which runs the steps of
/// `walk_step` in a plain loop. The cut header kept, if any, in `cut`.
fn walk<B: FrameBytes>(
    src: &mut B,
    w: &Walk,
    ev: &mut H2FramesEvent,
    cut: &mut CutHeader,
) -> Walked {
    let mut st = WalkState::default();
    let (mut full, mut frames_sent) = (0, 0);
    let end = walk_call(src, w, cut, &mut st, ev, &mut |sent: &H2FramesEvent| {
        assert_eq!(sent.flags & H2_FULL, 0, "sent without the walk's own flag");
        full += 1;
        frames_sent += sent.n_frames;
    });
    Walked {
        end,
        full,
        frames_sent,
    }
}

pub(crate) fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = std::vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn run(pieces: Vec<Vec<u8>>, from: u32, resync: bool) -> (H2FramesEvent, Walked) {
    let total = pieces.iter().map(Vec::len).sum::<usize>() as u32;
    let mut ev = H2FramesEvent::default();
    let w = Walk {
        from,
        total,
        resync,
    };
    let walked = walk(&mut Pieces(pieces), &w, &mut ev, &mut CutHeader::default());
    (ev, walked)
}

#[test]
fn several_streams_in_one_send_and_padding() {
    // HEADERS on 1 (padded, priority: the first HPACK byte at 6), DATA
    // on 3, RST_STREAM on 5.
    let mut headers = std::vec![2, 0, 0, 0, 0, 16, 0x88, 0x5f];
    headers.extend_from_slice(&[0, 0]);
    let mut buf = frame(
        H2_HEADERS,
        H2_END_HEADERS | H2_PADDED | H2_PRIORITY_FLAG,
        1,
        &headers,
    );
    buf.extend(frame(
        H2_DATA,
        0,
        3,
        &[0, 0, 0, 0, 5, b'h', b'e', b'l', b'l', b'o'],
    ));
    buf.extend(frame(H2_RST_STREAM, 0, 5, &8u32.to_be_bytes()));
    let (ev, w) = run(std::vec![buf.clone()], 0, false);
    assert_eq!(
        w,
        Walked {
            end: Some(buf.len() as u32),
            full: 0,
            frames_sent: 0
        }
    );
    let f = ev.frames();
    assert_eq!(f.len(), 3);
    assert_eq!(
        (f[0].kind, f[0].stream, f[0].len, f[0].offset),
        (H2_HEADERS, 1, 10, 0)
    );
    assert_eq!(f[0].head(), &headers[..8]);
    assert_eq!((f[1].kind, f[1].stream, f[1].offset), (H2_DATA, 3, 19));
    assert_eq!(f[1].head(), &[0, 0, 0, 0, 5, b'h', b'e', b'l']);
    assert_eq!((f[2].kind, f[2].stream), (H2_RST_STREAM, 5));
    assert_eq!(f[2].head(), &8u32.to_be_bytes());
}

#[test]
fn a_frame_split_across_sends_carries_over() {
    let data = frame(H2_DATA, H2_END_STREAM, 1, &[7; 100]);
    let next = frame(H2_HEADERS, H2_END_HEADERS, 3, &[0x88]);
    // First send: the DATA frame's header and 40 bytes of its payload.
    let (ev, w) = run(std::vec![data[..49].to_vec()], 0, false);
    assert_eq!(ev.n_frames, 1);
    assert_eq!(ev.frames[0].head_len, 8);
    let end = w.end.expect("the walk ended");
    assert_eq!(end, 109);
    // Second send: the rest of it, then a HEADERS frame: the walk
    // starts past the carried bytes.
    let carry = end - 49;
    let mut second = data[49..].to_vec();
    second.extend_from_slice(&next);
    let (ev, w) = run(std::vec![second.clone()], carry, false);
    assert_eq!(ev.n_frames, 1);
    assert_eq!(
        (ev.frames[0].kind, ev.frames[0].stream, ev.frames[0].offset),
        (H2_HEADERS, 3, 60)
    );
    assert_eq!(ev.frames[0].head(), &[0x88]);
    assert_eq!(w.end, Some(second.len() as u32));
    // A send all inside a frame's payload: nothing walked.
    let (ev, w) = run(std::vec![std::vec![0; 10]], 50, false);
    assert_eq!((ev.n_frames, w.end), (0, Some(50)));
}

#[test]
fn iovec_pieces_and_continuation() {
    let headers = frame(H2_HEADERS, 0, 1, &[0x88, 1, 2]);
    let cont = frame(H2_CONTINUATION, H2_END_HEADERS, 1, &[3, 4]);
    let data = frame(H2_DATA, 0, 1, &[0, 0, 0, 0, 1, b'x']);
    // Header in one entry, payload in the next (as gRPC's core writes).
    let pieces = std::vec![
        headers.clone(),
        cont.clone(),
        data[..9].to_vec(),
        data[9..].to_vec(),
    ];
    let (ev, w) = run(pieces, 0, false);
    let kinds: Vec<_> = ev.frames().iter().map(|f| f.kind).collect();
    assert_eq!(kinds, [H2_HEADERS, H2_CONTINUATION, H2_DATA]);
    // The DATA payload's first bytes are in the next entry: read from it.
    assert_eq!(ev.frames[2].head(), &[0, 0, 0, 0, 1, b'x']);
    assert!(w.end.is_some());
}

/// nginx's shape: each frame header an entry of its own, the payload in
/// the next. The head is read from the next entry, however long it is,
/// never past the frame's payload or the call's end.
#[test]
fn a_header_alone_in_its_entry_has_its_head_from_the_next() {
    let headers = frame(
        H2_HEADERS,
        H2_END_HEADERS,
        1,
        &[0x20, 0x88, 0x40, 0x0c, 5, 6, 7, 8, 9],
    );
    let data = frame(H2_DATA, 0, 1, &[0, 0, 0, 0, 2, b'h', b'i']);
    let rst = frame(H2_RST_STREAM, 0, 3, &[0, 0, 0, 8]);
    let pieces = std::vec![
        headers[..9].to_vec(),
        headers[9..].to_vec(),
        data[..9].to_vec(),
        data[9..11].to_vec(),
        data[11..].to_vec(),
        rst[..9].to_vec(),
        rst[9..].to_vec(),
    ];
    let (ev, w) = run(pieces, 0, false);
    assert_eq!(ev.n_frames, 3);
    assert_eq!(ev.frames[0].head(), &[0x20, 0x88, 0x40, 0x0c, 5, 6, 7, 8]);
    // The next entry holds two of the payload's bytes: only those.
    assert_eq!(ev.frames[1].head(), &[0, 0]);
    assert_eq!(ev.frames[2].head(), &[0, 0, 0, 8]);
    assert!(w.end.is_some());
    // A call that ends with a header alone: nothing read past it.
    let (ev, _) = run(std::vec![data[..9].to_vec()], 0, false);
    assert_eq!((ev.n_frames, ev.frames[0].head_len), (1, 0));
}

#[test]
fn a_header_cut_by_the_call_is_kept() {
    let a = frame(H2_DATA, 0, 1, &[1; 4]);
    let b = frame(H2_DATA, 0, 3, &[1; 4]);
    let mut buf = a.clone();
    buf.extend_from_slice(&b[..5]);
    let mut ev = H2FramesEvent {
        t_ns: 70,
        ..H2FramesEvent::default()
    };
    let mut cut = CutHeader::default();
    let w = Walk {
        from: 0,
        total: buf.len() as u32,
        resync: false,
    };
    let walked = walk(&mut Pieces(std::vec![buf.clone()]), &w, &mut ev, &mut cut);
    assert_eq!(ev.n_frames, 1);
    // Every byte walked: the next call starts on the header's rest.
    assert_eq!(walked.end, Some(buf.len() as u32));
    assert_eq!((cut.len, &cut.bytes[..5], cut.t_ns), (5, &b[..5], 70));
    // Where resyncing, a cut first header cannot be checked: lost.
    let (_, w) = run(std::vec![b[..5].to_vec()], 0, true);
    assert_eq!(w.end, None);
}

#[test]
fn more_frames_than_an_event_holds_go_on_in_the_next() {
    // 200 frames (a client opening a hundred calls at once): twelve full
    // events sent, the last 8 frames in the walk's own, every frame once
    // and in order.
    let buf: Vec<u8> = (0..200u32)
        .flat_map(|i| frame(H2_WINDOW_UPDATE, 0, i, &[0, 0, 1, 0]))
        .collect();
    let (ev, w) = run(std::vec![buf.clone()], 0, false);
    assert_eq!(
        w,
        Walked {
            end: Some(buf.len() as u32),
            full: 12,
            frames_sent: 192
        }
    );
    assert_eq!((ev.n_frames, ev.flags), (8, H2_CONTINUED));
    assert_eq!(ev.frames()[0].stream, 192);
    assert_eq!(ev.frames()[0].offset, 192 * 13);
    // Past the walk's steps it loses its place.
    let one = frame(H2_WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]);
    let many: Vec<u8> = (0..H2_WALK_MAX).flat_map(|_| one.clone()).collect();
    assert_eq!(run(std::vec![many], 0, false).1.end, None);
}

#[test]
fn resync_needs_a_plausible_header() {
    let good = frame(H2_HEADERS, H2_END_HEADERS, 7, &[0x88]);
    assert!(run(std::vec![good], 0, true).1.end.is_some());
    // gRPC message bytes in the middle of a frame.
    assert_eq!(
        run(std::vec![std::vec![0, 0, 0, 0, 9, 1, 2, 3, 4, 5]], 0, true)
            .1
            .end,
        None
    );
    // The client preface is no frame.
    assert_eq!(run(std::vec![H2_PREFACE.to_vec()], 0, true).1.end, None);
}

#[test]
fn server_preface() {
    let settings = frame(H2_SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 100]);
    let h: [u8; 9] = settings[..9].try_into().expect("9 bytes");
    assert!(is_server_preface(&h));
    let ack = frame(H2_SETTINGS, H2_ACK, 0, &[]);
    assert!(!is_server_preface(&ack[..9].try_into().expect("9 bytes")));
    assert!(!is_server_preface(b"HTTP/1.1 "));
}

/// A connection adopted mid-life is known by a header alone: what a gRPC
/// server's or client's call starts with passes; HTTP/1.x, TLS records,
/// an oversized frame and undefined flags do not.
#[test]
fn adoptable_headers() {
    let h = |b: &[u8]| -> [u8; 9] { b[..9].try_into().expect("9 bytes") };
    for f in [
        frame(H2_HEADERS, H2_END_HEADERS, 13, &[0x88]),
        frame(H2_DATA, 0, 13, &[0, 0, 0, 0, 7]),
        frame(H2_HEADERS, H2_END_HEADERS | H2_END_STREAM, 13, &[0xbe]),
        frame(H2_WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]),
        frame(H2_PING, H2_ACK, 0, &[0; 8]),
        frame(H2_RST_STREAM, 0, 15, &[0, 0, 0, 8]),
        frame(H2_SETTINGS, H2_ACK, 0, &[]),
    ] {
        assert!(adoptable_header(&h(&f)), "{f:?}");
    }
    let mut big = frame(H2_DATA, 0, 1, &[]);
    big[..3].copy_from_slice(&[0, 0x40, 0x01]);
    let mut odd_flags = frame(H2_DATA, 0, 1, &[1]);
    odd_flags[4] = 0x04;
    for b in [
        &b"HTTP/1.1 200 OK"[..],
        b"POST /v1/completions",
        b"GET / HTTP/1.1\r\n",
        &[0x17, 0x03, 0x03, 0x01, 0x23, 0, 0, 0, 1],
        &[0x16, 0x03, 0x01, 0x00, 0xf4, 0x01, 0, 0, 0xf0],
        &big,
        &odd_flags,
    ] {
        assert!(!adoptable_header(&h(b)), "{b:?}");
    }
}

/// Looks at a connection adopted mid-life go on until one finds HTTP/2
/// or [`crate::CONN_ADOPT_LOOKS`] found none; one opened under tracing
/// is looked at once each way.
#[test]
fn midlife_connections_are_looked_at_a_bounded_number_of_times() {
    use crate::{
        CONN_ADOPT_LOOKS, CONN_MIDLIFE, CONN_RX_CHECKED, CONN_TX_CHECKED, conn::looked_at,
    };
    assert_eq!(looked_at(0, CONN_TX_CHECKED), CONN_TX_CHECKED);
    let mut flags = CONN_MIDLIFE;
    for i in 1..CONN_ADOPT_LOOKS {
        flags = looked_at(
            flags,
            if i % 2 == 0 {
                CONN_TX_CHECKED
            } else {
                CONN_RX_CHECKED
            },
        );
        assert_eq!(flags & (CONN_TX_CHECKED | CONN_RX_CHECKED), 0, "look {i}");
    }
    flags = looked_at(flags, CONN_TX_CHECKED);
    assert_eq!(
        flags & (CONN_TX_CHECKED | CONN_RX_CHECKED),
        CONN_TX_CHECKED | CONN_RX_CHECKED
    );
    assert_ne!(flags & CONN_MIDLIFE, 0);
}

#[test]
fn segments_in_order_out_of_order_and_retransmitted() {
    // Next header at 1000: a segment from 990 holds it at 10.
    let at_10 = RxPlan::Walk(Walk {
        from: 10,
        total: 100,
        resync: false,
    });
    assert_eq!(rx_plan(1000, true, 990, 100), at_10);
    // A retransmit of bytes walked, or one inside a frame's payload.
    assert_eq!(rx_plan(1000, true, 900, 100), RxPlan::Skip);
    // A segment past a gap.
    assert_eq!(rx_plan(1000, true, 1100, 100), RxPlan::Lost);
    // Across the sequence space's wrap.
    assert_eq!(rx_plan(5, true, u32::MAX - 4, 100), at_10);
    // Lost: the segment's start must read as a frame.
    let plan = rx_plan(0, false, 1100, 100);
    assert_eq!(
        plan,
        RxPlan::Walk(Walk {
            from: 0,
            total: 100,
            resync: true
        })
    );
}

/// A frame as the walk summarises it, wherever its header was cut.
type Summary = (u8, u8, u32, u32, Vec<u8>);

fn summaries(events: &[H2FramesEvent]) -> Vec<Summary> {
    events
        .iter()
        .flat_map(|ev| ev.frames().iter())
        .map(|f| (f.kind, f.flags, f.stream, f.len, f.head().to_vec()))
        .collect()
}

/// A server's sends as the kernel follows them (`on_send`): the bytes of
/// the frame in progress the next send starts with, whether the
/// direction knows its place, a cut header.
#[derive(Default)]
struct Sends {
    carry: u32,
    synced: bool,
    cut: CutHeader,
    events: Vec<H2FramesEvent>,
}

impl Sends {
    fn new() -> Self {
        Self {
            synced: true,
            ..Self::default()
        }
    }

    fn send(&mut self, t_ns: u64, bytes: &[u8]) {
        let w = Walk {
            from: if self.synced { self.carry } else { 0 },
            total: bytes.len() as u32,
            resync: !self.synced,
        };
        let (ev, end) = one_call(t_ns, 0, bytes, &w, &mut self.cut);
        match end {
            Some(end) => (self.carry, self.synced) = (end - w.total, true),
            None => self.synced = false,
        }
        self.events.push(ev);
    }
}

/// One call of a direction: its event and where its walk ended.
fn one_call(
    t_ns: u64,
    seq: u32,
    bytes: &[u8],
    w: &Walk,
    cut: &mut CutHeader,
) -> (H2FramesEvent, Option<u32>) {
    let mut ev = H2FramesEvent {
        t_ns,
        seq,
        ..H2FramesEvent::default()
    };
    let mut st = WalkState::default();
    let end = walk_call(
        &mut Pieces(std::vec![bytes.to_vec()]),
        w,
        cut,
        &mut st,
        &mut ev,
        &mut |_: &H2FramesEvent| panic!("one event's frames"),
    );
    (ev, end)
}

/// A client's data segments as the kernel follows them (`on_segment`).
#[derive(Default)]
struct Segments {
    next: u32,
    synced: bool,
    cut: CutHeader,
    events: Vec<H2FramesEvent>,
    skipped: u32,
}

impl Segments {
    fn at(next: u32) -> Self {
        Self {
            next,
            synced: true,
            ..Self::default()
        }
    }

    fn segment(&mut self, t_ns: u64, seq: u32, bytes: &[u8]) {
        let w = match rx_plan(self.next, self.synced, seq, bytes.len() as u32) {
            RxPlan::Skip => {
                self.skipped += 1;
                return;
            }
            RxPlan::Lost => {
                self.synced = false;
                return;
            }
            RxPlan::Walk(w) => w,
        };
        let (ev, end) = one_call(t_ns, seq, bytes, &w, &mut self.cut);
        match end {
            Some(end) => (self.next, self.synced) = (seq.wrapping_add(end), true),
            None => self.synced = false,
        }
        self.events.push(ev);
    }
}

/// A gRPC call's frames: request HEADERS (`:method: POST`), its message
/// with END_STREAM, then the next call's HEADERS on stream 3.
fn grpc_request() -> (Vec<u8>, [usize; 3]) {
    let mut b = frame(H2_HEADERS, H2_END_HEADERS, 1, &[0x83, 0x86, 0x44, 1, 2, 3]);
    let data_at = b.len();
    b.extend(frame(H2_DATA, H2_END_STREAM, 1, &[0, 0, 0, 0, 3, 9, 8, 7]));
    let next_at = b.len();
    b.extend(frame(H2_HEADERS, H2_END_HEADERS, 3, &[0x83, 0x86]));
    (b, [0, data_at, next_at])
}

/// The frames of `bytes` walked in one send.
fn whole_walk(bytes: &[u8]) -> Vec<Summary> {
    let mut s = Sends::new();
    s.send(1, bytes);
    summaries(&s.events)
}

#[test]
fn a_send_cut_in_any_frame_header_at_any_byte_is_walked_whole() {
    let (bytes, headers) = grpc_request();
    let whole = whole_walk(&bytes);
    assert_eq!(whole.len(), 3);
    for at in headers {
        for k in 1..H2_FRAME_HEADER as usize {
            let cut = at + k;
            let mut s = Sends::new();
            s.send(10, &bytes[..cut]);
            s.send(20, &bytes[cut..]);
            assert!(s.synced, "cut at {at}+{k}");
            assert_eq!(s.carry, 0, "cut at {at}+{k}");
            assert_eq!(summaries(&s.events), whole, "cut at {at}+{k}");
            // The completed frame: the second send's first, begun in the
            // first send.
            let f = s.events[1].frames[0];
            assert_eq!(f.offset, 0u32.wrapping_sub(k as u32), "cut at {at}+{k}");
            assert_eq!(s.events[1].t_cut_ns, 10);
            // Nothing in the first send's event past the cut.
            assert!(
                s.events[0]
                    .frames()
                    .iter()
                    .all(|f| (f.offset as usize) < at)
            );
            assert_eq!(s.events[0].t_cut_ns, 0);
        }
    }
}

#[test]
fn a_header_in_three_pieces_and_a_payload_split_too() {
    let (bytes, [_, data_at, next_at]) = grpc_request();
    let mut whole = whole_walk(&bytes);
    // The DATA frame's head: the payload bytes in its header's last call.
    whole[1].4.truncate(3);
    // The DATA frame's header in three sends (2, 3, then 4 bytes and 3
    // of its 8 payload bytes), the rest of its payload and 6 bytes of the
    // next header in a fourth, the rest in a fifth.
    let cuts = [data_at, data_at + 2, data_at + 5, data_at + 12, next_at + 6];
    let mut s = Sends::new();
    let mut from = 0;
    for (t, to) in cuts.iter().chain([&bytes.len()]).enumerate() {
        s.send(t as u64 * 10, &bytes[from..*to]);
        from = *to;
    }
    assert!(s.synced);
    assert_eq!(summaries(&s.events), whole);
    // The DATA frame completed in the fourth send, from the second's
    // time; the fifth send began inside its payload (5 carried bytes)
    // and ended inside the next header, completed in the sixth.
    assert_eq!(s.events[3].t_cut_ns, 10);
    assert_eq!(s.events[3].frames[0].offset, 0u32.wrapping_sub(5));
    assert_eq!((s.events[4].n_frames, s.events[5].t_cut_ns), (0, 40));
    // The same, walked a segment at a time by sequence number, from
    // near the wrap.
    let base = u32::MAX - 20;
    let mut r = Segments::at(base);
    let mut from = 0;
    for (t, to) in cuts.iter().chain([&bytes.len()]).enumerate() {
        r.segment(t as u64, base.wrapping_add(from as u32), &bytes[from..*to]);
        from = *to;
    }
    assert!(r.synced);
    assert_eq!(summaries(&r.events), whole);
}

#[test]
fn segments_cut_in_a_header_at_any_byte() {
    let (bytes, headers) = grpc_request();
    let whole = whole_walk(&bytes);
    for at in headers {
        for k in 1..H2_FRAME_HEADER as usize {
            let cut = at + k;
            let mut r = Segments::at(1000);
            r.segment(10, 1000, &bytes[..cut]);
            r.segment(20, 1000 + cut as u32, &bytes[cut..]);
            assert!(r.synced, "cut at {at}+{k}");
            assert_eq!(summaries(&r.events), whole, "cut at {at}+{k}");
            assert_eq!(r.events[1].t_cut_ns, 10, "cut at {at}+{k}");
            assert_eq!(r.next, 1000 + bytes.len() as u32);
        }
    }
}

#[test]
fn retransmits_around_a_cut_header() {
    let (bytes, [_, data_at, _]) = grpc_request();
    let whole = whole_walk(&bytes);
    let cut = data_at + 4;
    let seq = |at: usize| 5000 + at as u32;
    // The first segment twice (the second a retransmit of walked bytes),
    // then the rest.
    let mut r = Segments::at(seq(0));
    r.segment(10, seq(0), &bytes[..cut]);
    r.segment(11, seq(0), &bytes[..cut]);
    r.segment(20, seq(cut), &bytes[cut..]);
    assert_eq!(r.skipped, 1);
    assert_eq!(summaries(&r.events), whole);
    // A retransmit that carries the cut bytes again and the rest of the
    // header (the sender coalesced): completed from where the new bytes
    // begin, the header's first bytes from the first segment, the same.
    let mut r = Segments::at(seq(0));
    r.segment(10, seq(0), &bytes[..cut]);
    r.segment(20, seq(data_at), &bytes[data_at..]);
    assert_eq!(summaries(&r.events), whole);
    assert_eq!(r.events[1].t_cut_ns, 10);
    // A retransmit of part of the cut bytes only, then the rest.
    let mut r = Segments::at(seq(0));
    r.segment(10, seq(0), &bytes[..cut]);
    r.segment(11, seq(data_at + 1), &bytes[data_at + 1..cut]);
    r.segment(20, seq(cut), &bytes[cut..]);
    assert_eq!(r.skipped, 1);
    assert_eq!(summaries(&r.events), whole);
    // The rest of the header lost on the way (a gap): the place is lost,
    // and the cut bytes are never completed with later ones.
    let mut r = Segments::at(seq(0));
    r.segment(10, seq(0), &bytes[..cut]);
    r.segment(20, seq(cut + 3), &bytes[cut + 3..]);
    assert!(!r.synced);
    r.segment(
        30,
        seq(bytes.len()),
        &frame(H2_HEADERS, H2_END_HEADERS, 5, &[0x83]),
    );
    assert!(r.synced);
    let last = r.events.last().expect("an event");
    assert_eq!((last.t_cut_ns, last.flags, last.n_frames), (0, 0, 1));
    assert_eq!(r.cut.len, 0);
}
