//! Userspace's view of the kernel's `TRACED_IDS` array: one byte per thread
//! or process id that the per-event programs read before any hash lookup.
//! Userspace marks the processes it starts tracing, with a single-byte
//! store in a shared mapping of the array: a whole-element update through
//! bpf(2) would rewrite the bytes of other ids, which the kernel sets and
//! clears concurrently.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
};

use aya::{Ebpf, maps::Map};

use super::ProbeError;

pub(super) const MAP: &str = "TRACED_IDS";
/// Ids per array element, as the probes lay them out.
pub(super) const IDS_PER_SLOT: u32 = 4096;
/// The largest `pid_max` a 64-bit kernel allows.
const PID_MAX_LIMIT: u32 = 1 << 22;

/// Elements of `TRACED_IDS` that cover this host's `pid_max`; ids past them
/// (`pid_max` raised later) are looked up in the hashes instead.
pub(super) fn slots() -> u32 {
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(PID_MAX_LIMIT)
        .clamp(1, PID_MAX_LIMIT);
    pid_max.div_ceil(IDS_PER_SLOT)
}

/// A shared, writable mapping of `TRACED_IDS`, unmapped on drop.
pub(super) struct TracedIds {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and written only with
// single-byte volatile stores, which are as safe from any thread as the
// kernel's own stores into it.
unsafe impl Send for TracedIds {}
// SAFETY: as above; `mark` takes `&mut self` anyway.
unsafe impl Sync for TracedIds {}

impl TracedIds {
    pub(super) fn map(ebpf: &Ebpf) -> Result<Self, ProbeError> {
        let Some(Map::Array(data)) = ebpf.map(MAP) else {
            return Err(ProbeError::Missing(MAP));
        };
        let len = slots() as usize * IDS_PER_SLOT as usize;
        let fd = data.fd().as_fd().as_raw_fd();
        // SAFETY: a fresh shared mapping of an mmapable BPF array of exactly
        // `len` bytes (elements of IDS_PER_SLOT bytes, page-aligned); no Rust
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
            return Err(ProbeError::Mmap(MAP, std::io::Error::last_os_error()));
        }
        let base = NonNull::new(base.cast()).ok_or(ProbeError::Missing(MAP))?;
        Ok(Self { base, len })
    }

    /// Marks `id` as possibly traced; ids past the array need no mark.
    pub(super) fn mark(&mut self, id: u32) {
        let at = id as usize;
        if at < self.len {
            // SAFETY: in bounds of the live mapping; a one-byte store.
            unsafe { self.base.as_ptr().add(at).write_volatile(1) };
        }
    }
}

impl Drop for TracedIds {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
