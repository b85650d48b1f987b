//! Maps and load-time globals, all in one place (as in libbpf-tools).

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LruHashMap, LruPerCpuHashMap, PerCpuArray, RingBuf},
};
use ttft_trace_common::{GpuCounters, ThreadState, TracepointOffsets, counters::STATS};

/// Episode events to userspace. Size set by userspace at load time.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

/// Traced processes (and threads, between fork and exit): tgid -> 1.
/// Filled by userspace for the targets, and by the fork tracepoint for their
/// children.
#[map]
pub static TRACKED: HashMap<u32, u32> = HashMap::with_max_entries(16384, 0);

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

/// Global statistics ([`ttft_trace_common::Stat`] indexes).
#[map]
pub static STATS_MAP: PerCpuArray<u64> = PerCpuArray::with_max_entries(STATS, 0);

/// Tracepoint field offsets, set by userspace from tracefs at load time.
#[unsafe(no_mangle)]
pub static OFFSETS: TracepointOffsets = TracepointOffsets {
    fork_parent_pid: 0,
    fork_child_pid: 0,
    exit_group_dead: 0,
    _pad: 0,
};

/// Unread ring-buffer bytes above which a new event wakes the reader.
#[unsafe(no_mangle)]
pub static WAKEUP_BYTES: u64 = 0;

#[inline(always)]
pub fn wakeup_bytes() -> u64 {
    // SAFETY: as for offsets().
    unsafe { core::ptr::read_volatile(&WAKEUP_BYTES) }
}

/// Reads a load-time global; the volatile read stops the compiler from
/// folding the default value in.
#[inline(always)]
pub fn offsets() -> TracepointOffsets {
    // SAFETY: reading a static we own; userspace rewrites it before load.
    unsafe { core::ptr::read_volatile(&OFFSETS) }
}

#[inline(always)]
pub fn bump_stat(stat: ttft_trace_common::Stat) {
    if let Some(p) = STATS_MAP.get_ptr_mut(stat as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *p += 1 };
    }
}

#[inline(always)]
pub fn is_tracked(tgid: u32) -> bool {
    // SAFETY: the value is not kept beyond the lookup.
    unsafe { TRACKED.get(tgid).is_some() }
}
