//! HTTP/2 streams of one connection, from the frame summaries the kernel
//! walks (`ttft_trace_common::h2`): one request per client-initiated
//! stream. Pure: frames, receives and the close in, finished streams out.
//!
//! - arrival: the data segment that brought the first byte of the
//!   stream's HEADERS frame (`t_segment`), and the server's first receive
//!   that returned after it (`t_arrive`, as for HTTP/1.1);
//! - first byte: the send with the response's HEADERS; first token: the
//!   first send carrying a DATA frame with payload (padding aside) on the
//!   stream; every such send is a chunk (several DATA frames of the stream
//!   in one send reach the client together: one chunk);
//! - end: END_STREAM from the server (DATA, or trailers HEADERS), a
//!   RST_STREAM from either side, a GOAWAY whose last stream is below it,
//!   or the connection's end (cut);
//! - each chunk's delivery: where the send's TCP sequence number is known
//!   (the TCP send hook; not the syscall hook), the end in sequence space
//!   of the stream's first DATA frame with payload in that send
//!   ([`ChunkSent`]), whose ACK the connection then awaits as for HTTP/1.1:
//!   the first chunk's gives the client TTFT estimate and the network
//!   cause, the others the delivery gaps a stall is judged on. The whole
//!   frame, not the send: a frame's payload is delivered to the stream
//!   only once it is all there.
//!
//! The status, `grpc-status` and `grpc-message` come from the server's
//! header blocks, decoded with the connection's HPACK state
//! (`header_blocks.rs`) while it has seen every block; where it has not
//! (a connection adopted mid-life, a block missed), the status is still
//! read where the response's block starts with a static-table index
//! (`0x88` is `:status: 200`), after any dynamic table size updates.

use std::collections::BTreeMap;

use ttft_trace_common::h2::{
    H2_CONTINUATION, H2_CONTINUED, H2_DATA, H2_END_STREAM, H2_FRAME_HEADER, H2_GOAWAY, H2_HEADERS,
    H2_LOST, H2_PADDED, H2_PRIORITY_FLAG, H2_RECV, H2_RESYNCED, H2_RST_STREAM, H2BlockEvent,
    H2Frame, H2FramesEvent,
};

use super::header_blocks::HeaderBlocks;

/// Streams followed at once per connection (gRPC's default concurrency
/// limit is 100). A new stream past it evicts the oldest open one (the
/// lowest id: a client's ids only grow), counted: a stream whose end was
/// missed (its frame past a call's cap, a walk that lost its place, a lost
/// event) would otherwise hold its slot for the connection's life, and on
/// a channel that lives for days the table would end up refusing every new
/// stream.
pub(crate) const MAX_STREAMS: usize = 1024;

/// HPACK's static table's `:status` entries (RFC 7541 appendix A).
const STATIC_STATUS: [(u8, u16); 7] = [
    (8, 200),
    (9, 204),
    (10, 206),
    (11, 304),
    (12, 400),
    (13, 404),
    (14, 500),
];

/// A chunk of a stream, sent at `t_ns`, its DATA frame's last byte ending
/// at sequence number `end_seq` (that byte + 1); `first`: the stream's
/// first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkSent {
    pub stream: u32,
    pub t_ns: u64,
    pub end_seq: u32,
    pub first: bool,
}

/// Who sent a RST_STREAM or GOAWAY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Server,
}

/// How a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamEnd {
    /// END_STREAM from the server.
    Ended,
    /// RST_STREAM, with its error code.
    Reset { code: u32, by: Side },
    /// A GOAWAY whose last stream id is below this one's, with its code.
    GoAway { code: u32, by: Side },
    /// The connection ended first.
    Cut,
    /// Given up to bound the table: [`MAX_STREAMS`] were open.
    Evicted,
}

/// One client-initiated stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stream {
    pub id: u32,
    /// The segment that brought its HEADERS frame's first byte.
    pub t_segment: u64,
    /// The server's first receive after that segment, and its thread.
    pub t_arrive: Option<u64>,
    pub tgid: u32,
    pub tid: u32,
    pub t_first_byte: Option<u64>,
    pub t_first_token: Option<u64>,
    pub t_last_send: Option<u64>,
    pub status: Option<u16>,
    /// The trailers' (or a trailers-only response's) gRPC status and
    /// message, where decoded.
    pub grpc_status: Option<u32>,
    pub grpc_message: Option<String>,
    /// Sends carrying DATA payload, and the gaps between them (at most
    /// `itl_cap`).
    pub chunks: u32,
    pub itl: Vec<u64>,
    pub itl_truncated: bool,
    last_chunk_ns: u64,
    /// The client's frames on the stream (headers included), and the DATA
    /// payload the server sent.
    pub bytes_in: u64,
    pub bytes_out: u64,
}

#[derive(Debug, Default)]
pub(crate) struct StreamTable {
    open: BTreeMap<u32, Stream>,
    itl_cap: usize,
    /// Open streams given up for a new one: [`MAX_STREAMS`] were open.
    pub dropped: u64,
    /// Server frames on streams whose HEADERS were never seen (opened
    /// before tracing, or their segments not walked).
    pub unseen_frames: u64,
    /// Chunks sent with a known sequence number since the last
    /// [`StreamTable::take_chunks_sent`], in sending order.
    chunks_sent: Vec<ChunkSent>,
    /// The streams with a chunk in the server's last send: a send with
    /// more than `H2_MAX_FRAMES` frames comes in several events
    /// (`H2_CONTINUED`), one chunk a stream all the same.
    send_chunked: Vec<u32>,
    /// The server's header blocks, decoded in order, and the next one's
    /// index ([`H2BlockEvent::index`]: the kernel counts every HEADERS
    /// frame it lists, a block sent or not).
    headers: HeaderBlocks,
    next_block: u32,
}

impl StreamTable {
    pub fn new(itl_cap: usize) -> Self {
        Self {
            itl_cap,
            headers: HeaderBlocks::new(true),
            ..Self::default()
        }
    }

    /// A header block the server sent, applied before its call's frames
    /// (the correlator orders them so): decoded in the connection's order
    /// (a gap in the kernel's count, a block lost or not sent, stops the
    /// decoder), what it says kept on its stream.
    pub fn on_block(&mut self, b: &H2BlockEvent) {
        if b.index != self.next_block {
            self.headers.missed();
        }
        self.next_block = b.index.wrapping_add(1);
        let Some(fields) = self.headers.decode(b) else {
            return;
        };
        let Some(s) = self.open.get_mut(&b.stream) else {
            return;
        };
        if s.t_first_byte.is_none() {
            s.status = fields.status.or(s.status);
        }
        if fields.grpc_status.is_some() {
            (s.grpc_status, s.grpc_message) = (fields.grpc_status, fields.grpc_message);
        }
    }

    /// A receive returned at `t_ns` in thread `tgid`/`tid`: the arrival of
    /// every stream whose HEADERS came before it and had none yet.
    pub fn on_recv(&mut self, t_ns: u64, tgid: u32, tid: u32) {
        for s in self.open.values_mut() {
            if s.t_arrive.is_none() && s.t_segment <= t_ns {
                (s.t_arrive, s.tgid, s.tid) = (Some(t_ns), tgid, tid);
            }
        }
    }

    /// The frames of one call; streams that ended go to `done`.
    pub fn on_frames(&mut self, ev: &H2FramesEvent, done: &mut Vec<(Stream, StreamEnd)>) {
        let side = if ev.dir == H2_RECV {
            Side::Client
        } else {
            Side::Server
        };
        if side == Side::Server {
            if ev.flags & H2_CONTINUED == 0 {
                self.send_chunked.clear();
            }
            // The walk lost its place (or began mid-connection): blocks
            // may have gone unlisted.
            if ev.flags & (H2_RESYNCED | H2_LOST) != 0 {
                self.headers.missed();
            }
        }
        let mut chunked = std::mem::take(&mut self.send_chunked);
        // 0: the syscall hook, which does not know it (a real 0 is one
        // sequence number in 2^32: that stream's delivery goes unknown).
        let seq = (ev.seq != 0).then_some(ev.seq);
        for (i, f) in ev.frames().iter().enumerate() {
            // A first frame whose header an earlier call's end cut: its
            // first byte came then (a request's arrival, a response's
            // first byte); its payload, now.
            let t_header = if i == 0 && ev.t_cut_ns != 0 {
                ev.t_cut_ns
            } else {
                ev.t_ns
            };
            match side {
                Side::Client => self.client_frame(t_header, f, done),
                Side::Server => {
                    let sent = Sent {
                        t_ns: ev.t_ns,
                        t_header,
                        seq,
                    };
                    self.server_frame(&sent, f, &mut chunked, done);
                }
            }
        }
        self.send_chunked = chunked;
    }

    /// The chunks sent since the last call, in sending order.
    pub fn take_chunks_sent(&mut self) -> Vec<ChunkSent> {
        std::mem::take(&mut self.chunks_sent)
    }

    fn client_frame(&mut self, t_ns: u64, f: &H2Frame, done: &mut Vec<(Stream, StreamEnd)>) {
        let frame_bytes = u64::from(H2_FRAME_HEADER + f.len);
        match f.kind {
            // A client's stream ids are odd; a HEADERS frame on a stream
            // already open is its trailers.
            H2_HEADERS if f.stream % 2 == 1 && !self.open.contains_key(&f.stream) => {
                if self.open.len() >= MAX_STREAMS
                    && let Some((_, oldest)) = self.open.pop_first()
                {
                    self.dropped += 1;
                    done.push((oldest, StreamEnd::Evicted));
                }
                let mut s = Stream::new(f.stream, t_ns);
                s.bytes_in = frame_bytes;
                self.open.insert(f.stream, s);
            }
            H2_HEADERS | H2_CONTINUATION | H2_DATA => {
                if let Some(s) = self.open.get_mut(&f.stream) {
                    s.bytes_in = s.bytes_in.saturating_add(frame_bytes);
                }
            }
            H2_RST_STREAM => self.end(f.stream, reset(f, Side::Client), done),
            // A client's GOAWAY names the last stream *the server* opened
            // (RFC 9113 §6.8): it ends none of the client's own (Go's
            // `ClientConn.Shutdown` sends GOAWAY(0) and lets them finish).
            _ => {}
        }
    }

    fn server_frame(
        &mut self,
        sent: &Sent,
        f: &H2Frame,
        chunked: &mut Vec<u32>,
        done: &mut Vec<(Stream, StreamEnd)>,
    ) {
        let Sent {
            t_ns,
            t_header,
            seq,
        } = *sent;
        if f.kind == H2_GOAWAY {
            return self.go_away(f, Side::Server, done);
        }
        if f.stream == 0 {
            return;
        }
        let Some(s) = self.open.get_mut(&f.stream) else {
            self.unseen_frames += 1;
            return;
        };
        s.t_last_send = Some(t_ns);
        match f.kind {
            H2_HEADERS if s.t_first_byte.is_none() => {
                s.t_first_byte = Some(t_header);
                s.status = s.status.or(status(f));
            }
            H2_DATA => {
                let payload = data_payload(f);
                s.bytes_out = s.bytes_out.saturating_add(u64::from(payload));
                if payload > 0 && !chunked.contains(&f.stream) {
                    chunked.push(f.stream);
                    if let Some(seq) = seq {
                        // Offsets wrap below the call's start for a header
                        // an earlier call began: the arithmetic is modulo
                        // 2^32, as sequence numbers are.
                        let end_seq = seq
                            .wrapping_add(f.offset)
                            .wrapping_add(H2_FRAME_HEADER + f.len);
                        self.chunks_sent.push(ChunkSent {
                            stream: f.stream,
                            t_ns,
                            end_seq,
                            first: s.t_first_token.is_none(),
                        });
                    }
                    s.chunk(t_ns, self.itl_cap);
                }
            }
            H2_RST_STREAM => return self.end(f.stream, reset(f, Side::Server), done),
            _ => {}
        }
        if matches!(f.kind, H2_DATA | H2_HEADERS) && f.flags & H2_END_STREAM != 0 {
            self.end(f.stream, StreamEnd::Ended, done);
        }
    }

    fn end(&mut self, id: u32, end: StreamEnd, done: &mut Vec<(Stream, StreamEnd)>) {
        if let Some(s) = self.open.remove(&id) {
            done.push((s, end));
        }
    }

    /// Streams above the GOAWAY's last stream id were not (and will not
    /// be) processed.
    fn go_away(&mut self, f: &H2Frame, by: Side, done: &mut Vec<(Stream, StreamEnd)>) {
        let (Some(last), Some(code)) = (be32(f.head(), 0), be32(f.head(), 4)) else {
            return;
        };
        let last = last & 0x7fff_ffff;
        let above: Vec<u32> = self
            .open
            .range(last.saturating_add(1)..)
            .map(|(id, _)| *id)
            .collect();
        for id in above {
            self.end(id, StreamEnd::GoAway { code, by }, done);
        }
    }

    /// The connection ended: every open stream is cut.
    pub fn cut(&mut self, done: &mut Vec<(Stream, StreamEnd)>) {
        done.extend(
            std::mem::take(&mut self.open)
                .into_values()
                .map(|s| (s, StreamEnd::Cut)),
        );
    }
}

impl Stream {
    fn new(id: u32, t_segment: u64) -> Self {
        Self {
            id,
            t_segment,
            t_arrive: None,
            tgid: 0,
            tid: 0,
            t_first_byte: None,
            t_first_token: None,
            t_last_send: None,
            status: None,
            grpc_status: None,
            grpc_message: None,
            chunks: 0,
            itl: Vec::new(),
            itl_truncated: false,
            last_chunk_ns: 0,
            bytes_in: 0,
            bytes_out: 0,
        }
    }

    fn chunk(&mut self, t_ns: u64, itl_cap: usize) {
        if self.t_first_token.is_none() {
            self.t_first_token = Some(t_ns);
        } else if self.itl.len() < itl_cap {
            self.itl.push(t_ns.saturating_sub(self.last_chunk_ns));
        } else {
            self.itl_truncated = true;
        }
        self.chunks += 1;
        self.last_chunk_ns = t_ns;
    }
}

/// A RST_STREAM's end, with its error code (0 where not captured).
/// A server call's frames: when it was sent, when its first frame's
/// header began (an earlier call's, where that cut it), and the sequence
/// number of its first byte walked where known.
struct Sent {
    t_ns: u64,
    t_header: u64,
    seq: Option<u32>,
}

fn reset(f: &H2Frame, by: Side) -> StreamEnd {
    StreamEnd::Reset {
        code: be32(f.head(), 0).unwrap_or(0),
        by,
    }
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A DATA frame's payload less its padding.
fn data_payload(f: &H2Frame) -> u32 {
    if f.flags & H2_PADDED == 0 {
        return f.len;
    }
    let pad = f.head().first().map_or(0, |p| u32::from(*p));
    f.len.saturating_sub(1 + pad)
}

/// `:status` where the header block starts with a static-table index,
/// after any dynamic table size updates (RFC 7541 6.3: they come first in
/// a block; nginx begins each connection's first response with one, to
/// size 0, as it never indexes).
fn status(f: &H2Frame) -> Option<u16> {
    let mut at = 0;
    if f.flags & H2_PADDED != 0 {
        at += 1;
    }
    if f.flags & H2_PRIORITY_FLAG != 0 {
        at += 5;
    }
    let head = f.head();
    // A size update is `001` and a 5-bit prefixed integer: past a full
    // prefix, bytes with the high bit set continue it.
    while head.get(at).is_some_and(|b| b & 0xe0 == 0x20) {
        let full_prefix = head[at] & 0x1f == 0x1f;
        at += 1;
        if full_prefix {
            while head.get(at)? & 0x80 != 0 {
                at += 1;
            }
            at += 1;
        }
    }
    let first = *head.get(at)?;
    if first & 0x80 == 0 {
        return None;
    }
    STATIC_STATUS
        .iter()
        .find(|(index, _)| *index == first & 0x7f)
        .map(|(_, status)| *status)
}

#[cfg(test)]
#[path = "streams_tests.rs"]
mod tests;
