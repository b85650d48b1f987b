//! Process discovery in daemon mode: an untraced process calling into a CUDA
//! library that already carries our uprobes is announced once, so userspace
//! can decide (filters) and start tracing it without waiting for a /proc scan.

/// Tag of [`DiscoverEvent`]. Numbered apart from the signal events so that
/// event kinds added elsewhere do not collide.
pub const EVENT_DISCOVER: u32 = 16;

/// An untraced process made a CUDA call through a probed library.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiscoverEvent {
    /// [`EVENT_DISCOVER`].
    pub kind: u32,
    pub tgid: u32,
    /// Entry of the call (`bpf_ktime_get_ns`).
    pub t_ns: u64,
}

const _: () = {
    assert!(core::mem::size_of::<DiscoverEvent>() == 16);
    assert!(core::mem::offset_of!(DiscoverEvent, tgid) == 4);
    assert!(core::mem::offset_of!(DiscoverEvent, t_ns) == 8);
};
