//! Kernel-side state of the socket probes (values of their maps).

/// Bytes in one element of the probes' byte arrays (`TRACED_IDS`,
/// `LISTEN_PORTS`): a page, so that userspace can map them.
pub const SLOT_BYTES: u32 = 4096;

/// `LISTEN_PORTS` holds two bytes per port (host order), at
/// [`listen_byte`]: whether the port is followed in every network
/// namespace (a `--port` of the user's, or a kernel whose namespace of a
/// socket cannot be read), and whether in the namespaces listed in
/// `LISTEN_NETNS`. Each writer stores its own byte whole, so that no flag a
/// concurrent writer (the kernel's `listen()` program, userspace's scan)
/// sets is lost.
pub const LISTEN_ANY_NETNS: u32 = 0;
pub const LISTEN_SOME_NETNS: u32 = 1;

/// Elements of `LISTEN_PORTS`: every port, two bytes each (128 KiB).
pub const LISTEN_PORT_SLOTS: u32 = (1 << 16) * 2 / SLOT_BYTES;

/// The byte of `LISTEN_PORTS` that holds `which` ([`LISTEN_ANY_NETNS`] or
/// [`LISTEN_SOME_NETNS`]) of `port`, counted from the array's start.
#[inline(always)]
pub const fn listen_byte(port: u16, which: u32) -> u32 {
    port as u32 * 2 + which
}

const _: () = assert!(listen_byte(u16::MAX, LISTEN_SOME_NETNS) < LISTEN_PORT_SLOTS * SLOT_BYTES);
// A port's two bytes share an element: the probes read both from one lookup.
const _: () = assert!(SLOT_BYTES.is_multiple_of(2));

/// Key of `LISTEN_NETNS`: a listening port in one network namespace (the
/// namespace's inode number, as `/proc/PID/ns/net` shows it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListenKey {
    pub netns: u32,
    pub port: u16,
    pub _pad: u16,
}

const _: () = assert!(core::mem::size_of::<ListenKey>() == 8);

/// Per-connection state in the kernel (value of the connections map).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnState {
    /// Sends since the last receive: the first
    /// [`crate::event::HEAD_SENDS`] carry the head of their buffer.
    pub sends_since_recv: u32,
    /// Whether the close was reported already.
    pub closed: u32,
    /// `snd_una` at the last segment seen on the socket.
    pub probe_snd_una: u32,
    /// TCP hook: the socket's `copied_seq` (what the server has read) as of
    /// the last receive reported, and the sequence number just past the
    /// last byte of the sends reported (`write_seq` plus what the last send
    /// was asked to queue). Sequence numbers, not counts of calls: a send's
    /// later steps, a retry after `EAGAIN` and the rest of a partial send
    /// add only bytes not reported before, and peeks none.
    pub recv_seq: u32,
    pub sent_seq: u32,
    /// Whether the connection was counted in `Stat::SegmentsUnseen`.
    pub unseen_counted: u32,
    /// Time of the last segment seen on the socket (0: none yet).
    pub probe_t_ns: u64,
    /// [`CONN_H2`] | [`CONN_TX_CHECKED`] | [`CONN_RX_CHECKED`] |
    /// [`CONN_TLS_LEFT_CONTROL`] | [`CONN_MIDLIFE`] (and its looks).
    pub h2: u32,
    /// Bytes of a TLS record matched in an earlier send (a memory BIO's,
    /// see [`HeldRecord`]) still to come in later sends: the next record
    /// begins that far into the next send.
    pub tls_record_left: u32,
}

/// [`ConnState::h2`]: the connection speaks HTTP/2; its walk state is in
/// `H2_CONNS`.
pub const CONN_H2: u32 = 1;
/// [`ConnState::h2`]: the server's first send was looked at (its SETTINGS
/// preface or not).
pub const CONN_TX_CHECKED: u32 = 2;
/// [`ConnState::h2`]: the client's first data segment was looked at (its
/// connection preface or not).
pub const CONN_RX_CHECKED: u32 = 4;
/// [`ConnState::h2`]: the record whose rest [`ConnState::tls_record_left`]
/// counts is TLS's own (`SOCK_TLS_CONTROL`), not a response's.
pub const CONN_TLS_LEFT_CONTROL: u32 = 8;
/// [`ConnState::h2`]: the connection was adopted mid-life (opened before
/// tracing began: a gRPC channel lives for days), so neither side's
/// preface will come: its calls are looked at for a frame header instead
/// ([`crate::h2::adoptable_header`]), up to [`CONN_ADOPT_LOOKS`] of them
/// both ways together, counted in bits 8 to 15.
pub const CONN_MIDLIFE: u32 = 16;
/// Calls looked at on a connection adopted mid-life before it is taken
/// for one that does not speak HTTP/2 (its first calls may start inside a
/// frame: a message longer than a segment, a partial write's rest).
pub const CONN_ADOPT_LOOKS: u32 = 32;
const CONN_LOOKS_SHIFT: u32 = 8;

/// The flags of a connection after one of its calls was looked at for
/// HTTP/2 and found none (`checked`: [`CONN_TX_CHECKED`] or
/// [`CONN_RX_CHECKED`]): that direction is done with, unless the
/// connection was adopted mid-life and has looks left; after the last
/// both directions are.
#[inline(always)]
pub fn looked_at(flags: u32, checked: u32) -> u32 {
    if flags & CONN_MIDLIFE == 0 {
        return flags | checked;
    }
    let looks = ((flags >> CONN_LOOKS_SHIFT) & 0xff) + 1;
    if looks >= CONN_ADOPT_LOOKS {
        flags | CONN_TX_CHECKED | CONN_RX_CHECKED
    } else {
        (flags & !(0xff << CONN_LOOKS_SHIFT)) | (looks << CONN_LOOKS_SHIFT)
    }
}

const _: () = {
    assert!(core::mem::size_of::<ConnState>() == 40);
    assert!(core::mem::offset_of!(ConnState, recv_seq) == 12);
    assert!(core::mem::offset_of!(ConnState, probe_t_ns) == 24);
};

/// The user buffer of a send: noted per thread where a send syscall starts
/// and read where the send ends (`sock_send_length`, the syscall hook), or
/// read at once from the kernel's iterator (`tcp_sendmsg_locked`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendArgs {
    /// A plain buffer (`write`, `sendto`, or any send whose kernel iterator
    /// is a single user buffer), or 0.
    pub buf: u64,
    /// An iovec array (`writev`, `sendmsg`), or 0.
    pub iov: u64,
    /// Entries in `iov`.
    pub iovlen: u64,
    /// Bytes of the first iovec already sent before the send began (the
    /// kernel iterator's `iov_offset`; 0 on the syscall path).
    pub iov_offset: u64,
    /// Non-zero: `iov` is the kernel's copy of the iovec array (read with
    /// `bpf_probe_read_kernel`), not the user's.
    pub iov_kernel: u32,
    pub _pad: u32,
}

impl SendArgs {
    /// No buffer read.
    pub const NONE: SendArgs = SendArgs {
        buf: 0,
        iov: 0,
        iovlen: 0,
        iov_offset: 0,
        iov_kernel: 0,
        _pad: 0,
    };

    /// The buffer, where one was read (a plain buffer or an iovec array).
    #[inline(always)]
    pub fn read(self) -> Option<SendArgs> {
        (self.buf != 0 || self.iov != 0).then_some(self)
    }
}

/// [`TlsCall::what`]: `SSL_write` or `SSL_write_ex`.
pub const TLS_CALL_WRITE: u32 = 1;
/// [`TlsCall::what`]: `SSL_read` (an int result: 0 only at the peer's
/// close).
pub const TLS_CALL_READ: u32 = 2;
/// [`TlsCall::what`]: `SSL_read_ex` (0 for any failure, a wait for more
/// bytes included).
pub const TLS_CALL_READ_EX: u32 = 4;
/// [`TlsCall::what`]: the handshake or a shutdown.
pub const TLS_CALL_CONTROL: u32 = 3;

/// The TLS call a traced thread is in, kept from its entry to its return.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TlsCall {
    /// The call's `SSL *`.
    pub ssl: u64,
    /// The call's plaintext buffer (`SSL_write`'s source; `SSL_read_ex`'s
    /// count of bytes read), or 0.
    pub buf: u64,
    /// Its length.
    pub len: u64,
    /// Bytes the call sent (a write) or received (a read) on followed
    /// connections so far (the wire's).
    pub wire: u64,
    /// Plaintext bytes of a write's sends so far ([`SockEvent`]'s
    /// `plain_bytes`).
    ///
    /// [`SockEvent`]: crate::SockEvent
    pub plain_sent: u64,
    /// A read's connection, and when its first bytes were received: the
    /// receive is reported at the call's return, when its result tells a
    /// request's bytes from TLS's own (a `close_notify`).
    pub sk: u64,
    pub t_first_ns: u64,
    /// `TLS_CALL_*`.
    pub what: u32,
    /// Non-zero once a send of the call carried the plaintext's tail.
    pub tail_given: u32,
    /// Wire bytes of the records the call wrote to a memory BIO so far
    /// (held in `TLS_RECORDS` for a send after the call), and of its
    /// plaintext given to them (as `wire` and `plain_sent` for a socket
    /// BIO's sends).
    pub held: u64,
    pub plain_held: u64,
    /// The calling process: an entry left by a thread that died in a call
    /// is never taken for a later thread's of that id in another process.
    pub tgid: u32,
    pub _pad: u32,
}

const _: () = {
    assert!(core::mem::size_of::<TlsCall>() == 88);
    assert!(core::mem::offset_of!(TlsCall, what) == 56);
    assert!(core::mem::offset_of!(TlsCall, held) == 64);
};

/// Key of `TLS_SOCKETS`: an `SSL *` of a process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TlsKey {
    pub ssl: u64,
    pub tgid: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<TlsKey>() == 16);

/// Bytes of a TLS record's start that identify it: its header (5) and
/// what follows (ciphertext, or TLS 1.2's explicit nonce, then
/// ciphertext), no more than the record holds.
pub const RECORD_KEY_BYTES: usize = 24;

/// Key of `TLS_RECORDS`: the first bytes of a record a process wrote to a
/// memory BIO (see [`HeldRecord`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordKey {
    pub tgid: u32,
    /// Bytes of `bytes` taken (`RECORD_KEY_BYTES`, or the whole record
    /// where it is shorter); the rest are zero.
    pub len: u32,
    pub bytes: [u8; RECORD_KEY_BYTES],
}

const _: () = assert!(core::mem::size_of::<RecordKey>() == 32);

/// A TLS record that a TLS call wrote to a memory BIO (CPython's `ssl`
/// under asyncio, gRPC's core): the process sends it later, outside the
/// call, and the TCP send whose bytes begin with its [`RecordKey`] is the
/// one that carried it. What the send event is to show of the call's
/// plaintext is kept here, read while the call's buffer was valid.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldRecord {
    /// The call's `SSL *`: bound to the connection the record is sent on.
    pub ssl: u64,
    /// The record's bytes on the wire, its header included.
    pub wire: u32,
    /// Plaintext bytes the record is counted to carry (`plain_bytes`).
    pub plain: u32,
    /// `SOCK_TLS_PLAIN` (a data call's record) or `SOCK_TLS_CONTROL`.
    pub flags: u32,
    pub head_len: u32,
    pub tail_len: u32,
    /// Non-zero on the call's first record (`Stat::TlsHeldSent` counts
    /// calls).
    pub first: u32,
    /// The head of the call's plaintext (its first record only) and its
    /// tail (the record completing the call's plaintext).
    pub head: [u8; crate::event::HEAD_BYTES],
    pub tail: [u8; crate::event::TAIL_BYTES],
}

const _: () = {
    assert!(core::mem::size_of::<HeldRecord>() == 32 + 256 + 64);
    assert!(core::mem::offset_of!(HeldRecord, head) == 32);
};
