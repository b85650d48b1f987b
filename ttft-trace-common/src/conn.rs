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
}

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
