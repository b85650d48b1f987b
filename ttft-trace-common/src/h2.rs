//! HTTP/2 frame summaries: on a followed connection that speaks HTTP/2, the
//! kernel walks the 9-byte frame headers of each send (and of each data
//! segment received) and sends one [`H2FramesEvent`] per call (one per
//! [`H2_MAX_FRAMES`] frames of it), not one per frame. Userspace turns them
//! into one request per stream.

/// Tag of [`H2FramesEvent`] (after the signals' 4 to 6 and the segment's 7).
pub const EVENT_H2: u32 = 8;

/// Frame summaries in one event: a call with more sends its first ones
/// ([`H2_FULL`]) and goes on in another event ([`H2_CONTINUED`]), up to
/// [`H2_WALK_MAX`] steps a call.
pub const H2_MAX_FRAMES: usize = 16;
/// Payload bytes kept per frame: enough for a HEADERS frame's pad length
/// and priority fields (6) and the first byte of its header block (an
/// HPACK static index such as `:status: 200`), a gRPC message's prefix,
/// RST_STREAM's error code, GOAWAY's last stream and error code.
pub const H2_FRAME_HEAD: usize = 8;
/// A frame header's length.
pub const H2_FRAME_HEADER: u32 = 9;
/// The client connection preface (RFC 9113 §3.4).
pub const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// [`H2FramesEvent::dir`]: frames the client sent (a data segment).
pub const H2_RECV: u32 = 1;
/// [`H2FramesEvent::dir`]: frames the server sent (a send call).
pub const H2_SEND: u32 = 2;

/// [`H2FramesEvent::flags`], while walking only: the event holds
/// [`H2_MAX_FRAMES`] frames and the next one waits (its header not taken):
/// the walker sends the event as it is ([`full_event_sent`]) and the walk
/// goes on in a fresh one.
pub const H2_FULL: u32 = 1;
/// [`H2FramesEvent::flags`]: these frames go on the call of the event
/// before (same direction, socket, time and sequence number), which was
/// full.
pub const H2_CONTINUED: u32 = 16;
/// [`H2FramesEvent::flags`]: the direction had lost its place, and this
/// call's first bytes read as a plausible frame header: the walk starts
/// there again. Its first frame is a guess, however plausible.
pub const H2_RESYNCED: u32 = 2;
/// [`H2FramesEvent::flags`]: the walk lost its place in this call (an
/// unreadable or implausible header, more than [`H2_WALK_MAX`] frames, a
/// segment past a gap): later calls are not walked until one resyncs. (A
/// frame header cut by a call's end is not lost: its first bytes are
/// carried to the next call, [`CutHeader`].)
pub const H2_LOST: u32 = 4;
/// [`H2FramesEvent::flags`]: the client's connection preface starts this
/// segment (the walk begins after it).
pub const H2_PREFACE_SEEN: u32 = 8;

/// Frame types (RFC 9113 §6).
pub const H2_DATA: u8 = 0x0;
pub const H2_HEADERS: u8 = 0x1;
pub const H2_PRIORITY: u8 = 0x2;
pub const H2_RST_STREAM: u8 = 0x3;
pub const H2_SETTINGS: u8 = 0x4;
pub const H2_PUSH_PROMISE: u8 = 0x5;
pub const H2_PING: u8 = 0x6;
pub const H2_GOAWAY: u8 = 0x7;
pub const H2_WINDOW_UPDATE: u8 = 0x8;
pub const H2_CONTINUATION: u8 = 0x9;

/// Frame flags.
pub const H2_END_STREAM: u8 = 0x1;
pub const H2_ACK: u8 = 0x1;
pub const H2_END_HEADERS: u8 = 0x4;
pub const H2_PADDED: u8 = 0x8;
pub const H2_PRIORITY_FLAG: u8 = 0x20;

/// Largest frame payload a peer may allow (`SETTINGS_MAX_FRAME_SIZE`).
pub const H2_MAX_FRAME_LEN: u32 = (1 << 24) - 1;

/// One frame's header, where it starts, and its first payload bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct H2Frame {
    /// Offset of the frame header from [`H2FramesEvent::seq`]; below 0
    /// (wrapped) for a header begun in an earlier call, cut by its end
    /// ([`H2FramesEvent::t_cut_ns`]).
    pub offset: u32,
    /// Payload length (24 bits).
    pub len: u32,
    /// Stream identifier (reserved bit cleared).
    pub stream: u32,
    pub kind: u8,
    pub flags: u8,
    /// Valid bytes in `head` (the payload's first, within this call).
    pub head_len: u8,
    pub _pad: u8,
    pub head: [u8; H2_FRAME_HEAD],
}

impl H2Frame {
    /// The captured payload bytes.
    pub fn head(&self) -> &[u8] {
        &self.head[..usize::from(self.head_len).min(H2_FRAME_HEAD)]
    }
}

/// The frames of one send, or of one data segment received, on an HTTP/2
/// connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2FramesEvent {
    /// [`EVENT_H2`].
    pub kind: u32,
    /// [`H2_RECV`] or [`H2_SEND`].
    pub dir: u32,
    /// The sending task (0 for a segment: softirq, no task).
    pub tgid: u32,
    pub tid: u32,
    pub sk: u64,
    /// `bpf_ktime_get_ns`: where the send starts, or the segment arrives.
    pub t_ns: u64,
    /// TCP sequence number of the call's first byte walked.
    pub seq: u32,
    /// Bytes of the call walked, from `seq`.
    pub bytes: u32,
    /// Bytes at `seq` that carried on a frame begun in an earlier call
    /// (can exceed `bytes`: the whole call is inside one frame).
    pub carry_in: u32,
    /// Valid entries of `frames`.
    pub n_frames: u32,
    /// [`H2_TRUNCATED`] | [`H2_RESYNCED`] | [`H2_LOST`] | [`H2_PREFACE_SEEN`].
    pub flags: u32,
    pub _pad: u32,
    /// Where the first frame's header began in an earlier call of the
    /// direction (cut by that call's end, [`CutHeader`]): when that call
    /// was seen. 0 otherwise.
    pub t_cut_ns: u64,
    pub frames: [H2Frame; H2_MAX_FRAMES],
}

impl Default for H2FramesEvent {
    fn default() -> Self {
        Self {
            kind: EVENT_H2,
            dir: 0,
            tgid: 0,
            tid: 0,
            sk: 0,
            t_ns: 0,
            seq: 0,
            bytes: 0,
            carry_in: 0,
            n_frames: 0,
            flags: 0,
            _pad: 0,
            t_cut_ns: 0,
            frames: [H2Frame::default(); H2_MAX_FRAMES],
        }
    }
}

impl H2FramesEvent {
    /// The frames walked.
    pub fn frames(&self) -> &[H2Frame] {
        &self.frames[..(self.n_frames as usize).min(H2_MAX_FRAMES)]
    }
}

/// Per-connection walk state of an HTTP/2 connection (value of the
/// kernel's `H2_CONNS`), one per direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct H2State {
    /// Sends: bytes of the frame in progress that the next send starts
    /// with (0: it starts on a frame header, or on the rest of `tx_cut`).
    pub tx_carry: u32,
    /// Receives: sequence number of the next byte to walk (a frame
    /// header, the rest of `rx_cut`'s, or a frame's payload).
    pub rx_next: u32,
    /// [`H2_TX_SYNC`] | [`H2_RX_SYNC`]: whether the direction knows where
    /// its next frame starts.
    pub sync: u32,
    /// Header blocks of the server's sent so far ([`H2BlockEvent::index`]).
    pub tx_blocks: u32,
    /// Each direction's frame header cut by its last call's end.
    pub tx_cut: CutHeader,
    pub rx_cut: CutHeader,
}

/// The first bytes of a frame header that a call's end cut (fewer than 9
/// of them in the call: a client's frames cut at the MSS, a writer that
/// writes a header in pieces), kept for the direction's next call to
/// complete. Only where the direction knows its place.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CutHeader {
    /// When the call that brought its first byte was seen.
    pub t_ns: u64,
    /// Its first bytes.
    pub bytes: [u8; 8],
    /// Valid bytes in `bytes` (0: none kept).
    pub len: u32,
    pub _pad: u32,
}

pub const H2_TX_SYNC: u32 = 1;
pub const H2_RX_SYNC: u32 = 2;

/// [`H2BlockEvent::kind`].
pub const EVENT_H2_BLOCK: u32 = 9;
/// Header block bytes kept per HEADERS frame the server sends: a gRPC
/// server's response headers and trailers (status, content type, a short
/// `grpc-message`) fit; a longer block is kept in part, and its
/// connection's HPACK decoding stops there.
pub const H2_BLOCK_MAX: usize = 128;

/// The start of a header block the server sent: a HEADERS frame's payload
/// (pad length and priority fields included), for userspace's HPACK
/// decoder. Sent before the frames event of its call, which lists the
/// frame at the same `t_ns` and `offset`: a frame listed with no block
/// (the event lost, a header completed across calls) tells userspace its
/// decoder missed one.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2BlockEvent {
    /// [`EVENT_H2_BLOCK`].
    pub kind: u32,
    pub stream: u32,
    pub sk: u64,
    /// The call's [`H2FramesEvent::t_ns`].
    pub t_ns: u64,
    /// The frame's [`H2Frame::offset`].
    pub offset: u32,
    /// The payload's length.
    pub len: u32,
    /// Valid bytes in `bytes`: the payload's first, fewer than `len` where
    /// it is longer than [`H2_BLOCK_MAX`] or goes on in another iovec
    /// entry.
    pub captured: u32,
    /// The connection's blocks sent before this one: a gap tells
    /// userspace that one was lost with its frames event.
    pub index: u32,
    pub flags: u8,
    pub _pad: [u8; 7],
    /// The first `captured` are the block's; the rest is room the
    /// kernel's bounded writes need.
    pub bytes: [u8; 2 * H2_BLOCK_MAX],
}

impl Default for H2BlockEvent {
    fn default() -> Self {
        Self {
            kind: EVENT_H2_BLOCK,
            stream: 0,
            sk: 0,
            t_ns: 0,
            offset: 0,
            len: 0,
            captured: 0,
            index: 0,
            flags: 0,
            _pad: [0; 7],
            bytes: [0; 2 * H2_BLOCK_MAX],
        }
    }
}

impl H2BlockEvent {
    /// The captured bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..(self.captured as usize).min(H2_BLOCK_MAX)]
    }

    /// Whether the whole payload was captured.
    pub fn whole(&self) -> bool {
        self.captured == self.len
    }
}

/// The parts of a 9-byte frame header: (payload length, type, flags,
/// stream id with the reserved bit cleared).
#[inline(always)]
pub fn parse_header(h: &[u8; 9]) -> (u32, u8, u8, u32) {
    let len = (u32::from(h[0]) << 16) | (u32::from(h[1]) << 8) | u32::from(h[2]);
    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
    (len, h[3], h[4], stream)
}

/// Whether a frame header is one a real peer would send: a known type, on
/// the stream kind it belongs to, of a length the type allows, the reserved
/// bit clear. The walk trusts headers where it knows its place; this is
/// asked only where it resumes after losing it, and of a server's first
/// send (its SETTINGS preface).
#[inline(always)]
pub fn plausible_header(h: &[u8; 9]) -> bool {
    let (len, kind, flags, stream) = parse_header(h);
    if h[5] & 0x80 != 0 || len > H2_MAX_FRAME_LEN {
        return false;
    }
    // A pad length byte, and a priority's 5 bytes, take room (a gRPC
    // message prefix `0 0 0 0 9` reads as an empty DATA frame PADDED).
    let padded = u32::from(flags & H2_PADDED != 0);
    let priority = if kind == H2_HEADERS && flags & H2_PRIORITY_FLAG != 0 {
        5
    } else {
        0
    };
    if matches!(kind, H2_DATA | H2_HEADERS | H2_PUSH_PROMISE) && len < padded + priority {
        return false;
    }
    match kind {
        H2_DATA | H2_HEADERS | H2_CONTINUATION => stream != 0,
        H2_PRIORITY => stream != 0 && len == 5,
        H2_RST_STREAM => stream != 0 && len == 4,
        H2_SETTINGS => stream == 0 && len % 6 == 0,
        H2_PUSH_PROMISE => stream != 0 && len >= 4,
        H2_PING => stream == 0 && len == 8,
        H2_GOAWAY => stream == 0 && len >= 8,
        H2_WINDOW_UPDATE => len == 4,
        _ => false,
    }
}

/// The largest frame a peer sends unless the other side raised it
/// (`SETTINGS_MAX_FRAME_SIZE`'s initial value, RFC 9113 §6.5.2).
pub const H2_DEFAULT_MAX_FRAME: u32 = 16_384;

/// Whether a call's first bytes may start the walk of a connection
/// adopted mid-life, known by its frame layout alone: a plausible header
/// ([`plausible_header`]) no longer than [`H2_DEFAULT_MAX_FRAME`], with no
/// flag its type does not define. HTTP/1.x never passes (a printable first
/// byte reads as a length over 2 MiB), nor do TLS records (0x14-0x17: over
/// 1.3 MiB); other binary bytes one time in some hundred thousand, and
/// the walk then loses its place at the first implausible header.
#[inline(always)]
pub fn adoptable_header(h: &[u8; 9]) -> bool {
    let (len, kind, flags, _) = parse_header(h);
    let defined = match kind {
        H2_DATA => H2_END_STREAM | H2_PADDED,
        H2_HEADERS => H2_END_STREAM | H2_END_HEADERS | H2_PADDED | H2_PRIORITY_FLAG,
        H2_SETTINGS | H2_PING => H2_ACK,
        H2_PUSH_PROMISE => H2_END_HEADERS | H2_PADDED,
        H2_CONTINUATION => H2_END_HEADERS,
        _ => 0,
    };
    len <= H2_DEFAULT_MAX_FRAME && flags & !defined == 0 && plausible_header(h)
}

/// Whether a server's send starts with its connection preface: a SETTINGS
/// frame (not an ACK) on stream 0.
#[inline(always)]
pub fn is_server_preface(h: &[u8; 9]) -> bool {
    let (len, kind, flags, _) = parse_header(h);
    kind == H2_SETTINGS && flags & H2_ACK == 0 && len <= 6 * 16 && plausible_header(h)
}

/// Steps per call at most (a frame header each, and one more each time an
/// event fills: about 960 frames); past this the walk loses its place. A
/// client opening a hundred calls at once sends 200 frames in a segment.
pub const H2_WALK_MAX: u32 = 1024;
/// A frame header and the payload bytes kept: what one read takes.
pub const H2_PEEK: usize = H2_FRAME_HEADER as usize + H2_FRAME_HEAD;

/// The bytes of one call (a send's buffer, a segment's payload), by offset
/// from its first byte walked.
pub trait FrameBytes {
    /// Reads up to [`H2_PEEK`] bytes at `at` into `dst`: how many are
    /// valid (contiguous; 0 on a fault or past the end).
    fn peek(&mut self, at: u32, dst: &mut [u8; H2_PEEK]) -> u32;
    /// Reads up to [`H2_CUT_READ`] bytes at `at` into `dst`, however few
    /// are left (the rest of a cut header, and the payload's first bytes,
    /// where a call holds fewer than [`peek`] needs): how many are valid
    /// (contiguous: an iovec entry's end stops them; 0 on a fault).
    ///
    /// [`peek`]: FrameBytes::peek
    fn small(&mut self, at: u32, dst: &mut [u8; H2_CUT_READ]) -> u32;
    /// Reads up to [`H2_FRAME_HEAD`] bytes at `at` into `dst`, where the
    /// bytes before `at` ended a piece (an iovec entry): a frame's first
    /// payload bytes, where its header ended the entry that [`peek`] read
    /// (nginx writes each frame header in an entry of its own). How many
    /// are valid (0 where the next piece is not readable; always 0 for a
    /// segment, whose payload is contiguous).
    ///
    /// [`peek`]: FrameBytes::peek
    fn head(&mut self, at: u32, dst: &mut [u8; H2_FRAME_HEAD]) -> u32;
}

/// What [`FrameBytes::small`] reads at most: the rest of a cut header
/// (8 bytes at most) and the payload bytes kept.
pub const H2_CUT_READ: usize = 16;

/// Where a call's walk starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Walk {
    /// Offset of the first frame header (at or past `total`: the call is
    /// all inside the frame in progress).
    pub from: u32,
    /// Bytes in the call.
    pub total: u32,
    /// The direction had lost its place: the first header must be
    /// plausible ([`plausible_header`]).
    pub resync: bool,
}

/// Where a walk is, between its steps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalkState {
    /// Offset of the next frame header.
    pub pos: u32,
}

/// Step `i` of a walk: reads the frame header at `st.pos` into
/// `ev.frames[ev.n_frames]` (or, with the event full, sets [`H2_FULL`]
/// and leaves the header for the next step, after the walker sent the
/// event: [`full_event_sent`]). Returns `Some(end)` once
/// the walk is over: `end` is the offset just past the last frame begun
/// (past `total` when that frame goes on in a later call; below `total`
/// where the call's end cuts the next frame header, which starts there:
/// [`keep_cut`] keeps its bytes), or `None` where the walk lost its place
/// (a header unreadable, or cut where resyncing; an implausible header
/// where resyncing; more than [`H2_WALK_MAX`] frames). Step
/// [`H2_WALK_MAX`] always ends it. One step per call, so
/// that the kernel can run the steps under `bpf_loop` (the verifier then
/// checks one step, not every iteration); the unit tests run them in a
/// plain loop.
#[inline(always)]
pub fn walk_step<B: FrameBytes>(
    src: &mut B,
    w: &Walk,
    i: u32,
    st: &mut WalkState,
    ev: &mut H2FramesEvent,
) -> Option<Option<u32>> {
    let pos = st.pos;
    if pos >= w.total {
        return Some(Some(pos));
    }
    if i >= H2_WALK_MAX {
        return Some(None);
    }
    if w.total - pos < H2_FRAME_HEADER {
        // Cut by the call's end: carried where the walk knows its place.
        return Some(if w.resync && i == 0 { None } else { Some(pos) });
    }
    let mut buf = [0u8; H2_PEEK];
    let n = src.peek(pos, &mut buf);
    if n < H2_FRAME_HEADER {
        return Some(None);
    }
    let mut header = [0u8; 9];
    header.copy_from_slice(&buf[..9]);
    if w.resync && i == 0 && !plausible_header(&header) {
        return Some(None);
    }
    let (len, kind, flags, stream) = parse_header(&header);
    // Read back from memory so that the bound below is checked on the very
    // register that indexes the array (the kernel's verifier loses it to a
    // copy otherwise).
    // SAFETY: a read of a field.
    let k = unsafe { core::ptr::read_volatile(&ev.n_frames) } as usize;
    if k >= H2_MAX_FRAMES {
        ev.flags |= H2_FULL;
        return None;
    }
    let f = &mut ev.frames[k];
    (f.offset, f.len, f.stream, f.kind, f.flags) = (pos, len, stream, kind, flags);
    let mut kept = (n - H2_FRAME_HEADER).min(len).min(H2_FRAME_HEAD as u32);
    f.head.copy_from_slice(&buf[9..]);
    if n == H2_FRAME_HEADER && len > 0 && w.total - pos > H2_FRAME_HEADER {
        // The header ended its piece: the payload's first bytes are in the
        // next (a HEADERS frame's status, a RST_STREAM's code, a pad).
        let at = pos + H2_FRAME_HEADER;
        kept = src
            .head(at, &mut f.head)
            .min(len)
            .min(w.total - at)
            .min(H2_FRAME_HEAD as u32);
    }
    f.head_len = kept as u8;
    ev.n_frames = k as u32 + 1;
    st.pos = pos.saturating_add(H2_FRAME_HEADER + len);
    None
}

/// After a step that found the event full ([`H2_FULL`]) and the walker
/// sent it (without that flag): the event starts again empty, as the
/// call's continuation ([`H2_CONTINUED`]: its fixed part, the call's,
/// stays; the cut header's time belonged to the first frame sent).
#[inline(always)]
pub fn full_event_sent(ev: &mut H2FramesEvent) {
    ev.n_frames = 0;
    ev.t_cut_ns = 0;
    ev.flags = H2_CONTINUED;
}

/// How a call begins whose direction carries a [`CutHeader`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resumed {
    /// The call's bytes did not finish the header: they are kept with the
    /// others (a header in three or more pieces).
    StillCut,
    /// The header is whole: its frame is in the event (`ev.frames`, with
    /// [`H2FramesEvent::t_cut_ns`]), and the walk goes on at this offset
    /// (past `total`: that frame goes on in a later call).
    Walk(u32),
    /// A byte could not be read: the walk loses its place.
    Lost,
}

/// Completes the frame header in `cut` (which holds its first bytes) with
/// the call's bytes from `at` (the first the direction has not walked),
/// and summarises its frame in `ev` as [`walk_step`] does. `cut` is left
/// empty, or holds the longer piece ([`Resumed::StillCut`]).
#[inline(always)]
pub fn resume_cut<B: FrameBytes>(
    src: &mut B,
    cut: &mut CutHeader,
    at: u32,
    total: u32,
    ev: &mut H2FramesEvent,
) -> Resumed {
    let have = cut.len.clamp(1, H2_FRAME_HEADER - 1);
    let avail = total.saturating_sub(at);
    // The call's first bytes, in one read.
    let mut buf = [0u8; H2_CUT_READ];
    let got = src.small(at, &mut buf).min(avail);
    let need = H2_FRAME_HEADER - have;
    if got < need && got < avail {
        // Fewer readable than the call has: an iovec entry's end, a fault.
        cut.len = 0;
        return Resumed::Lost;
    }
    // The header's bytes joined and the payload's picked by shifts, not
    // by indexes that depend on `have` (the kernel's verifier refuses a
    // variable offset into the stack that it cannot bound): the call's
    // first 16 bytes as two big-endian halves.
    let hi = u64::from_be_bytes([
        buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7],
    ]);
    let lo = u64::from_be_bytes([
        buf[8], buf[9], buf[10], buf[11], buf[12], buf[13], buf[14], buf[15],
    ]);
    let kept_bits = 8 * have;
    let first8 = (u64::from_be_bytes(cut.bytes) & !shr(u64::MAX, kept_bits)) | shr(hi, kept_bits);
    if got < need {
        // The whole call is part of the header.
        cut.bytes = first8.to_be_bytes();
        cut.len = have + got;
        return Resumed::StillCut;
    }
    cut.len = 0;
    let b = first8.to_be_bytes();
    let last = (shr(hi, 8 * (have - 1)) & 0xff) as u8;
    let header = [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], last];
    let (len, kind, flags, stream) = parse_header(&header);
    // The payload's first bytes, where this call has them.
    let payload = at + need;
    let kept = len.min(got - need).min(H2_FRAME_HEAD as u32);
    let head = (shl(hi, 8 * need) | shr(lo, 64 - 8 * need)).to_be_bytes();
    // SAFETY: a read of a field (as in `walk_step`).
    let k = unsafe { core::ptr::read_volatile(&ev.n_frames) } as usize;
    if k < H2_MAX_FRAMES {
        let f = &mut ev.frames[k];
        (f.offset, f.len, f.stream, f.kind, f.flags) =
            (at.wrapping_sub(have), len, stream, kind, flags);
        f.head_len = kept as u8;
        f.head = head;
        ev.n_frames = k as u32 + 1;
    }
    ev.t_cut_ns = cut.t_ns;
    Resumed::Walk(payload.saturating_add(len))
}

/// `x >> s`, 0 from 64 on.
#[inline(always)]
fn shr(x: u64, s: u32) -> u64 {
    x.checked_shr(s).unwrap_or(0)
}

/// `x << s`, 0 from 64 on.
#[inline(always)]
fn shl(x: u64, s: u32) -> u64 {
    x.checked_shl(s).unwrap_or(0)
}

/// Keeps in `cut` the first bytes of the frame header that the call's end
/// cut: from `at` ([`walk_step`]'s end, below `total`) to `total`, fewer
/// than 9, in a call seen at `t_ns`. False where one could not be read
/// (the walk then loses its place).
#[inline(always)]
pub fn keep_cut<B: FrameBytes>(
    src: &mut B,
    at: u32,
    total: u32,
    t_ns: u64,
    cut: &mut CutHeader,
) -> bool {
    let n = total.saturating_sub(at);
    if n == 0 || n >= H2_FRAME_HEADER {
        return false;
    }
    let mut buf = [0u8; H2_CUT_READ];
    if src.small(at, &mut buf) < n {
        return false;
    }
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&buf[..8]);
    *cut = CutHeader {
        t_ns,
        bytes,
        len: n,
        _pad: 0,
    };
    true
}

/// One call's walk in a plain loop, as the kernel runs it with the steps
/// under `bpf_loop` (its `walk_and_report`), for the tests: a cut header
/// completed first ([`resume_cut`]), then the steps, then a header cut by
/// the call's end kept ([`keep_cut`], at `ev.t_ns`). Returns the offset
/// just past the last frame begun, at or past `total` (`None`: the walk
/// lost its place); each event that filled goes to `sent` first.
pub fn walk_call<B: FrameBytes>(
    src: &mut B,
    w: &Walk,
    cut: &mut CutHeader,
    st: &mut WalkState,
    ev: &mut H2FramesEvent,
    sent: &mut impl FnMut(&H2FramesEvent),
) -> Option<u32> {
    *st = WalkState { pos: w.from };
    if w.resync {
        cut.len = 0;
    }
    if cut.len != 0 {
        match resume_cut(src, cut, w.from, w.total, ev) {
            Resumed::StillCut => return Some(w.total.max(w.from)),
            Resumed::Walk(at) => st.pos = at,
            Resumed::Lost => return None,
        }
    }
    let mut end = None;
    for i in 0..=H2_WALK_MAX {
        if let Some(e) = walk_step(src, w, i, st, ev) {
            end = e;
            break;
        }
        if ev.flags & H2_FULL != 0 {
            ev.flags &= !H2_FULL;
            sent(ev);
            full_event_sent(ev);
        }
    }
    let end = match end {
        Some(e) if e < w.total => keep_cut(src, e, w.total, ev.t_ns, cut).then_some(w.total),
        e => e,
    };
    if end.is_none() {
        cut.len = 0;
    }
    end
}

/// What to do with a data segment received on an HTTP/2 connection, given
/// the sequence number of the next byte to walk (`next`, where `synced`:
/// a frame header, the rest of a cut one, or the payload of the frame in
/// progress).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RxPlan {
    /// All inside a frame's payload, or a retransmit of bytes walked.
    Skip,
    /// Bytes before this segment are missing (reordered, or lost on the
    /// way to the hook): where its frames start is not known.
    Lost,
    Walk(Walk),
}

/// The plan for a segment of `len` bytes at sequence number `seq`.
#[inline(always)]
pub fn rx_plan(next: u32, synced: bool, seq: u32, len: u32) -> RxPlan {
    if !synced {
        return RxPlan::Walk(Walk {
            from: 0,
            total: len,
            resync: true,
        });
    }
    // Sequence numbers wrap: compare differences as signed.
    let ahead = next.wrapping_sub(seq) as i32;
    if ahead < 0 {
        RxPlan::Lost
    } else if ahead as u32 >= len {
        RxPlan::Skip
    } else {
        RxPlan::Walk(Walk {
            from: ahead as u32,
            total: len,
            resync: false,
        })
    }
}

const _: () = {
    assert!(core::mem::size_of::<H2Frame>() == 24);
    assert!(core::mem::size_of::<H2FramesEvent>() == 64 + 24 * H2_MAX_FRAMES);
    assert!(core::mem::offset_of!(H2FramesEvent, seq) == 32);
    assert!(core::mem::offset_of!(H2FramesEvent, frames) == 64);
    assert!(core::mem::size_of::<CutHeader>() == 24);
    assert!(core::mem::size_of::<H2State>() == 16 + 2 * 24);
    assert!(core::mem::size_of::<H2BlockEvent>() == 48 + 2 * H2_BLOCK_MAX);
    assert!(core::mem::offset_of!(H2BlockEvent, bytes) == 48);
};

#[cfg(test)]
#[path = "h2_tests.rs"]
mod tests;
