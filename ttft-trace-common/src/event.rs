//! Ring-buffer events. Each starts with a `kind` tag so that later event
//! types can share the buffer.

/// Tag of [`EpisodeEvent`].
pub const EVENT_EPISODE: u32 = 1;

/// Tag of [`ConnEvent`].
pub const EVENT_CONN: u32 = 2;
/// Tag of [`SockEvent`].
pub const EVENT_SOCK: u32 = 3;
/// Tag of [`SegmentEvent`] (4 to 6 are the signals' events).
pub const EVENT_SEGMENT: u32 = 7;

/// An episode used the CUDA runtime API (libcudart).
pub const API_RUNTIME: u32 = 1;
/// An episode used the CUDA driver API (libcuda) directly.
pub const API_DRIVER: u32 = 2;

/// One GPU episode of one thread: from the first kernel or graph launch after
/// the previous episode closed, to the completion of the first
/// device-to-host copy that followed it. One event per episode, not one per
/// launch: the launches are counted in the kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpisodeEvent {
    /// [`EVENT_EPISODE`].
    pub kind: u32,
    pub tgid: u32,
    pub tid: u32,
    /// How the copy completed: a [`crate::Completion`] value.
    pub completion: u32,
    /// [`API_RUNTIME`] | [`API_DRIVER`]: which APIs launched work in the episode.
    pub api: u32,
    /// Return value of the call that completed the copy (0 = success). With
    /// no GPU the real runtime fails every call, yet the episode is seen.
    pub status: i32,
    pub kernel_launches: u32,
    pub graph_launches: u32,
    /// Stream handle of the first launch (an opaque pointer value).
    pub stream: u64,
    /// Stream handle of the device-to-host copy.
    pub copy_stream: u64,
    /// Entry of the first launch call, `bpf_ktime_get_ns` (CLOCK_MONOTONIC).
    pub t_first_launch_ns: u64,
    /// Entry of the first device-to-host copy call.
    pub t_copy_enqueue_ns: u64,
    /// Return of the call that completed that copy.
    pub t_copy_done_ns: u64,
    /// Size of that copy.
    pub copy_bytes: u64,
}

impl EpisodeEvent {
    /// Kernel-launch-to-first-device-to-host-copy latency.
    pub fn latency_ns(&self) -> u64 {
        self.t_copy_done_ns.saturating_sub(self.t_first_launch_ns)
    }
}

/// [`ConnEvent::op`]: a client connected to a listening port of the traced
/// tree (a passive open, `SYN_RECV -> ESTABLISHED`).
pub const CONN_OPEN: u32 = 1;
/// [`ConnEvent::op`]: the connection left `ESTABLISHED` (FIN or RST either
/// way); sent once per connection.
pub const CONN_CLOSE: u32 = 2;
/// [`ConnEvent::op`]: a later state change of a connection that sent
/// [`CONN_CLOSE`]: the kernel still retransmits and takes ACKs on it after
/// the application's close, until `TCP_CLOSE` (the last event of the socket,
/// also when [`CONN_CLOSE`] itself goes to `TCP_CLOSE`).
pub const CONN_STATE: u32 = 3;

/// A server-side TCP connection of the traced tree opening or closing, from
/// `sock:inet_sock_set_state`. Fires in softirq context, so no pid.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnEvent {
    /// [`EVENT_CONN`].
    pub kind: u32,
    /// [`CONN_OPEN`], [`CONN_CLOSE`] or [`CONN_STATE`].
    pub op: u32,
    /// TCP states (`TCP_ESTABLISHED` = 1 ... as in the kernel).
    pub oldstate: u32,
    pub newstate: u32,
    /// The socket's kernel address: the connection's key, as in [`SockEvent`].
    pub sk: u64,
    pub t_ns: u64,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u16,
    /// Local (server) and remote (client) ports, host byte order.
    pub sport: u16,
    pub dport: u16,
    pub _pad: u16,
    /// Local and remote addresses; IPv4 in the first four bytes.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// With [`CONN_CLOSE`]: arrival of the last segment `tcp:tcp_probe` saw
    /// on the socket (0: none). What that segment acknowledged shows only at
    /// a later probe, and there is none after the close.
    pub t_last_segment_ns: u64,
    /// With [`CONN_OPEN`] of a handshake, where [`ConnEvent::snd_nxt_known`]
    /// is 1 (BTF gave the field's offset): the socket's `snd_nxt` then, the
    /// first byte of the first response (the SYN-ACK took the one before).
    /// `tcp:tcp_probe` misses the first request's data when it comes with the
    /// ACK that completes the handshake (the client's own ACK lost or
    /// overtaken, or TCP Fast Open): that response's bytes are then counted
    /// from here.
    pub snd_nxt: u32,
    pub snd_nxt_known: u32,
}

/// [`SockEvent::dir`]: bytes received from the client.
pub const SOCK_RECV: u32 = 1;
/// [`SockEvent::dir`]: bytes sent to the client.
pub const SOCK_SEND: u32 = 2;
/// [`SockEvent::flags`]: the bytes crossed inside the server's TLS call that
/// moves application data in their direction (OpenSSL's `SSL_write` for a
/// send, `SSL_read` for a receive), on the calling thread: they are that
/// call's records. A send's `head` and `tail` are then the call's
/// plaintext, not the bytes on the wire; `bytes` stays what the wire took.
pub const SOCK_TLS_PLAIN: u32 = 1;
/// [`SockEvent::flags`]: the bytes crossed inside another TLS call (the
/// handshake, a shutdown, the other direction's call): TLS's own records,
/// never a request's bytes.
pub const SOCK_TLS_CONTROL: u32 = 2;
/// [`SockEvent::flags`], with [`SOCK_TLS_PLAIN`] on a receive: `SSL_read`
/// returned `bytes` of plaintext from records an earlier receive on the
/// connection took (OpenSSL's read-ahead: the request's records read with
/// the handshake's, or with the request before). No bytes crossed now.
pub const SOCK_TLS_BUFFERED: u32 = 4;
/// Bytes of a send captured in [`SockEvent::head`].
pub const HEAD_BYTES: usize = 256;
/// Bytes of a send captured in [`SockEvent::tail`]: enough for the end of
/// a chunked body (`0\r\n\r\n`), and for how a stream ended: the SSE
/// terminator `data: [DONE]` with its framing, or the last event's
/// `"finish_reason":...}]}` (issue 31).
pub const TAIL_BYTES: usize = 64;
/// iovec entries of a vectored send its head is gathered across, and empty
/// ones skipped back from the array's end to the last with data (where the
/// send covers every byte left, the TCP hook): hyper writes a chunk as
/// three buffers (size line, data, CRLF). Each entry walked costs the send
/// hook's verification: with 8 here, loading the probes took ~250 ms more.
pub const HEAD_IOV_WALKED: u64 = 4;
/// iovec entries walked forwards to the one holding a send's last byte
/// where the send may have stopped short (the syscall hook's partial
/// sends); a send whose last byte lies further has no tail there.
pub const SEND_IOV_WALKED: u64 = 8;
/// Buffers of a vectored send, from the last back, whose bytes make its
/// `tail`: a tail shorter than [`TAIL_BYTES`] on a longer send starts at a
/// buffer's start (these ran out, or the one before could not be read).
pub const TAIL_BUFFERS: u64 = 7;
/// How many sends after each receive carry a `head`: the response's first
/// send (HTTP status line and headers) and the one after it (the first body
/// chunk when headers are flushed alone).
pub const HEAD_SENDS: u32 = 2;

/// Data in or out on a server connection, from `sock:sock_recv_length` /
/// `sock:sock_send_length` (process context: the thread is known).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SockEvent {
    /// [`EVENT_SOCK`].
    pub kind: u32,
    /// [`SOCK_RECV`] or [`SOCK_SEND`].
    pub dir: u32,
    pub tgid: u32,
    pub tid: u32,
    pub sk: u64,
    /// Return of the socket call (`bpf_ktime_get_ns`).
    pub t_ns: u64,
    /// Bytes moved, or a negative errno. A receive of 0 is the client's EOF.
    pub bytes: i64,
    /// Valid bytes in `head` (0: not captured).
    pub head_len: u32,
    /// Valid bytes in `tail` (0: not captured).
    pub tail_len: u32,
    /// [`SOCK_TLS_PLAIN`] or [`SOCK_TLS_CONTROL`]; 0 outside TLS calls.
    pub flags: u32,
    /// With [`SOCK_TLS_PLAIN`], a send's plaintext bytes: those of its
    /// `SSL_write` call, less what the call's earlier sends took (each
    /// send takes at most its wire bytes, the last the rest).
    pub plain_bytes: u32,
    /// The last bytes of the send's buffer, in order from `tail[0]` (end of
    /// response markers such as the chunked terminator `0\r\n\r\n`),
    /// across a vectored send's last [`TAIL_BUFFERS`] buffers.
    pub tail: [u8; TAIL_BYTES],
    /// The first bytes of the send's buffer (across a vectored send's
    /// buffers), for the first [`HEAD_SENDS`] sends after a receive.
    pub head: [u8; HEAD_BYTES],
}

impl Default for SockEvent {
    fn default() -> Self {
        Self {
            kind: EVENT_SOCK,
            dir: 0,
            tgid: 0,
            tid: 0,
            sk: 0,
            t_ns: 0,
            bytes: 0,
            head_len: 0,
            tail_len: 0,
            flags: 0,
            plain_bytes: 0,
            tail: [0; TAIL_BYTES],
            head: [0; HEAD_BYTES],
        }
    }
}

impl SockEvent {
    /// The captured head bytes.
    pub fn head(&self) -> &[u8] {
        &self.head[..(self.head_len as usize).min(HEAD_BYTES)]
    }

    /// The captured tail bytes (the last `tail_len` bytes sent, in order).
    pub fn tail(&self) -> &[u8] {
        &self.tail[..(self.tail_len as usize).min(TAIL_BYTES)]
    }
}

/// [`SegmentEvent::flags`]: the segment carries bytes from the client (a
/// request's, on an HTTP/1.1 connection).
pub const SEGMENT_DATA: u32 = 1;
/// [`SegmentEvent::flags`]: bytes were newly acknowledged. With
/// [`SEGMENT_ACK_EXACT`], by this segment, up to `ack_seq`, at `t_ns`;
/// without, `snd_una` moved since the previous segment on the socket: that
/// one acknowledged the bytes up to `snd_una`, at `t_prev_ns`.
pub const SEGMENT_ACKED: u32 = 2;
/// [`SegmentEvent::flags`]: `ack_seq` is this segment's own acknowledgment
/// number, read from the kernel's control block of the segment (kernels
/// whose `tcp_probe` has `skbaddr`, with BTF to find the field).
pub const SEGMENT_ACK_EXACT: u32 = 4;

/// An incoming segment on a followed server connection, from
/// `tcp:tcp_probe`, sent only when it carries data or when `snd_una` moved
/// since the previous one (pure ACKs that acknowledge nothing new are
/// dropped in the kernel).
///
/// `tcp_probe` fires at the start of `tcp_rcv_established`, before the
/// segment is processed: its `snd_una` is the state the *previous* segment
/// left. Where the segment's own acknowledgment number can be read
/// ([`SEGMENT_ACK_EXACT`]), what it acknowledged is known at once; otherwise
/// an advance first seen here was made by the previous segment, which
/// arrived at `t_prev_ns`, and the last segment's acknowledgment stays
/// unknown until another one comes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentEvent {
    /// [`EVENT_SEGMENT`].
    pub kind: u32,
    /// [`SEGMENT_DATA`] | [`SEGMENT_ACKED`].
    pub flags: u32,
    /// The socket's kernel address, as in [`ConnEvent`].
    pub sk: u64,
    /// This segment's `tcp_probe` (`bpf_ktime_get_ns`).
    pub t_ns: u64,
    /// The previous segment's `tcp_probe` on the socket (0: none seen).
    pub t_prev_ns: u64,
    /// First byte not yet acknowledged, before this segment is processed.
    pub snd_una: u32,
    /// Next byte to send: with [`SEGMENT_DATA`] on an idle HTTP/1.1
    /// connection, the sequence number the response will start at.
    pub snd_nxt: u32,
    /// Smoothed round-trip time, microseconds (the tracepoint's `srtt`,
    /// already `srtt_us >> 3`).
    pub srtt_us: u32,
    /// Payload bytes of this segment.
    pub data_len: u32,
    /// The segment's acknowledgment number, with [`SEGMENT_ACK_EXACT`].
    pub ack_seq: u32,
    pub _pad: u32,
}

const _: () = {
    assert!(core::mem::size_of::<SegmentEvent>() == 56);
    assert!(core::mem::offset_of!(SegmentEvent, ack_seq) == 48);
    assert!(core::mem::align_of::<SegmentEvent>() == 8);
    assert!(core::mem::offset_of!(SegmentEvent, sk) == 8);
    assert!(core::mem::offset_of!(SegmentEvent, t_prev_ns) == 24);
    assert!(core::mem::offset_of!(SegmentEvent, snd_una) == 32);
    assert!(core::mem::offset_of!(SegmentEvent, data_len) == 44);
};

const _: () = {
    assert!(core::mem::size_of::<ConnEvent>() == 88);
    assert!(core::mem::offset_of!(ConnEvent, snd_nxt) == 80);
    assert!(core::mem::offset_of!(ConnEvent, sk) == 16);
    assert!(core::mem::offset_of!(ConnEvent, family) == 32);
    assert!(core::mem::offset_of!(ConnEvent, saddr) == 40);
    assert!(core::mem::size_of::<SockEvent>() == 56 + TAIL_BYTES + HEAD_BYTES);
    assert!(core::mem::offset_of!(SockEvent, bytes) == 32);
    assert!(core::mem::offset_of!(SockEvent, flags) == 48);
    assert!(core::mem::offset_of!(SockEvent, plain_bytes) == 52);
    assert!(core::mem::offset_of!(SockEvent, tail) == 56);
    assert!(core::mem::offset_of!(SockEvent, head) == 56 + TAIL_BYTES);
};

const _: () = {
    assert!(core::mem::size_of::<EpisodeEvent>() == 80);
    assert!(core::mem::align_of::<EpisodeEvent>() == 8);
    assert!(core::mem::offset_of!(EpisodeEvent, kind) == 0);
    assert!(core::mem::offset_of!(EpisodeEvent, status) == 20);
    assert!(core::mem::offset_of!(EpisodeEvent, stream) == 32);
    assert!(core::mem::offset_of!(EpisodeEvent, t_first_launch_ns) == 48);
    assert!(core::mem::offset_of!(EpisodeEvent, copy_bytes) == 72);
};
