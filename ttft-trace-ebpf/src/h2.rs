//! HTTP/2 frame walk on followed connections that speak it: per send (and
//! per data segment received at a cgroup's ingress), the 9-byte frame
//! headers are read in a bounded loop and summarised in [`H2FramesEvent`]s
//! (one per call, another each time one fills), so that userspace can tell
//! streams apart.
//!
//! A connection is marked HTTP/2 once, by its first bytes each way: the
//! server's first send a SETTINGS frame on stream 0 (its preface), or the
//! client's first data segment the connection preface `PRI * HTTP/2.0`.
//! One adopted mid-life (opened before tracing began: `tcp.rs`) shows
//! neither: it is marked by a call that starts with a frame header
//! (`adoptable_header`), looked for in up to `CONN_ADOPT_LOOKS` calls.
//! Every other followed connection pays one flag test per call after that
//! (and one 9- or 24-byte read on its first send and first data segment,
//! or its first few when adopted); the processes not traced pay nothing
//! (the callers stop them first).
//!
//! Each direction keeps its place in [`H2_CONNS`]: sends, how many bytes of
//! the frame in progress the next send starts with; receives, the sequence
//! number of the next byte to walk (a retransmit of bytes walked already,
//! or of the middle of a frame, is skipped). A frame header that a call's
//! end cuts (a client's frames cut at the MSS, a writer that writes a
//! header in pieces) is kept, up to 8 bytes with the time of its call
//! ([`CutHeader`]), and completed by the direction's next call. Where the
//! walk loses its place (a frame header split across iovec entries of one
//! send, more than [`H2_WALK_MAX`] frames in one call, a segment past a
//! gap) it is counted in `Stat::H2WalkLost`, and it resumes at the first
//! call that starts with a plausible frame header.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::__sk_buff,
    helpers::{bpf_get_current_pid_tgid, generated},
    macros::map,
    maps::PerCpuArray,
    programs::SkBuffContext,
};
use ttft_trace_common::{
    CONN_H2, CONN_MIDLIFE, CONN_RX_CHECKED, CONN_TX_CHECKED, ConnState, SendArgs, Stat,
    conn::looked_at,
    h2::{
        CutHeader, EVENT_H2, EVENT_H2_BLOCK, FrameBytes, H2_BLOCK_MAX, H2_CUT_READ, H2_FRAME_HEAD,
        H2_FRAME_HEADER, H2_FULL, H2_HEADERS, H2_LOST, H2_MAX_FRAMES, H2_PEEK, H2_PREFACE,
        H2_PREFACE_SEEN, H2_RECV, H2_RESYNCED, H2_RX_SYNC, H2_SEND, H2_TX_SYNC, H2_WALK_MAX,
        H2BlockEvent, H2FramesEvent, H2State, Resumed, RxPlan, Walk, WalkState, adoptable_header,
        full_event_sent, is_server_preface, keep_cut, resume_cut, rx_plan, walk_step,
    },
};

use crate::{
    maps::{CONNS, EVENTS, H2_CONNS, add_stat, bump_stat, wakeup_flag},
    mem::{now_ns, segment},
};

/// A walk in progress ([`Scratch`]), per CPU: one slot for sends (process
/// context), one for segments (softirq). Here rather than with the other
/// maps: only the walk uses it, and its type is the walk's own.
#[map]
static H2_SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(2, 0);

/// iovec entries of a send walked: gRPC's core writes a slice per frame
/// header and per message piece, up to 260 per `sendmsg`
/// (`MAX_WRITE_IOVEC`); a first write carrying SETTINGS, WINDOW_UPDATE,
/// HEADERS and DATA already took more than 8 (its first DATA was missed).
const SEGS: u32 = 256;
/// Entries the cursor moves past in one read at most: the loop's bound.
/// The cursor only moves forward, so a send's reads move it [`SEGS`]
/// entries at most in all.
const SEGS_PER_PEEK: u32 = 64;
/// The same bound for a cut header's read (its own callback, run at most
/// twice a call: where the call starts, from a fresh cursor, and at the
/// header its end cuts, a few entries past the walk's cursor). With
/// [`SEGS_PER_PEEK`] there, the send program's verification took 1.4 s
/// (0.13 s before the carry); a header further on is lost (counted).
const SEGS_PER_CUT: u32 = 8;

/// A send's user buffer (a plain buffer, or up to [`SEGS`] iovec entries),
/// from its first byte not reported already (`skip` in), with a cursor on
/// the entry last read: frames are read in order, so each entry is read
/// from the kernel's iovec array once per send.
#[derive(Clone, Copy)]
pub struct UserBytes {
    args: SendArgs,
    skip: u32,
    /// Bytes of the buffer the send covers (`skip` included).
    span: u32,
    cur: Cursor,
}

/// The iovec entry under a [`UserBytes`] cursor: its index, base, and
/// where it starts and ends in the buffer.
#[derive(Clone, Copy)]
pub struct Cursor {
    seg: u32,
    seg_start: u32,
    seg_end: u32,
    _pad: u32,
    base: u64,
}

impl UserBytes {
    /// The first `span` bytes of the send's buffer, of which the first
    /// `skip` were reported already.
    #[inline(always)]
    fn new(args: &SendArgs, skip: u32, span: u32) -> Self {
        let mut b = Self {
            args: *args,
            skip,
            span,
            cur: Cursor {
                seg: 0,
                seg_start: 0,
                seg_end: if args.buf != 0 { span } else { 0 },
                _pad: 0,
                base: args.buf,
            },
        };
        if args.buf == 0
            && let Some((base, len)) = segment(args, 0)
        {
            b.cur.base = base;
            b.cur.seg_end = len.min(u64::from(span)) as u32;
        }
        b
    }
}

impl UserBytes {
    /// Moves the cursor to the entry that holds byte `at` (from the
    /// buffer's first byte not reported), past `ENTRIES` entries at most:
    /// its user address, and how many bytes the entry has from there
    /// (`None`: past the end, further on, or an entry not readable).
    #[inline(always)]
    fn locate<const ENTRIES: u32>(&mut self, at: u32) -> Option<(u64, u32)> {
        let at = at.saturating_add(self.skip);
        let c = &mut self.cur;
        for _ in 0..ENTRIES {
            if at < c.seg_start {
                return None;
            }
            if at < c.seg_end {
                break;
            }
            // Past the entry: on to the next (a plain buffer has no next).
            let next = c.seg + 1;
            if self.args.buf != 0 || next >= SEGS {
                return None;
            }
            let (base, len) = segment(&self.args, u64::from(next))?;
            c.seg = next;
            c.base = base;
            c.seg_start = c.seg_end;
            let room = self.span.saturating_sub(c.seg_start);
            c.seg_end = c.seg_start + len.min(u64::from(room)) as u32;
        }
        if at < c.seg_start || at >= c.seg_end {
            return None;
        }
        Some((c.base + u64::from(at - c.seg_start), c.seg_end - at))
    }
}

impl FrameBytes for UserBytes {
    #[inline(always)]
    fn small(&mut self, at: u32, dst: &mut [u8; H2_CUT_READ]) -> u32 {
        let Some((src, valid)) = self.locate::<SEGS_PER_CUT>(at) else {
            return 0;
        };
        let n = bounded_small(valid);
        // SAFETY: n <= H2_CUT_READ = dst.len(); the helper checks the user
        // address.
        let rc =
            unsafe { generated::bpf_probe_read_user(dst.as_mut_ptr().cast(), n, src as *const _) };
        if rc == 0 { n } else { 0 }
    }

    #[inline(always)]
    fn peek(&mut self, at: u32, dst: &mut [u8; H2_PEEK]) -> u32 {
        let Some((src, valid)) = self.locate::<SEGS_PER_PEEK>(at) else {
            return 0;
        };
        let valid = valid.min(H2_PEEK as u32);
        read_fixed(dst, PEEK_SIZES, |to, n| {
            // SAFETY: n <= H2_PEEK = to.len(); the helper checks the user
            // address.
            unsafe { generated::bpf_probe_read_user(to.cast(), n, src as *const _) }
        })
        .min(valid)
    }

    #[inline(always)]
    fn head(&mut self, at: u32, dst: &mut [u8; H2_FRAME_HEAD]) -> u32 {
        // The next entry: the one `peek` read ended at `at`.
        let Some((src, valid)) = self.locate::<1>(at) else {
            return 0;
        };
        read_fixed(dst, HEAD_SIZES, |to, n| {
            // SAFETY: n <= H2_FRAME_HEAD = to.len(); the helper checks the
            // user address.
            unsafe { generated::bpf_probe_read_user(to.cast(), n, src as *const _) }
        })
        .min(valid)
    }
}

/// A data segment's payload at a cgroup's ingress.
struct SkbBytes {
    skb: *mut __sk_buff,
    payload_at: u32,
    len: u32,
}

impl FrameBytes for SkbBytes {
    #[inline(always)]
    fn small(&mut self, at: u32, dst: &mut [u8; H2_CUT_READ]) -> u32 {
        if at >= self.len {
            return 0;
        }
        let n = bounded_small(self.len - at);
        // SAFETY: 0 < n <= H2_CUT_READ = dst.len(); the helper checks the
        // offset against the packet.
        let rc = unsafe {
            generated::bpf_skb_load_bytes(
                self.skb.cast(),
                self.payload_at + at,
                dst.as_mut_ptr().cast(),
                n,
            )
        };
        if rc == 0 { n } else { 0 }
    }

    #[inline(always)]
    fn peek(&mut self, at: u32, dst: &mut [u8; H2_PEEK]) -> u32 {
        if at >= self.len {
            return 0;
        }
        let (skb, offset) = (self.skb, self.payload_at + at);
        let valid = self.len - at;
        read_fixed(dst, PEEK_SIZES, |to, n| {
            // SAFETY: n <= H2_PEEK = to.len(); the helper checks the
            // offset against the packet.
            unsafe { generated::bpf_skb_load_bytes(skb.cast(), offset, to.cast(), n) }
        })
        .min(valid)
    }

    /// A payload is contiguous: `peek` stops at a header's end only at
    /// the payload's.
    #[inline(always)]
    fn head(&mut self, _at: u32, _dst: &mut [u8; H2_FRAME_HEAD]) -> u32 {
        0
    }
}

/// `n` (1 to [`H2_CUT_READ`]; more is cut to it) as a size the verifier
/// sees bounded: a mask and an add it tracks through, where a compared
/// copy of the register would lose the bound. Only where a call's cut
/// header is worked on, once, in its own callback: never in the walk's
/// steps (see [`read_fixed`]).
#[inline(always)]
fn bounded_small(n: u32) -> u32 {
    const _: () = assert!(H2_CUT_READ.is_power_of_two());
    ((n.min(H2_CUT_READ as u32).wrapping_sub(1)) & (H2_CUT_READ as u32 - 1)) + 1
}

/// A peek's sizes, longest first: a frame header and its payload's first
/// bytes (a status, a RST_STREAM's error code), or the header alone.
const PEEK_SIZES: [u32; 3] = [H2_PEEK as u32, H2_FRAME_HEADER + 4, H2_FRAME_HEADER];
/// A payload head's sizes, read on its own ([`FrameBytes::head`]).
const HEAD_SIZES: [u32; 3] = [H2_FRAME_HEAD as u32, 4, 1];

/// Reads `sizes[0]` bytes with `read(dst, size)`, or the next size where
/// that fails (the end of the packet, or of the user's mapping). How many
/// were read (0: none). Sizes are constants, never computed from the
/// walk's position: a size the helper must bound would make the verifier
/// tell every step's position apart, and the `bpf_loop` body would never
/// converge.
#[inline(always)]
fn read_fixed<const N: usize>(
    dst: &mut [u8; N],
    sizes: [u32; 3],
    read: impl Fn(*mut u8, u32) -> i64,
) -> u32 {
    for n in sizes {
        if n as usize <= N && read(dst.as_mut_ptr(), n) == 0 {
            return n;
        }
    }
    0
}

/// A walk in progress: its event and its place, in a per-CPU map value
/// rather than on the stack. The verifier checks a `bpf_loop` body again
/// and again until the state it starts from repeats; a map value's
/// contents are unknown to it, so the body's state repeats at once (the
/// walk's position, on the stack, differs at every step, and the body was
/// checked until the program's budget ran out).
#[repr(C)]
pub struct Scratch {
    ev: H2FramesEvent,
    w: Walk,
    st: WalkState,
    /// Sends: the buffer.
    user: UserBytes,
    /// 0 while walking, then 1 + the end ([`ENDED`]) or [`LOST`].
    end: u64,
    /// The direction's cut header, copied in and out of its `H2State`.
    cut: CutHeader,
    /// What [`cut_send`] / [`cut_segment`] do: [`CUT_RESUME`], or keep
    /// the bytes from this offset to the call's end.
    cut_op: u32,
    /// How it went: [`Resumed`] as [`RESUMED_STILL_CUT`] and so on, or 1
    /// where the bytes were kept.
    cut_res: u32,
    /// Non-zero while a walk runs in this slot: a program preempted in the
    /// middle of one (process context) is not overwritten by another on
    /// the same CPU, which gives up instead.
    busy: u32,
    _pad: u32,
    /// Sends: the buffer as the walk began (the blocks are read from it
    /// after the walk), the HEADERS frames listed, how many more, the
    /// block being sent and the connection's count of them
    /// ([`H2State::tx_blocks`]).
    user0: UserBytes,
    heads: [Head; HEADS],
    n_heads: u32,
    heads_over: u32,
    blocks: u32,
    _pad2: u32,
    cap: Capture,
    block: H2BlockEvent,
}

/// [`Scratch::cut_op`]: complete the cut header with the call's first
/// bytes ([`resume_cut`]); any other value keeps the bytes from there
/// ([`keep_cut`]).
const CUT_RESUME: u32 = u32::MAX;
const RESUMED_STILL_CUT: u32 = 1;
const RESUMED_WALK: u32 = 2;
const RESUMED_LOST: u32 = 3;

/// [`H2_SCRATCH`] slots: sends run in process context, segments in
/// softirq, which may interrupt a send's walk on the same CPU.
const SLOT_SEND: u32 = 0;
const SLOT_SEGMENT: u32 = 1;

const LOST: u64 = u64::MAX;
const ENDED: u64 = 1;

/// What the steps of a segment's walk share: the packet (a context
/// pointer, which a map value cannot hold).
struct SegmentLoop {
    skb: *mut __sk_buff,
    payload_at: u32,
    len: u32,
}

/// Records how step `i`'s walk went; 1 stops the loop. An event that
/// filled is sent now (its frames counted as dropped where the ring buffer
/// is full), and the walk goes on in a fresh one.
#[inline(always)]
fn stepped(sc: &mut Scratch, end: Option<Option<u32>>) -> i64 {
    match end {
        None => {
            if sc.ev.flags & H2_FULL != 0 {
                sc.ev.flags &= !H2_FULL;
                if EVENTS
                    .output::<H2FramesEvent>(&sc.ev, wakeup_flag())
                    .is_err()
                {
                    bump_stat(Stat::RingbufLost);
                    add_stat(Stat::H2FramesDropped, u64::from(sc.ev.n_frames));
                }
                full_event_sent(&mut sc.ev);
            }
            0
        }
        Some(end) => {
            sc.end = end.map_or(LOST, |e| ENDED + u64::from(e));
            1
        }
    }
}

/// One step of a send's walk (`bpf_loop`'s callback).
extern "C" fn step_send(i: u64, _ctx: *mut c_void) -> i64 {
    let Some(sc) = H2_SCRATCH.get_ptr_mut(SLOT_SEND) else {
        return 1;
    };
    // SAFETY: this CPU's slot, held by the walk (`busy`).
    let sc = unsafe { &mut *sc };
    let listed = sc.ev.n_frames;
    let end = walk_step(&mut sc.user, &sc.w, i as u32, &mut sc.st, &mut sc.ev);
    if end.is_none() && sc.ev.n_frames != listed {
        note_head(sc, listed);
    }
    stepped(sc, end)
}

/// HEADERS frames of a send whose blocks are sent ([`capture_step`]);
/// one more listed is counted in the connection's block count only, a gap
/// that stops userspace's decoder.
const HEADS: usize = 4;

/// A HEADERS frame listed in a send: where its block starts in the call.
#[derive(Clone, Copy)]
pub struct Head {
    offset: u32,
    len: u32,
    stream: u32,
    flags: u32,
}

/// The frame listed at `k`, where it is a HEADERS frame, noted for the
/// capture after the walk: a store here, so that the step the verifier
/// checks stays as it was (a read of the block in the step made the send
/// program's verification 4.8 s, over the stack limit).
#[inline(always)]
fn note_head(sc: &mut Scratch, k: u32) {
    let k = k as usize;
    if k >= H2_MAX_FRAMES {
        return;
    }
    let f = &sc.ev.frames[k];
    if f.kind != H2_HEADERS {
        return;
    }
    let head = Head {
        offset: f.offset,
        len: f.len,
        stream: f.stream,
        flags: u32::from(f.flags),
    };
    // SAFETY: a read of a field (bounded below on the register read).
    let n = unsafe { core::ptr::read_volatile(&sc.n_heads) } as usize;
    if n < HEADS {
        sc.heads[n] = head;
        sc.n_heads = n as u32 + 1;
    } else {
        sc.heads_over = sc.heads_over.wrapping_add(1);
    }
}

/// iovec entries a header block is gathered from: gRPC's core writes
/// each HPACK field, and each literal of it, in a slice of its own.
const BLOCK_ENTRIES: u32 = 32;
/// The capture's steps at most: each noted frame's entries, one more each
/// to send its block, and the moves over the entries between (one entry a
/// step, up to [`SEGS`] in all).
const CAPTURE_STEPS: u32 = HEADS as u32 * (BLOCK_ENTRIES + 1) + SEGS;

/// One step of sending the noted HEADERS frames' blocks
/// ([`H2BlockEvent`]), after the walk (`bpf_loop`'s callback): reads one
/// iovec entry's part of the current block from the send's buffer afresh
/// (`user0`, its cursor only moving forward), or, the block gathered (up
/// to [`H2_BLOCK_MAX`] bytes, [`BLOCK_ENTRIES`] entries) or an entry not
/// readable, sends it and moves to the next frame. One entry a step, so
/// that the verifier checks one read, not a loop of them.
extern "C" fn capture_step(_i: u64, _ctx: *mut c_void) -> i64 {
    let Some(sc) = H2_SCRATCH.get_ptr_mut(SLOT_SEND) else {
        return 1;
    };
    // SAFETY: this CPU's slot, held by the walk (`busy`).
    let sc = unsafe { &mut *sc };
    let k = sc.cap.head as usize;
    if k >= HEADS || k >= sc.n_heads as usize {
        return 1;
    }
    let h = sc.heads[k];
    if sc.cap.begun == 0 {
        let b = &mut sc.block;
        b.kind = EVENT_H2_BLOCK;
        b.stream = h.stream;
        b.sk = sc.ev.sk;
        b.t_ns = sc.ev.t_ns;
        b.offset = h.offset;
        b.len = h.len;
        b.flags = h.flags as u8;
        b._pad = [0; 7];
        b.index = sc.blocks;
        sc.blocks = sc.blocks.wrapping_add(1);
        // A header begun in an earlier call has an offset below the
        // call's start (it wraps): its payload still starts in this one.
        let at = h.offset.wrapping_add(H2_FRAME_HEADER);
        sc.cap = Capture {
            head: k as u32,
            begun: 1,
            at,
            fill: 0,
            want: if at < sc.w.total {
                h.len.min(H2_BLOCK_MAX as u32).min(sc.w.total - at)
            } else {
                0
            },
            entries: 0,
            reached: 0,
            _pad: 0,
        };
    }
    let c = sc.cap;
    let mut done = c.fill >= c.want || c.entries >= BLOCK_ENTRIES;
    if !done {
        done = true;
        // One entry further a step at most (a short loop for the verifier
        // to follow): an entry not reached yet is moved to, and the next
        // step goes on from there.
        let found = sc.user0.locate::<1>(c.at);
        let cur = sc.user0.cur;
        if found.is_none() && cur.seg_end <= c.at.saturating_add(sc.user0.skip) {
            if cur.seg_end > c.reached {
                sc.cap.reached = cur.seg_end;
                done = false;
            }
        } else if let Some((from, valid)) = found {
            const MASK: u32 = H2_BLOCK_MAX as u32 - 1;
            const _: () = assert!(H2_BLOCK_MAX.is_power_of_two());
            let n = valid.min(c.want - c.fill).min(MASK);
            // Masked on values read back from memory: the compiler drops
            // a mask it can prove idle, and the verifier, which lost that
            // bound, then sees writes past the buffer.
            // SAFETY: reads of locals.
            let (to, n) = unsafe {
                (
                    core::ptr::read_volatile(&c.fill) & MASK,
                    core::ptr::read_volatile(&n) & MASK,
                )
            };
            // SAFETY: to and n <= 127 inside the 256-byte buffer; the
            // helper checks the user address.
            let rc = unsafe {
                generated::bpf_probe_read_user(
                    sc.block.bytes.as_mut_ptr().add(to as usize).cast(),
                    n,
                    from as *const _,
                )
            };
            if rc == 0 && n > 0 {
                sc.cap.fill = c.fill + n;
                sc.cap.at = c.at + n;
                sc.cap.entries = c.entries + 1;
                done = false;
            }
        }
    }
    if done {
        sc.block.captured = sc.cap.fill.min(sc.cap.want);
        if EVENTS
            .output::<H2BlockEvent>(&sc.block, wakeup_flag())
            .is_err()
        {
            bump_stat(Stat::RingbufLost);
        }
        sc.cap = Capture {
            head: k as u32 + 1,
            ..Capture::default()
        };
    }
    0
}

/// Where [`capture_step`] is: the noted frame, whether its block was
/// begun, the next byte to read (in the call), bytes gathered of those
/// wanted, entries read, and the end of the last entry moved to (the
/// cursor moving on, not stuck).
#[derive(Clone, Copy, Default)]
pub struct Capture {
    head: u32,
    begun: u32,
    at: u32,
    fill: u32,
    want: u32,
    entries: u32,
    reached: u32,
    _pad: u32,
}

/// A segment's callback's packet and scratch slot: `ctx` is the caller's
/// [`SegmentLoop`].
#[inline(always)]
fn segment_slot(ctx: *mut c_void) -> Option<(SkbBytes, &'static mut Scratch)> {
    let sc = H2_SCRATCH.get_ptr_mut(SLOT_SEGMENT)?;
    // SAFETY: ctx is the caller's `SegmentLoop`, alive for the loop; the
    // slot is this CPU's, held by the walk.
    let (l, sc) = unsafe { (&*ctx.cast::<SegmentLoop>(), &mut *sc) };
    let src = SkbBytes {
        skb: l.skb,
        payload_at: l.payload_at,
        len: l.len,
    };
    Some((src, sc))
}

/// One step of a segment's walk (`bpf_loop`'s callback).
extern "C" fn step_segment(i: u64, ctx: *mut c_void) -> i64 {
    let Some((mut src, sc)) = segment_slot(ctx) else {
        return 1;
    };
    let end = walk_step(&mut src, &sc.w, i as u32, &mut sc.st, &mut sc.ev);
    stepped(sc, end)
}

/// The work on a cut header ([`Scratch::cut_op`]) over the call's bytes
/// `src`: the scratch's other fields (`src` may be one of them, its
/// cursor then in the map value like the steps': a copy on the stack
/// would have the verifier follow each iovec entry's read).
#[inline(always)]
fn cut_work<B: FrameBytes>(
    src: &mut B,
    cut: &mut CutHeader,
    op: u32,
    w: &Walk,
    st: &mut WalkState,
    ev: &mut H2FramesEvent,
) -> u32 {
    if op == CUT_RESUME {
        match resume_cut(src, cut, w.from, w.total, ev) {
            Resumed::StillCut => RESUMED_STILL_CUT,
            Resumed::Walk(at) => {
                st.pos = at;
                RESUMED_WALK
            }
            Resumed::Lost => RESUMED_LOST,
        }
    } else {
        u32::from(keep_cut(src, op, w.total, ev.t_ns, cut))
    }
}

/// The cut header's work for a send (`bpf_loop`'s callback, run once):
/// its byte reads are checked once here, not on every path of the
/// program around it (the segment program's verification never ended
/// with them inline).
extern "C" fn cut_send(_i: u64, _ctx: *mut c_void) -> i64 {
    let Some(sc) = H2_SCRATCH.get_ptr_mut(SLOT_SEND) else {
        return 1;
    };
    // SAFETY: this CPU's slot, held by the walk (`busy`).
    let sc = unsafe { &mut *sc };
    let Scratch {
        ev,
        w,
        st,
        user,
        cut,
        cut_op,
        cut_res,
        ..
    } = sc;
    *cut_res = cut_work(user, cut, *cut_op, w, st, ev);
    1
}

/// The cut header's work for a segment (`bpf_loop`'s callback, run once).
extern "C" fn cut_segment(_i: u64, ctx: *mut c_void) -> i64 {
    let Some((mut src, sc)) = segment_slot(ctx) else {
        return 1;
    };
    let Scratch {
        ev,
        w,
        st,
        cut,
        cut_op,
        cut_res,
        ..
    } = sc;
    *cut_res = cut_work(&mut src, cut, *cut_op, w, st, ev);
    1
}

/// The event's fixed part: which call, where it starts.
struct Call {
    dir: u32,
    sk: u64,
    seq: u32,
    carry_in: u32,
    flags: u32,
}

/// Walks one call as `ttft_trace_common::h2::walk_call` does (its steps
/// under `bpf_loop`): completes the direction's cut header first, keeps
/// one that the call's end cuts in the direction's `H2State` (`h2`, in
/// [`H2_CONNS`]), and sends its event where it has frames or news;
/// returns where the walk ended, at or past `w.total` (`None`: lost).
/// `user` is the send's buffer (`None`: a segment, `seg` its packet).
#[inline(always)]
fn walk_and_report(
    call: &Call,
    w: Walk,
    user: Option<&UserBytes>,
    seg: &SegmentLoop,
    h2: *mut H2State,
) -> Option<u32> {
    // SAFETY: a live map value.
    let cut = unsafe {
        if user.is_some() {
            &raw mut (*h2).tx_cut
        } else {
            &raw mut (*h2).rx_cut
        }
    };
    if w.resync {
        // SAFETY: a live map value (the connection's H2State).
        unsafe { (*cut).len = 0 };
    }
    // SAFETY: as above.
    if w.from >= w.total && call.flags == 0 && unsafe { (*cut).len } == 0 {
        // All inside the frame in progress: nothing to tell.
        return Some(w.from);
    }
    let slot = if user.is_some() {
        SLOT_SEND
    } else {
        SLOT_SEGMENT
    };
    let sc = H2_SCRATCH.get_ptr_mut(slot)?;
    // SAFETY: this CPU's slot; `busy` keeps a preempted walk's.
    let sc = unsafe { &mut *sc };
    if sc.busy != 0 {
        bump_stat(Stat::H2WalkLost);
        return None;
    }
    sc.busy = 1;
    let id = bpf_get_current_pid_tgid();
    let send = call.dir == H2_SEND;
    let ev = &mut sc.ev;
    ev.kind = EVENT_H2;
    ev.dir = call.dir;
    ev.tgid = if send { (id >> 32) as u32 } else { 0 };
    ev.tid = if send { id as u32 } else { 0 };
    ev.sk = call.sk;
    ev.t_ns = now_ns();
    ev.seq = call.seq;
    ev.bytes = w.total;
    ev.carry_in = call.carry_in;
    ev.n_frames = 0;
    ev.flags = call.flags;
    ev._pad = 0;
    ev.t_cut_ns = 0;
    sc.w = w;
    sc.st = WalkState { pos: w.from };
    sc.end = 0;
    // SAFETY: as above.
    sc.cut = unsafe { *cut };
    type Callback = extern "C" fn(u64, *mut c_void) -> i64;
    let (callback, on_cut, ctx): (Callback, Callback, *const SegmentLoop) = match user {
        Some(user) => {
            sc.user = *user;
            sc.user0 = *user;
            // SAFETY: as above.
            sc.blocks = unsafe { (*h2).tx_blocks };
            sc.n_heads = 0;
            sc.heads_over = 0;
            sc.cap = Capture::default();
            (step_send, cut_send, core::ptr::null())
        }
        None => (step_segment, cut_segment, seg as *const SegmentLoop),
    };
    if sc.cut.len != 0 {
        sc.cut_op = CUT_RESUME;
        sc.cut_res = 0;
        // SAFETY: as for the walk's loop below.
        unsafe { generated::bpf_loop(1, on_cut as *mut c_void, ctx as *mut c_void, 0) };
        match sc.cut_res {
            RESUMED_STILL_CUT => sc.end = ENDED + u64::from(w.total.max(w.from)),
            RESUMED_WALK => {
                // The frame the cut header began: a HEADERS frame's block
                // starts in this call.
                if user.is_some() && sc.ev.n_frames == 1 {
                    note_head(sc, 0);
                }
            }
            _ => sc.end = LOST,
        }
    }
    if sc.end == 0 {
        // SAFETY: the callback and its context as the helper wants them;
        // the context outlives the call.
        unsafe {
            generated::bpf_loop(
                H2_WALK_MAX + 1,
                callback as *mut c_void,
                ctx as *mut c_void,
                0,
            );
        }
    }
    let end = match sc.end {
        0 | LOST => None,
        e => Some((e - ENDED) as u32),
    };
    // A header cut by the call's end: its bytes kept for the next call.
    let end = match end {
        Some(e) if e < w.total => {
            sc.cut_op = e;
            sc.cut_res = 0;
            // SAFETY: as above.
            unsafe { generated::bpf_loop(1, on_cut as *mut c_void, ctx as *mut c_void, 0) };
            (sc.cut_res == 1).then_some(w.total)
        }
        e => e,
    };
    if end.is_none() {
        sc.cut.len = 0;
    }
    if user.is_some() {
        if sc.n_heads != 0 {
            // SAFETY: as for the walk's loop.
            unsafe {
                generated::bpf_loop(
                    CAPTURE_STEPS,
                    capture_step as *mut c_void,
                    core::ptr::null_mut(),
                    0,
                )
            };
        }
        sc.blocks = sc.blocks.wrapping_add(sc.heads_over);
    }
    // SAFETY: as above.
    unsafe { *cut = sc.cut };
    if end.is_none() {
        sc.ev.flags |= H2_LOST;
        bump_stat(Stat::H2WalkLost);
    }
    if (sc.ev.n_frames != 0 || sc.ev.flags != 0)
        && EVENTS
            .output::<H2FramesEvent>(&sc.ev, wakeup_flag())
            .is_err()
    {
        bump_stat(Stat::RingbufLost);
    }
    if user.is_some() {
        // SAFETY: as above.
        unsafe { (*h2).tx_blocks = sc.blocks };
    }
    sc.busy = 0;
    end
}

/// The walk state of `sk`: `new` where the connection has none yet. An
/// entry left by an earlier connection at the same socket address (its
/// close missed) is replaced, never continued; one the LRU evicted
/// mid-connection comes back unsynced (its place is lost: the walk waits
/// for a call that starts on a plausible header).
#[inline(always)]
fn h2_state(sk: u64, state: *mut ConnState, new: H2State) -> Option<*mut H2State> {
    // SAFETY: live map value.
    let walked = unsafe { (*state).h2 } & CONN_H2 != 0;
    let new = if walked {
        if let Some(p) = H2_CONNS.get_ptr_mut(sk) {
            return Some(p);
        }
        H2State::default()
    } else {
        new
    };
    H2_CONNS.insert(sk, new, 0).ok()?;
    // SAFETY: live map value.
    unsafe { (*state).h2 |= CONN_H2 };
    H2_CONNS.get_ptr_mut(sk)
}

/// The bytes of a send to walk: `new` bytes not reported before, which
/// follow `skip` bytes at its buffer's start that were; `seq` is the
/// sequence number of its first new byte (0 where unknown: the syscall
/// hook).
#[derive(Clone, Copy)]
pub(crate) struct SendRange {
    pub skip: u32,
    pub new: u32,
    pub seq: u32,
}

/// A send on followed connection `sk` (see [`SendRange`]).
///
/// A function of its own (a BPF subprogram), not inlined: the verifier
/// then checks it from the few states the send's report leaves, not
/// behind each of that report's paths.
#[inline(never)]
pub(crate) fn on_send(sk: u64, state: *mut ConnState, args: &SendArgs, range: &SendRange) {
    let SendRange { skip, new, seq } = *range;
    // SAFETY: live map value.
    let flags = unsafe { (*state).h2 };
    if flags & (CONN_H2 | CONN_TX_CHECKED) == CONN_TX_CHECKED {
        return;
    }
    let src = UserBytes::new(args, skip, skip.saturating_add(new));
    // Where the connection was adopted mid-life, its walk starts as one
    // resumed: from this call's first header, however plausible.
    let mut sync = H2_TX_SYNC;
    if flags & CONN_TX_CHECKED == 0 {
        if flags & CONN_H2 == 0 {
            let header = first_header(&src);
            let adopted = flags & CONN_MIDLIFE != 0 && header.is_some_and(|h| adoptable_header(&h));
            if adopted {
                sync = 0;
            } else if !header.is_some_and(|h| is_server_preface(&h)) {
                // SAFETY: as above.
                unsafe { (*state).h2 = looked_at(flags, CONN_TX_CHECKED) };
                return;
            }
        }
        // SAFETY: as above.
        unsafe { (*state).h2 |= CONN_TX_CHECKED };
    }
    let fresh = H2State {
        sync,
        ..H2State::default()
    };
    let Some(h2) = h2_state(sk, state, fresh) else {
        return;
    };
    // SAFETY: live map value.
    let (carry, synced) = unsafe { ((*h2).tx_carry, (*h2).sync & H2_TX_SYNC != 0) };
    let carry = if synced { carry } else { 0 };
    let w = Walk {
        from: carry,
        total: new,
        resync: !synced,
    };
    let flags = if synced { 0 } else { H2_RESYNCED };
    let call = Call {
        dir: H2_SEND,
        sk,
        seq,
        carry_in: carry,
        flags,
    };
    let none = SegmentLoop {
        skb: core::ptr::null_mut(),
        payload_at: 0,
        len: 0,
    };
    let end = walk_and_report(&call, w, Some(&src), &none, h2);
    // SAFETY: as above.
    unsafe {
        match end {
            Some(end) => {
                (*h2).tx_carry = end - new;
                (*h2).sync |= H2_TX_SYNC;
            }
            None => (*h2).sync &= !H2_TX_SYNC,
        }
    }
}

/// The send's first 9 bytes, to tell the server's preface (or, on a
/// connection adopted mid-life, a frame header). Read from the first entry
/// only (no walk along the iovec array here, where every send of every
/// followed connection passes once: the verifier explores this path behind
/// every path of the send's own report).
#[inline(always)]
fn first_header(src: &UserBytes) -> Option<[u8; 9]> {
    if src.skip != 0 || src.cur.seg_end < H2_FRAME_HEADER {
        return None;
    }
    let mut header = [0u8; 9];
    // SAFETY: the helper checks the user address.
    let rc = unsafe {
        generated::bpf_probe_read_user(
            header.as_mut_ptr().cast(),
            H2_FRAME_HEADER,
            src.cur.base as *const _,
        )
    };
    (rc == 0).then_some(header)
}

/// A data segment of `len` payload bytes at `payload_at` in the packet,
/// starting at sequence number `seq`, on followed connection `sk`.
#[inline(always)]
pub(crate) fn on_segment(ctx: &SkBuffContext, sk: u64, payload_at: u32, len: u32, seq: u32) {
    let Some(state) = CONNS.get_ptr_mut(sk) else {
        return;
    };
    // SAFETY: live map value.
    let flags = unsafe { (*state).h2 };
    if flags & (CONN_H2 | CONN_RX_CHECKED) == CONN_RX_CHECKED {
        return;
    }
    let src = SegmentLoop {
        skb: ctx.skb.skb,
        payload_at,
        len,
    };
    let mut start = None;
    let mut ev_flags = 0;
    if flags & CONN_RX_CHECKED == 0 {
        // Also where the server's preface came first: the walk starts
        // after the client's.
        if ctx.load::<[u8; 24]>(payload_at as usize).ok() == Some(*H2_PREFACE) {
            start = Some(seq.wrapping_add(H2_PREFACE.len() as u32));
            ev_flags = H2_PREFACE_SEEN;
        } else if flags & CONN_H2 == 0
            && !(flags & CONN_MIDLIFE != 0
                && ctx
                    .load::<[u8; 9]>(payload_at as usize)
                    .is_ok_and(|h| adoptable_header(&h)))
        {
            // SAFETY: as above.
            unsafe { (*state).h2 = looked_at(flags, CONN_RX_CHECKED) };
            return;
        }
        // SAFETY: as above.
        unsafe { (*state).h2 |= CONN_RX_CHECKED };
    }
    // Before the server's first send, its side starts on a frame (not on
    // a connection adopted mid-life: its walk starts as one resumed).
    let tx = if flags & (CONN_TX_CHECKED | CONN_MIDLIFE) == 0 {
        H2_TX_SYNC
    } else {
        0
    };
    let new = H2State {
        sync: tx | if start.is_some() { H2_RX_SYNC } else { 0 },
        rx_next: start.unwrap_or(seq),
        ..H2State::default()
    };
    let Some(h2) = h2_state(sk, state, new) else {
        return;
    };
    // SAFETY: live map value.
    let (next, synced) = unsafe { ((*h2).rx_next, (*h2).sync & H2_RX_SYNC != 0) };
    let (next, synced) = match start {
        Some(at) => (at, true),
        None => (next, synced),
    };
    let w = match rx_plan(next, synced, seq, len) {
        RxPlan::Skip => return,
        RxPlan::Lost => {
            // SAFETY: as above.
            unsafe { (*h2).sync &= !H2_RX_SYNC };
            bump_stat(Stat::H2WalkLost);
            return;
        }
        RxPlan::Walk(w) => w,
    };
    let flags = ev_flags | if w.resync { H2_RESYNCED } else { 0 };
    let carry = w.from;
    let call = Call {
        dir: H2_RECV,
        sk,
        seq,
        carry_in: carry,
        flags,
    };
    let end = walk_and_report(&call, w, None, &src, h2);
    // SAFETY: as above.
    unsafe {
        match end {
            Some(end) => {
                (*h2).rx_next = seq.wrapping_add(end);
                (*h2).sync |= H2_RX_SYNC;
            }
            None => (*h2).sync &= !H2_RX_SYNC,
        }
    }
}

/// The connection is gone: its walk state too.
#[inline(always)]
pub(crate) fn forget(sk: u64, state: *const ConnState) {
    // SAFETY: live map value.
    if unsafe { (*state).h2 } & CONN_H2 != 0 {
        let _ = H2_CONNS.remove(sk);
    }
}
