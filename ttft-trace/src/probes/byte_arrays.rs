//! Userspace's view of the probes' byte arrays, `TRACED_IDS` (one byte per
//! thread or process id, read by the per-event programs before any hash
//! lookup) and `LISTEN_PORTS` (two bytes per port, read for every TCP
//! segment on the host). Userspace sets a byte with a single-byte store in
//! a shared mapping of the array: a whole-element update through bpf(2)
//! would rewrite the neighbouring bytes, which the kernel sets and clears
//! concurrently.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
};

use aya::{Ebpf, maps::Map};
use ttft_trace_common::SLOT_BYTES;

use super::ProbeError;

pub(super) const TRACED_IDS: &str = "TRACED_IDS";
pub(super) const LISTEN_PORTS: &str = "LISTEN_PORTS";
/// The largest `pid_max` a 64-bit kernel allows.
const PID_MAX_LIMIT: u32 = 1 << 22;

/// Elements of `TRACED_IDS` that cover this host's `pid_max`; ids past them
/// (`pid_max` raised later) are looked up in the hashes instead.
pub(super) fn traced_id_slots() -> u32 {
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(PID_MAX_LIMIT)
        .clamp(1, PID_MAX_LIMIT);
    pid_max.div_ceil(SLOT_BYTES)
}

/// A shared, writable mapping of one of the byte arrays, unmapped on drop.
pub(super) struct SharedBytes {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and written only with
// single-byte volatile stores, which are as safe from any thread as the
// kernel's own stores into it.
unsafe impl Send for SharedBytes {}
// SAFETY: as above; `set` takes `&mut self` anyway.
unsafe impl Sync for SharedBytes {}

impl SharedBytes {
    /// Maps the array `name` of the loaded object, whose elements are
    /// [`SLOT_BYTES`] each.
    pub(super) fn map(ebpf: &Ebpf, name: &'static str) -> Result<Self, ProbeError> {
        let Some(Map::Array(data)) = ebpf.map(name) else {
            return Err(ProbeError::Missing(name));
        };
        let len = data
            .info()
            .map_err(|e| ProbeError::Map(name, e))?
            .max_entries() as usize
            * SLOT_BYTES as usize;
        let fd = data.fd().as_fd().as_raw_fd();
        // SAFETY: a fresh shared mapping of an mmapable BPF array of exactly
        // `len` bytes (elements of SLOT_BYTES bytes, page-aligned); no Rust
        // reference is ever made into it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(ProbeError::Mmap(name, std::io::Error::last_os_error()));
        }
        let base = NonNull::new(base.cast()).ok_or(ProbeError::Missing(name))?;
        Ok(Self { base, len })
    }

    /// Sets byte `at` to 1; bytes past the array need none (ids past
    /// `TRACED_IDS` are looked up in the hashes).
    pub(super) fn set(&mut self, at: u32) {
        let at = at as usize;
        if at < self.len {
            // SAFETY: in bounds of the live mapping; a one-byte store.
            unsafe { self.base.as_ptr().add(at).write_volatile(1) };
        }
    }
}

impl SharedBytes {
    /// Sets byte `at` back to 0 (a port no longer followed).
    pub(super) fn clear(&mut self, at: u32) {
        let at = at as usize;
        if at < self.len {
            // SAFETY: in bounds of the live mapping; a one-byte store.
            unsafe { self.base.as_ptr().add(at).write_volatile(0) };
        }
    }
}

impl Drop for SharedBytes {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
