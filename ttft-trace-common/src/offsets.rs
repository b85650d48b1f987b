//! Tracepoint field offsets, read by userspace from tracefs `format` files at
//! start and handed to the probes as a load-time global, so that no kernel
//! layout is hard-coded.

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TracepointOffsets {
    /// `sched:sched_process_fork`: `parent_pid`.
    pub fork_parent_pid: u32,
    /// `sched:sched_process_fork`: `child_pid`.
    pub fork_child_pid: u32,
    /// `sched:sched_process_exit`: `group_dead` (a one-byte flag), or
    /// [`ABSENT`] on kernels whose tracepoint lacks it (then a process is
    /// taken as gone when its leader thread exits).
    pub exit_group_dead: u32,
    pub _pad: u32,
}

/// Offset value meaning "this field does not exist on this kernel".
pub const ABSENT: u32 = u32::MAX;
