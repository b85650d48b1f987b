//! Processes announced to userspace without waiting for a /proc scan: in
//! daemon mode an untraced process calling into a CUDA library that already
//! carries our uprobes (once), so userspace can decide (filters) and start
//! tracing it; in attach mode each child a traced process forks, so that its
//! uprobes (bound to each traced process) are attached at once.

/// Tag of [`DiscoverEvent`]. Numbered apart from the signal events so that
/// event kinds added elsewhere do not collide.
pub const EVENT_DISCOVER: u32 = 16;

/// An untraced process made a CUDA call through a probed library
/// (daemon), or a traced process forked this child or thread (attach).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiscoverEvent {
    /// [`EVENT_DISCOVER`].
    pub kind: u32,
    pub tgid: u32,
    /// Entry of the call, or the fork (`bpf_ktime_get_ns`).
    pub t_ns: u64,
}

const _: () = {
    assert!(core::mem::size_of::<DiscoverEvent>() == 16);
    assert!(core::mem::offset_of!(DiscoverEvent, tgid) == 4);
    assert!(core::mem::offset_of!(DiscoverEvent, t_ns) == 8);
};
