//! The frame walk over byte slices, as the kernel runs it over a send's
//! buffer or a segment's payload.

extern crate std;
use std::vec::Vec;

use super::*;

/// A call's bytes as one slice, or cut into pieces (iovec entries: a
/// read stops at a piece's end, as the kernel's does).
struct Pieces(Vec<Vec<u8>>);

impl FrameBytes for Pieces {
    fn peek(&mut self, at: u32, dst: &mut [u8; H2_PEEK]) -> u32 {
        let mut start = 0;
        for p in &self.0 {
            let at = at as usize;
            if at >= start && at < start + p.len() {
                let from = &p[at - start..];
                let n = from.len().min(H2_PEEK);
                dst[..n].copy_from_slice(&from[..n]);
                return n as u32;
            }
            start += p.len();
        }
        0
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
    /// Frames past `H2_MAX_FRAMES`, walked but not summarised.
    pub dropped: u32,
}

/// Walks the frame headers of one call into `ev.frames` (setting
/// `n_frames`, and `H2_TRUNCATED` where frames were left out): the steps
/// of `walk_step` in a plain loop.
fn walk<B: FrameBytes>(src: &mut B, w: &Walk, ev: &mut H2FramesEvent) -> Walked {
    let mut st = WalkState {
        pos: w.from,
        dropped: 0,
    };
    for i in 0..=H2_WALK_MAX {
        if let Some(end) = walk_step(src, w, i, &mut st, ev) {
            return Walked {
                end,
                dropped: st.dropped,
            };
        }
    }
    Walked {
        end: None,
        dropped: st.dropped,
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
    let walked = walk(&mut Pieces(pieces), &w, &mut ev);
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
            dropped: 0
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
    // The DATA payload's first bytes are in another entry: not kept.
    assert_eq!(ev.frames[2].head_len, 0);
    assert!(w.end.is_some());
}

#[test]
fn a_header_cut_by_the_call_loses_the_place() {
    let a = frame(H2_DATA, 0, 1, &[1; 4]);
    let b = frame(H2_DATA, 0, 3, &[1; 4]);
    let mut buf = a.clone();
    buf.extend_from_slice(&b[..5]);
    let (ev, w) = run(std::vec![buf], 0, false);
    assert_eq!(ev.n_frames, 1);
    assert_eq!(w.end, None);
}

#[test]
fn more_frames_than_kept_are_counted_then_lost() {
    let one = frame(H2_WINDOW_UPDATE, 0, 0, &[0, 0, 1, 0]);
    let buf: Vec<u8> = (0..20).flat_map(|_| one.clone()).collect();
    let (ev, w) = run(std::vec![buf.clone()], 0, false);
    assert_eq!(ev.n_frames, H2_MAX_FRAMES as u32);
    assert_eq!(ev.flags, H2_TRUNCATED);
    assert_eq!(
        w,
        Walked {
            end: Some(buf.len() as u32),
            dropped: 4
        }
    );
    let many: Vec<u8> = (0..H2_WALK_MAX + 1).flat_map(|_| one.clone()).collect();
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
