//! Types shared by the eBPF probes and the userspace daemon.
//!
//! Everything here is `no_std`, `#[repr(C)]` with explicit padding and no
//! `bool`, so that the kernel side and userspace agree on the bytes. The
//! episode state machine lives here too: the probes run it in the kernel and
//! the unit tests run the very same code on the host.
#![no_std]

pub mod conn;
pub mod counters;
pub mod episode;
pub mod event;
pub mod h2;
pub mod offsets;
pub mod process;
pub mod signals;

pub use conn::{
    CONN_ADOPT_LOOKS, CONN_H2, CONN_MIDLIFE, CONN_RX_CHECKED, CONN_TLS_LEFT_CONTROL,
    CONN_TX_CHECKED, ConnState, HeldRecord, LISTEN_ANY_NETNS, LISTEN_PORT_SLOTS, LISTEN_SOME_NETNS,
    ListenKey, RECORD_KEY_BYTES, RecordKey, SLOT_BYTES, SendArgs, TLS_CALL_CONTROL, TLS_CALL_READ,
    TLS_CALL_READ_EX, TLS_CALL_WRITE, TlsCall, TlsKey, listen_byte,
};
pub use counters::{Direction, GpuCounters, MAP_FULL_STATS, QUOTA_LISTENERS, QUOTA_THREADS, Stat};
pub use episode::{Completion, ThreadState, launch_key};
pub use event::{
    API_DRIVER, API_RUNTIME, CONN_CLOSE, CONN_OPEN, CONN_STATE, ConnEvent, EVENT_CONN,
    EVENT_EPISODE, EVENT_SEGMENT, EVENT_SOCK, EpisodeEvent, SEGMENT_ACK_EXACT, SEGMENT_ACKED,
    SEGMENT_DATA, SOCK_RECV, SOCK_SEND, SOCK_TLS_BUFFERED, SOCK_TLS_CONTROL, SOCK_TLS_PLAIN,
    SegmentEvent, SockEvent,
};
pub use offsets::{SendOffsets, TracepointOffsets};

/// Implements `aya::Pod` for the types userspace reads from maps and the ring
/// buffer. Only with the `user` feature: the eBPF side does not link aya.
#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type below is `#[repr(C)]`, `Copy`, made only of integers
    // with explicit padding fields, so any bit pattern is a valid value.
    unsafe impl aya::Pod for crate::EpisodeEvent {}
    unsafe impl aya::Pod for crate::ConnEvent {}
    unsafe impl aya::Pod for crate::SockEvent {}
    unsafe impl aya::Pod for crate::SegmentEvent {}
    unsafe impl aya::Pod for crate::h2::H2FramesEvent {}
    unsafe impl aya::Pod for crate::h2::H2BlockEvent {}
    unsafe impl aya::Pod for crate::h2::H2State {}
    unsafe impl aya::Pod for crate::signals::SchedEvent {}
    unsafe impl aya::Pod for crate::signals::TcpEvent {}
    unsafe impl aya::Pod for crate::signals::CopyEvent {}
    unsafe impl aya::Pod for crate::process::DiscoverEvent {}
    unsafe impl aya::Pod for crate::signals::SchedTotals {}
    unsafe impl aya::Pod for crate::GpuCounters {}
    unsafe impl aya::Pod for crate::TracepointOffsets {}
    unsafe impl aya::Pod for crate::SendOffsets {}
    unsafe impl aya::Pod for crate::ListenKey {}
    unsafe impl aya::Pod for crate::ThreadState {}
}
