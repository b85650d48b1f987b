//! Ring-buffer events. Each starts with a `kind` tag so that later event
//! types can share the buffer.

/// Tag of [`EpisodeEvent`].
pub const EVENT_EPISODE: u32 = 1;

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

const _: () = {
    assert!(core::mem::size_of::<EpisodeEvent>() == 80);
    assert!(core::mem::align_of::<EpisodeEvent>() == 8);
    assert!(core::mem::offset_of!(EpisodeEvent, kind) == 0);
    assert!(core::mem::offset_of!(EpisodeEvent, status) == 20);
    assert!(core::mem::offset_of!(EpisodeEvent, stream) == 32);
    assert!(core::mem::offset_of!(EpisodeEvent, t_first_launch_ns) == 48);
    assert!(core::mem::offset_of!(EpisodeEvent, copy_bytes) == 72);
};
