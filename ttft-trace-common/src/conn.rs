//! Kernel-side state of the socket probes (values of their maps).

/// `LISTEN_PORTS` value bits: the port is followed in every network
/// namespace (a `--port` of the user's, or a kernel whose namespace of a
/// socket cannot be read), or in the namespaces listed in `LISTEN_NETNS`.
pub const LISTEN_ANY_NETNS: u32 = 1;
pub const LISTEN_SOME_NETNS: u32 = 2;

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
    /// `snd_una` at the last `tcp_probe` on the socket.
    pub probe_snd_una: u32,
    /// TCP hook: the socket's `copied_seq` (what the server has read) as of
    /// the last receive reported, and the sequence number just past the
    /// last byte of the sends reported (`write_seq` plus what the last send
    /// was asked to queue). Sequence numbers, not counts of calls: a send's
    /// later steps, a retry after `EAGAIN` and the rest of a partial send
    /// add only bytes not reported before, and peeks none.
    pub recv_seq: u32,
    pub sent_seq: u32,
    pub _pad: u32,
    /// Time of the last `tcp_probe` on the socket (0: none yet).
    pub probe_t_ns: u64,
}

const _: () = {
    assert!(core::mem::size_of::<ConnState>() == 32);
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
