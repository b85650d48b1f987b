//! Maps and load-time globals, all in one place (as in libbpf-tools).

use aya_ebpf::{
    bindings::{
        BPF_F_MMAPABLE, BPF_F_NO_PREALLOC, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP,
    },
    macros::map,
    maps::{Array, HashMap, LruHashMap, LruPerCpuHashMap, PerCpuArray, ProgramArray, RingBuf},
};
use ttft_trace_common::{
    ConnState, GpuCounters, HeldRecord, LISTEN_PORT_SLOTS, ListenKey, RecordKey, SLOT_BYTES,
    SendArgs, ThreadState, TlsCall, TlsKey, TracepointOffsets,
    counters::STATS,
    event::{HEAD_BYTES, TAIL_BYTES},
    offsets::SegmentOffsets,
    offsets::{ABSENT, TaskOffsets},
    signals::{RUNQ_BUCKETS, SchedState, SchedTotals},
};

/// Episode events to userspace. Size set by userspace at load time.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

/// Traced processes (and threads, between fork and exit): tgid -> workload
/// id (the tgid of the workload's root process). Filled by userspace for the
/// targets, and by the fork tracepoint for their children, which inherit the
/// parent's workload: one loaded set of programs serves every workload.
#[map]
pub static TRACKED: HashMap<u32, u32> = HashMap::with_max_entries(16384, 0);

/// Workloads whose tenant (pod or cgroup) holds its share of a host-wide
/// map: workload id -> `QUOTA_*` bits. Set by userspace at each scan; a
/// `listen()` or a fork of such a workload is refused here, so that one
/// tenant cannot fill `LISTEN_NETNS` or `TRACKED` for the others. Sized
/// as `TRACKED` (every workload fits), allocated as it fills.
#[map]
pub static OVER_SHARE: HashMap<u32, u32> = HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// Whether workload `workload`'s tenant holds its share of resource `bit`.
#[inline(always)]
pub fn over_share(workload: u32, bit: u32) -> bool {
    // SAFETY: the value is copied out of the map.
    unsafe { OVER_SHARE.get(workload) }.is_some_and(|bits| bits & bit != 0)
}

/// Per-thread episode state, keyed by tid. LRU so that threads whose exit we
/// missed cannot fill it.
#[map]
pub static THREADS: LruHashMap<u32, ThreadState> = LruHashMap::with_max_entries(65536, 0);

/// Per-process GPU API counters, keyed by tgid, one copy per CPU (no atomics
/// on this target). Userspace sums the CPUs and deletes entries of processes
/// that have exited.
#[map]
pub static COUNTERS: LruPerCpuHashMap<u32, GpuCounters> =
    LruPerCpuHashMap::with_max_entries(1024, 0);

/// Traced processes that have exited: tgid -> workload id, so that
/// userspace can still route the events they sent just before exiting
/// (read from the ring buffer after the exit). LRU: bounded.
#[map]
pub static EXITED: LruHashMap<u32, u32> = LruHashMap::with_max_entries(4096, 0);

/// Untraced processes already announced to userspace (daemon mode), so
/// that each is announced once: tgid -> time announced. LRU: bounded.
#[map]
pub static ANNOUNCED: LruHashMap<u32, u64> = LruHashMap::with_max_entries(4096, 0);

/// Listening ports of the traced tree (host byte order): a connection
/// accepted on one of them is a server connection. Set by userspace (ports
/// listening at start, `--port`) and by `inet_sock_set_state` on
/// `listen()`; two bytes per port, in which network namespaces it is
/// followed (see [`ttft_trace_common::listen_byte`]). An array, not a hash:
/// every TCP segment on the host is checked here, and an array lookup is a
/// load the verifier inlines where a hash lookup is a helper call. Every
/// port fits: nothing to refuse.
#[map]
pub static LISTEN_PORTS: Array<[u8; SLOT_BYTES as usize]> =
    Array::with_max_entries(LISTEN_PORT_SLOTS, BPF_F_MMAPABLE);

/// The (network namespace, port) pairs of `LISTEN_SOME_NETNS` ports: another
/// namespace's server on the same port number is not followed.
#[map]
pub static LISTEN_NETNS: HashMap<ListenKey, u32> = HashMap::with_max_entries(4096, 0);

/// Followed listening ports whose handshakes were seen at a cgroup's
/// ingress (the segment program's): port -> 1. A followed connection read
/// with none of its segments seen, on a port not here, had its listening
/// socket outside those cgroups. LRU: bounded, and a port evicted is put
/// back at its next handshake.
#[map]
pub static INGRESS_LISTENERS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(1024, 0);

/// Server connections being followed, keyed by socket address.
#[map]
pub static CONNS: LruHashMap<u64, ConnState> = LruHashMap::with_max_entries(65536, 0);

/// HTTP/2 frame walk state of the followed connections that speak it
/// (`h2.rs`), keyed by socket address; removed with the connection. LRU:
/// a connection evicted here loses its place in the walk (its next calls
/// resync), never another's.
#[map]
pub static H2_CONNS: LruHashMap<u64, ttft_trace_common::h2::H2State> =
    LruHashMap::with_max_entries(16384, 0);

/// Buffer of the send in progress on a thread, kept from where it starts
/// (`tcp_sendmsg_locked`, or a send syscall's `sys_enter`) for
/// `sock_send_length` to read the bytes.
#[map]
pub static SEND_ARGS: LruHashMap<u32, SendArgs> = LruHashMap::with_max_entries(16384, 0);

/// The TLS call a traced thread is in (`tls.rs`), keyed by tid: set at the
/// call's entry, removed at its return. LRU: a thread that dies inside a
/// call leaves an entry that the next ones push out.
#[map]
pub static TLS_CALLS: LruHashMap<u32, TlsCall> = LruHashMap::with_max_entries(16384, 0);

/// The connection each `SSL *` of the traced processes last moved bytes on
/// inside a call (`tls.rs`): where a read served from OpenSSL's buffer
/// belongs. LRU: an `SSL` freed is pushed out by the next.
#[map]
pub static TLS_SOCKETS: LruHashMap<TlsKey, u64> = LruHashMap::with_max_entries(16384, 0);

/// Records the TLS calls of the traced processes wrote to a memory BIO,
/// keyed by their first bytes, until the TCP send that carries them
/// (`tls_records.rs`). LRU: records never sent (or sent on a connection
/// not followed) are pushed out by the next; what is never matched shows
/// as `Stat::TlsHeld` less `Stat::TlsHeldSent`.
#[map]
pub static TLS_RECORDS: LruHashMap<RecordKey, HeldRecord> = LruHashMap::with_max_entries(4096, 0);

/// Processes whose `SSL_write` returned having neither sent on a followed
/// connection nor held a record: a memory BIO whose `BIO_write` is not
/// probed yet. Userspace probes that process's `libcrypto` then, so that a
/// socket BIO's server never takes the trap. LRU: bounded.
#[map]
pub static TLS_MEMORY_BIO: LruHashMap<u32, u32> = LruHashMap::with_max_entries(1024, 0);

/// Processes that held a record in `TLS_RECORDS`: only their sends outside
/// a TLS call are looked up there. LRU: bounded.
#[map]
pub static TLS_HOLDERS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(1024, 0);

/// Room to build a [`HeldRecord`] (too big for the stack).
#[map]
pub static HOLD_SCRATCH: PerCpuArray<HeldRecord> = PerCpuArray::with_max_entries(1, 0);

/// What a send's walk of held records gathered (`tls_records.rs`), read
/// by its event (`sock_event.rs`).
#[repr(C)]
pub struct SendRecords {
    /// The piece of the send's buffer where the first new record begins,
    /// and its bytes of the send.
    pub base: u64,
    pub room: u64,
    /// Bytes walked from `base`.
    pub at: u64,
    /// Plaintext bytes of the records matched.
    pub plain: u64,
    /// The first record's `SOCK_TLS_*` flags (0: none matched).
    pub flags: u32,
    /// Whether the last record matched is TLS's own.
    pub last_control: u32,
    pub head_len: u32,
    pub tail_len: u32,
    pub head: [u8; HEAD_BYTES],
    pub tail: [u8; TAIL_BYTES],
}

#[map]
pub static SEND_RECORDS: PerCpuArray<SendRecords> = PerCpuArray::with_max_entries(1, 0);

/// Where a vectored send's head and tail are gathered across its buffers
/// before they are copied into its event (`sock_event.rs`): twice the
/// head, so that every piece's offset and length are bounded apart.
#[map]
pub static SEND_GATHER: PerCpuArray<[u8; 2 * HEAD_BYTES]> = PerCpuArray::with_max_entries(1, 0);

/// The program a send that may carry held records is handed to
/// (`tls_records::hand_over`): one per program type, as a tail call stays
/// within its type; the raw tracepoints' hooks and the classic one. Set by
/// userspace at load; an empty slot leaves the send reported as it is.
#[map]
pub static HELD_SEND_RAW: ProgramArray = ProgramArray::with_max_entries(1, 0);
#[map]
pub static HELD_SEND_TP: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// A send handed to the held-record programs: what its hook read of it,
/// and the view its event has where it carries no held record. Every
/// field is defined (see `sock_event::SendView::args`).
#[derive(Clone, Copy)]
pub struct HeldSend {
    pub sk: u64,
    /// Bytes at the buffer's start reported before, and the new ones.
    pub skip: u64,
    pub bytes: u64,
    /// The send's buffer (all zero: none read).
    pub args: SendArgs,
    /// The plain view's head and span (`SendView`).
    pub head: u64,
    pub span: u64,
    /// The send's result as its event reports it.
    pub ret: i32,
    /// Sends since the last receive on the connection.
    pub sends: u32,
}

/// The send handed over, per CPU (the tail call keeps the CPU).
#[map]
pub static HELD_SEND: PerCpuArray<HeldSend> = PerCpuArray::with_max_entries(1, 0);

/// Scheduler state of the traced threads, keyed by tid. Created when a
/// traced thread first switches out; LRU bounds the threads we miss exiting.
#[map]
pub static SCHED_STATE: LruHashMap<u32, SchedState> = LruHashMap::with_max_entries(65536, 0);

/// Ids that may be traced: one byte per process or thread id, in elements
/// of [`SLOT_BYTES`] ids, set before the id goes into [`TRACKED`] (by
/// userspace, through a shared mapping, or by the fork program) or into
/// [`SCHED_STATE`], cleared when it exits. Every program that runs for
/// untraced tasks too reads it before any hash lookup: an array read the
/// verifier inlines, where a hash lookup costs tens of ns. An id past the
/// end (`pid_max` raised after load) is looked up in the hash. Each byte is
/// written whole (no read-modify-write of a neighbour's flag). Userspace
/// sizes it to `pid_max` at load; the default covers `PID_MAX_LIMIT` (4 MiB).
#[map]
pub static TRACED_IDS: Array<[u8; SLOT_BYTES as usize]> =
    Array::with_max_entries(1024, BPF_F_MMAPABLE);

/// Whether `id` may be traced (in TRACKED, or with scheduler state); false
/// only when it is surely not.
#[inline(always)]
pub fn may_be_traced(id: u32) -> bool {
    match TRACED_IDS.get(id / SLOT_BYTES) {
        Some(slot) => slot[(id % SLOT_BYTES) as usize] != 0,
        None => true,
    }
}

#[inline(always)]
pub fn mark_traced(id: u32, traced: bool) {
    if let Some(slot) = TRACED_IDS.get_ptr_mut(id / SLOT_BYTES) {
        // SAFETY: the byte of this id in a live map value.
        unsafe { (*slot)[(id % SLOT_BYTES) as usize] = u8::from(traced) };
    }
}

/// Per-process scheduler totals, keyed by tgid, one copy per CPU.
#[map]
pub static SCHED_TOTALS: LruPerCpuHashMap<u32, SchedTotals> =
    LruPerCpuHashMap::with_max_entries(1024, 0);

/// Run-queue delay histogram of the traced threads: log2 ns buckets, then
/// the sum in ns (slot `RUNQ_SUM_SLOT`).
#[map]
pub static RUNQ_HIST: PerCpuArray<u64> = PerCpuArray::with_max_entries(RUNQ_BUCKETS + 1, 0);

/// Global statistics ([`ttft_trace_common::Stat`] indexes).
#[map]
pub static STATS_MAP: PerCpuArray<u64> = PerCpuArray::with_max_entries(STATS, 0);

/// Kernel struct offsets for the raw `tcp_probe` program (and the
/// handshake's `snd_nxt` in `sock.rs`), set by userspace from the kernel's
/// BTF at load time; all 0 where it is not loaded.
#[unsafe(no_mangle)]
pub static SEGMENT_OFFSETS: SegmentOffsets = SegmentOffsets {
    snd_nxt: 0,
    snd_una: 0,
    srtt_us: 0,
    family: 0,
    num: 0,
    dport: 0,
    rcv_saddr: 0,
    daddr: 0,
    v6_rcv_saddr: 0,
    v6_daddr: 0,
    skb_seq: 0,
    skb_end_seq: 0,
    skb_ack_seq: 0,
    skb_tcp_flags: 0,
};

/// Tracepoint field offsets, set by userspace from tracefs at load time.
#[unsafe(no_mangle)]
pub static OFFSETS: TracepointOffsets = TracepointOffsets {
    fork_child_pid: 0,
    exit_group_dead: 0,
    state_skaddr: 0,
    state_oldstate: 0,
    state_newstate: 0,
    state_sport: 0,
    state_dport: 0,
    state_family: 0,
    state_saddr: 0,
    state_daddr: 0,
    state_saddr_v6: 0,
    state_daddr_v6: 0,
    len_sk: 0,
    len_ret: 0,
    len_flags: 0,
    write_buf: 0,
    sendto_buf: 0,
    writev_vec: 0,
    writev_vlen: 0,
    sendmsg_msg: 0,
    switch_prev_state: 0,
    switch_next_pid: 0,
    wakeup_pid: 0,
    retransmit_sk: 0,
    reset_received_sk: 0,
    reset_sent_sk: 0,
    probe_sk: 0,
    probe_data_len: 0,
    probe_snd_nxt: 0,
    probe_snd_una: 0,
    probe_srtt: 0,
    probe_sport: 0,
    probe_dport: 0,
    probe_family: 0,
    probe_saddr: 0,
    probe_daddr: 0,
    probe_skb: 0,
    skb_ack_seq: 0,
    sk_net: 0,
    net_inum: 0,
};

/// `struct task_struct` offsets for the BTF scheduler tracepoints, set by
/// userspace from the kernel's BTF at load time.
#[unsafe(no_mangle)]
pub static TASK_OFFSETS: TaskOffsets = TaskOffsets {
    pid: 0,
    last_queued: ABSENT,
    last_arrival: ABSENT,
};

/// Per CPU, one moment dated on both clocks the switch program sees:
/// `bpf_ktime_get_ns` and the run queue's clock (`sched_info` times), taken
/// where a traced thread switched in (see `sched.rs`). Entry 0: the
/// `ktime` (0: none yet), entry 1: the run queue's clock.
#[map]
pub static SCHED_CLOCK: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// Scheduler intervals shorter than this are only summed, not sent.
#[unsafe(no_mangle)]
pub static SCHED_MIN_NS: u64 = 1_000_000;

/// Copy calls of at least this many bytes are sent as events.
#[unsafe(no_mangle)]
pub static LARGE_COPY_BYTES: u64 = 1 << 20;

#[inline(always)]
pub fn sched_min_ns() -> u64 {
    // SAFETY: as for offsets().
    unsafe { core::ptr::read_volatile(&SCHED_MIN_NS) }
}

#[inline(always)]
pub fn large_copy_bytes() -> u64 {
    // SAFETY: as for offsets().
    unsafe { core::ptr::read_volatile(&LARGE_COPY_BYTES) }
}

/// Non-zero in daemon mode: announce untraced processes that call into a
/// probed CUDA library.
#[unsafe(no_mangle)]
pub static DISCOVER: u32 = 0;

#[inline(always)]
pub fn discover() -> bool {
    // SAFETY: as for offsets().
    unsafe { core::ptr::read_volatile(&DISCOVER) != 0 }
}

/// Unread ring-buffer bytes above which a new event wakes the reader.
#[unsafe(no_mangle)]
pub static WAKEUP_BYTES: u64 = 0;

/// Waking the reader on every event would let it preempt the traced thread
/// right at its CUDA call's return (a 2-core host showed 250 µs stalls), so
/// events are batched: userspace drains on a timer, and is woken only once
/// the buffer holds more than the load-time threshold.
#[inline(always)]
pub fn wakeup_flag() -> u64 {
    // SAFETY: as for offsets().
    let threshold = unsafe { core::ptr::read_volatile(&WAKEUP_BYTES) };
    if EVENTS.query(u64::from(BPF_RB_AVAIL_DATA)) > threshold {
        u64::from(BPF_RB_FORCE_WAKEUP)
    } else {
        u64::from(BPF_RB_NO_WAKEUP)
    }
}

/// Reads a load-time global; the volatile read stops the compiler from
/// folding the default value in.
#[inline(always)]
pub fn offsets() -> TracepointOffsets {
    // SAFETY: reading a static we own; userspace rewrites it before load.
    unsafe { core::ptr::read_volatile(&OFFSETS) }
}

/// One field of [`OFFSETS`], as a context offset: the hot tracepoints read
/// only what they use, not the whole struct as [`offsets`] does.
macro_rules! offset {
    ($field:ident) => {
        // SAFETY: reading a static we own; userspace rewrites it before load.
        unsafe { core::ptr::read_volatile(&$crate::maps::OFFSETS.$field) } as usize
    };
}
pub(crate) use offset;

/// One field of [`SEGMENT_OFFSETS`]: each read where it is used, so that a
/// segment of a connection not followed reads only the port's.
macro_rules! seg_offset {
    ($field:ident) => {
        // SAFETY: reading a static we own; userspace rewrites it before load.
        unsafe { core::ptr::read_volatile(&$crate::maps::SEGMENT_OFFSETS.$field) }
    };
}
pub(crate) use seg_offset;

#[inline(always)]
pub fn bump_stat(stat: ttft_trace_common::Stat) {
    if let Some(p) = STATS_MAP.get_ptr_mut(stat as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *p += 1 };
    }
}

/// Adds `n` to a statistic.
#[inline(always)]
pub fn add_stat(stat: ttft_trace_common::Stat, n: u64) {
    if n == 0 {
        return;
    }
    if let Some(p) = STATS_MAP.get_ptr_mut(stat as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *p += n };
    }
}

#[inline(always)]
pub fn is_tracked(tgid: u32) -> bool {
    workload_of(tgid).is_some()
}

/// The workload id of a traced process or thread.
#[inline(always)]
pub fn workload_of(id: u32) -> Option<u32> {
    if !may_be_traced(id) {
        return None;
    }
    // SAFETY: the value is copied out of the map.
    unsafe { TRACKED.get(id).copied() }
}
