//! Kernel-side state of the socket probes (values of their maps).

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
    pub _pad: u32,
    /// Time of the last `tcp_probe` on the socket (0: none yet).
    pub probe_t_ns: u64,
}

const _: () = {
    assert!(core::mem::size_of::<ConnState>() == 24);
    assert!(core::mem::offset_of!(ConnState, probe_t_ns) == 16);
};

/// The user buffer of a send syscall in progress.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendArgs {
    /// A plain buffer (`write`, `sendto`), or 0.
    pub buf: u64,
    /// An iovec array (`writev`, `sendmsg`), or 0.
    pub iov: u64,
    /// Entries in `iov`.
    pub iovlen: u64,
}
