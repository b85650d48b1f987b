//! Tracepoint field offsets, read by userspace from tracefs `format` files at
//! start and handed to the probes as a load-time global, so that no kernel
//! layout is hard-coded.

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TracepointOffsets {
    /// `sched:sched_process_fork`: `child_pid`.
    pub fork_child_pid: u32,
    /// `sched:sched_process_exit`: `group_dead` (a one-byte flag), or
    /// [`ABSENT`] on kernels whose tracepoint lacks it (then a process is
    /// taken as gone when its leader thread exits).
    pub exit_group_dead: u32,
    /// `sock:inet_sock_set_state` fields.
    pub state_skaddr: u32,
    pub state_oldstate: u32,
    pub state_newstate: u32,
    pub state_sport: u32,
    pub state_dport: u32,
    pub state_family: u32,
    pub state_saddr: u32,
    pub state_daddr: u32,
    pub state_saddr_v6: u32,
    pub state_daddr_v6: u32,
    /// `sock:sock_recv_length` and `sock:sock_send_length` (same layout).
    pub len_sk: u32,
    pub len_ret: u32,
    pub len_flags: u32,
    /// `syscalls:sys_enter_write`: `buf`.
    pub write_buf: u32,
    /// `syscalls:sys_enter_sendto`: `buff`.
    pub sendto_buf: u32,
    /// `syscalls:sys_enter_writev`: `vec` and `vlen`.
    pub writev_vec: u32,
    pub writev_vlen: u32,
    /// `syscalls:sys_enter_sendmsg`: `msg`.
    pub sendmsg_msg: u32,
    /// `sched:sched_switch`: `prev_state` and `next_pid`.
    pub switch_prev_state: u32,
    pub switch_next_pid: u32,
    /// `sched:sched_wakeup` and `sched:sched_wakeup_new`: `pid`.
    pub wakeup_pid: u32,
    /// `tcp:tcp_retransmit_skb`, `tcp:tcp_receive_reset`, `tcp:tcp_send_reset`: `skaddr`.
    pub retransmit_sk: u32,
    pub reset_received_sk: u32,
    pub reset_sent_sk: u32,
    /// `tcp:tcp_probe` fields.
    pub probe_sk: u32,
    pub probe_data_len: u32,
    pub probe_snd_nxt: u32,
    pub probe_snd_una: u32,
    pub probe_srtt: u32,
    /// Local and remote ports (host order), family, and local and remote
    /// `sockaddr_in`/`sockaddr_in6`: to adopt a connection opened before
    /// tracing began.
    pub probe_sport: u32,
    pub probe_dport: u32,
    pub probe_family: u32,
    pub probe_saddr: u32,
    pub probe_daddr: u32,
    /// `tcp:tcp_probe`: `skbaddr` (the segment), or [`ABSENT`] on kernels
    /// whose tracepoint lacks it.
    pub probe_skb: u32,
    /// Offset of the acknowledgment number in a received `struct sk_buff`
    /// (`cb` + `struct tcp_skb_cb`'s `ack_seq`, from BTF), or [`ABSENT`]:
    /// without it, what a segment acknowledged shows at the next one.
    pub skb_ack_seq: u32,
    /// Offset of the network namespace pointer in a `struct sock`
    /// (`__sk_common.skc_net`), and of its inode number in `struct net`
    /// (`ns.inum`), from BTF, or [`ABSENT`]: without them, listening ports
    /// are matched in every namespace.
    pub sk_net: u32,
    pub net_inum: u32,
}

/// Offset value meaning "this field does not exist on this kernel".
pub const ABSENT: u32 = u32::MAX;

/// Kernel struct member offsets (bytes) and enum values that the TCP hook
/// needs: the `tcp:tcp_sendmsg_locked` raw tracepoint finds the user buffer
/// of a send in its `struct msghdr *`, and it and `tcp:tcp_rcv_space_adjust`
/// read the socket's sequence numbers. Read by userspace from the kernel's BTF
/// at load time (there is no CO-RE for Rust eBPF); when they cannot be read
/// the syscall tracepoints are used instead. `struct iovec` is taken as the
/// user ABI's (`iov_base` at 0, `iov_len` at 8, 16 bytes), which userspace
/// checks against the BTF too.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendOffsets {
    /// `struct msghdr`: `msg_iter`.
    pub msg_iter: u32,
    /// `struct iov_iter`: `iter_type` (one byte), `iov_offset`, `ubuf` (the
    /// same union slot as `__iov`), `__iov`, `count`, `nr_segs`.
    pub iter_type: u32,
    pub iov_offset: u32,
    pub ubuf: u32,
    pub iov: u32,
    pub count: u32,
    pub nr_segs: u32,
    /// `enum iter_type`: `ITER_UBUF` and `ITER_IOVEC`.
    pub iter_ubuf: u32,
    pub iter_iovec: u32,
    /// `struct tcp_sock` (whose first member is the `struct sock`):
    /// `copied_seq` (the next byte the application reads) and `write_seq`
    /// (just past the last byte it queued), both 4-byte sequence numbers.
    pub copied_seq: u32,
    pub write_seq: u32,
}

/// Kernel struct member offsets the raw tracepoint `tcp:tcp_probe` needs:
/// its arguments are the `struct sock *` and the received `struct sk_buff
/// *`, and the program reads from them what the classic tracepoint's perf
/// record would hold, for followed connections only. Read by userspace from
/// the kernel's BTF at load time, with the prototype checked; without them
/// the classic tracepoint is used.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentOffsets {
    /// `struct tcp_sock` (which begins with its `struct sock`): `snd_nxt`,
    /// `snd_una` and `srtt_us` (the smoothed round trip, µs << 3), 4 bytes
    /// each.
    pub snd_nxt: u32,
    pub snd_una: u32,
    pub srtt_us: u32,
    /// `struct sock` (which begins with its `struct sock_common`):
    /// `skc_family`, `skc_num` (the local port, host order) and `skc_dport`
    /// (the remote port, network order), 2 bytes each; `skc_rcv_saddr` and
    /// `skc_daddr` (IPv4, 4 bytes), `skc_v6_rcv_saddr` and `skc_v6_daddr`
    /// (16 bytes): to adopt a connection opened before tracing began.
    pub family: u32,
    pub num: u32,
    pub dport: u32,
    pub rcv_saddr: u32,
    pub daddr: u32,
    pub v6_rcv_saddr: u32,
    pub v6_daddr: u32,
    /// `struct sk_buff`: the `struct tcp_skb_cb` in its `cb`: `seq`,
    /// `end_seq` and `ack_seq` (4 bytes, host order, filled before
    /// `tcp_rcv_established`) and `tcp_flags` (1 byte). The segment's data
    /// length is `end_seq - seq`, less one for a SYN or a FIN.
    pub skb_seq: u32,
    pub skb_end_seq: u32,
    pub skb_ack_seq: u32,
    pub skb_tcp_flags: u32,
}

// --- Raw tracepoints for the per-event hot path (scheduler, socket lengths) ---

/// Kernel struct member offsets the raw tracepoints `sched_switch`,
/// `sched_wakeup` and `sched_wakeup_new` need: their arguments are
/// `struct task_struct *`, whose thread id the probes read. Read by
/// userspace from the kernel's BTF at load time, with each tracepoint's
/// prototype checked; without them the classic tracepoints are used.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskOffsets {
    /// `struct task_struct`: `pid` (the thread id, a 4-byte `pid_t`).
    pub pid: u32,
    /// `struct task_struct`: `sched_info.last_queued` (when the task was
    /// put on its run queue, 0 once it runs) and `sched_info.last_arrival`
    /// (when it last got the CPU), 8-byte times of the run queue's clock
    /// (CONFIG_SCHED_INFO), or [`ABSENT`]. With them the switch program
    /// tells when a sleeping thread was woken without a wakeup program
    /// (see the eBPF crate's `sched.rs`).
    pub last_queued: u32,
    pub last_arrival: u32,
}

impl TaskOffsets {
    /// Whether the switch program reads wakeups from `sched_info`.
    pub fn has_sched_info(&self) -> bool {
        self.last_queued != ABSENT && self.last_arrival != ABSENT
    }
}

// SAFETY: `#[repr(C)]`, `Copy`, integers only: any bit pattern is valid.
#[cfg(feature = "user")]
unsafe impl aya::Pod for TaskOffsets {}

// SAFETY: as above.
#[cfg(feature = "user")]
unsafe impl aya::Pod for SegmentOffsets {}

// The eBPF side and userspace agree on these bytes: 4-byte fields, no
// padding.
const _: () = assert!(core::mem::size_of::<SegmentOffsets>() == 14 * 4);
const _: () = assert!(core::mem::size_of::<TaskOffsets>() == 3 * 4);
