//! Reads every probe shares, below the probes themselves: the clock, a
//! kernel address, and a send's iovec array (the user's, or the kernel's
//! copy of it).

use aya_ebpf::helpers::{bpf_ktime_get_ns, bpf_probe_read_kernel};
use ttft_trace_common::SendArgs;

#[inline(always)]
pub(crate) fn now_ns() -> u64 {
    // SAFETY: plain helper call.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub(crate) fn kernel<T>(addr: u64) -> Option<T> {
    // SAFETY: the helper checks the address.
    unsafe { bpf_probe_read_kernel(addr as *const T) }.ok()
}

/// `x`, read back from the stack: LLVM can neither fold it into the
/// arithmetic around it nor drop a bounds check on it that it can prove
/// from another copy. The verifier keeps a spilled scalar's bounds, but
/// checks the register a helper is passed: a check LLVM moved onto another
/// copy of the value (or a variable subtracted from a map pointer) is
/// refused.
#[inline(always)]
pub(crate) fn opaque(x: u64) -> u64 {
    // SAFETY: a read of a local.
    unsafe { core::ptr::read_volatile(&x) }
}

/// The `i`th iovec of the send, less what was sent of the first before the
/// send began.
#[inline(always)]
pub(crate) fn segment(args: &SendArgs, i: u64) -> Option<(u64, u64)> {
    if args.iov == 0 || i >= args.iovlen {
        return None;
    }
    let (base, len) = iovec(args, i)?;
    if i > 0 {
        return Some((base, len));
    }
    let skip = args.iov_offset.min(len);
    Some((base + skip, len - skip))
}

/// The `i`th `struct iovec { void *base; size_t len; }` of the send's
/// array: the user's, or the kernel's copy of it.
#[inline(always)]
fn iovec(args: &SendArgs, i: u64) -> Option<(u64, u64)> {
    let at = args.iov + i * 16;
    if args.iov_kernel != 0 {
        return Some((kernel::<u64>(at)?, kernel::<u64>(at + 8)?));
    }
    // SAFETY: bpf_probe_read_user checks the addresses.
    let base = unsafe { aya_ebpf::helpers::bpf_probe_read_user(at as *const u64) }.ok()?;
    // SAFETY: as above.
    let len = unsafe { aya_ebpf::helpers::bpf_probe_read_user((at + 8) as *const u64) }.ok()?;
    Some((base, len))
}
