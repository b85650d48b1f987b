//! The socket event of a send or receive on a followed connection: what
//! bytes of it are read (the head and tail of its buffer, or of the TLS
//! call's plaintext), and its record in the ring buffer.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, generated};
use ttft_trace_common::{
    EVENT_SOCK, SendArgs, SockEvent, Stat,
    event::{HEAD_BYTES, HEAD_IOV_WALKED, SEND_IOV_WALKED, TAIL_BUFFERS, TAIL_BYTES},
};

use crate::{
    maps::{EVENTS, SEND_GATHER, SEND_RECORDS, bump_stat, wakeup_flag},
    mem::{opaque, segment},
};

/// What a socket event shows of the bytes moved.
#[derive(Clone, Copy)]
pub struct SendView {
    /// The buffer whose bytes the event carries.
    /// All zero: none. Not an `Option`: a `None`'s payload is left
    /// uninitialised, and a copy of the view that reads it is refused by
    /// the verifier.
    pub args: SendArgs,
    /// Most bytes of the head read (0: none).
    pub head: u64,
    /// Bytes of `args` the send covers: its tail is read at their end (0:
    /// none read).
    pub span: u64,
    /// `SOCK_TLS_*`, or 0 outside TLS calls.
    pub flags: u32,
    /// With `SOCK_TLS_PLAIN`, the plaintext bytes the send carried.
    pub plain: u32,
    /// The head and tail are the held records' (`tls_records.rs`), gathered
    /// in `SEND_RECORDS`, in place of `args`'.
    pub held: bool,
    /// `span` is every byte left in `args` (the TCP hook's iterator): the
    /// last byte is in the last non-empty iovec entry, found from the end.
    /// A constant at each hook, so that each program is verified with one
    /// way of finding it only.
    pub span_is_all: bool,
}

impl SendView {
    /// A receive's (or any event's) view: no bytes read, only `flags`.
    #[inline(always)]
    pub fn flags_only(flags: u32) -> Self {
        Self {
            args: SendArgs::NONE,
            head: 0,
            span: 0,
            flags,
            plain: 0,
            held: false,
            span_is_all: false,
        }
    }
}

/// Reports a receive or send of `ret` bytes at `t_ns`, with the bytes
/// `view` shows.
#[inline(always)]
pub(crate) fn emit_sock(dir: u32, sk: u64, ret: i32, t_ns: u64, view: SendView) {
    let id = bpf_get_current_pid_tgid();
    let Some(mut entry) = EVENTS.reserve::<SockEvent>(0) else {
        bump_stat(Stat::RingbufLost);
        return;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: ev points at a reserved, writable ring-buffer record of the
    // right size; every field is written before submit.
    unsafe {
        (*ev).kind = EVENT_SOCK;
        (*ev).dir = dir;
        (*ev).tgid = (id >> 32) as u32;
        (*ev).tid = id as u32;
        (*ev).sk = sk;
        (*ev).t_ns = t_ns;
        (*ev).bytes = i64::from(ret);
        (*ev).head_len = 0;
        (*ev).tail_len = 0;
        (*ev).flags = view.flags;
        (*ev).plain_bytes = view.plain;
        if view.held
            && let Some(rec) = SEND_RECORDS.get_ptr(0)
        {
            (*ev).head_len = copy_kernel(&mut (*ev).head, &(*rec).head, (*rec).head_len);
            (*ev).tail_len = copy_kernel(&mut (*ev).tail, &(*rec).tail, (*rec).tail_len);
        }
        if let Some(args) = view.args.read() {
            if view.head > 0 {
                (*ev).head_len = gather_head(&args, view.head, &mut (*ev).head);
            }
            if view.span > 0 {
                (*ev).tail_len = gather_tail(&args, view.span, view.span_is_all, &mut (*ev).tail);
            }
        }
    }
    entry.submit(wakeup_flag());
}

/// Reads `min(len, HEAD_BYTES)` bytes from user memory into `dst`; returns
/// the count read (0 on a fault, e.g. a page not resident).
#[inline(always)]
pub(crate) fn read_user(dst: &mut [u8; HEAD_BYTES], src: u64, len: u64) -> u32 {
    let n = if len > HEAD_BYTES as u64 {
        HEAD_BYTES as u64
    } else {
        len
    };
    if n == 0 {
        return 0;
    }
    // SAFETY: dst has HEAD_BYTES bytes and n <= HEAD_BYTES; the helper
    // checks the user address.
    let rc = unsafe {
        generated::bpf_probe_read_user(dst.as_mut_ptr().cast(), n as u32, src as *const _)
    };
    if rc == 0 { n as u32 } else { 0 }
}

/// Reads the last `min(len, TAIL_BYTES)` bytes ending at `src + len` into
/// the start of `dst`. Two fixed shapes keep the verifier's bounds simple.
#[inline(always)]
pub(crate) fn read_user_tail(dst: &mut [u8; TAIL_BYTES], src: u64, len: u64) -> u32 {
    let (from, n) = if len >= TAIL_BYTES as u64 {
        (src + len - TAIL_BYTES as u64, TAIL_BYTES as u64)
    } else {
        (src, len)
    };
    // Opaque: else LLVM drops the check, proven on another copy of `len`.
    let n = opaque(n);
    if n == 0 || n > TAIL_BYTES as u64 {
        return 0;
    }
    // SAFETY: n <= TAIL_BYTES = dst.len(); the helper checks the user address.
    let rc = unsafe {
        generated::bpf_probe_read_user(dst.as_mut_ptr().cast(), n as u32, from as *const _)
    };
    if rc == 0 { n as u32 } else { 0 }
}

/// Reads the send's first `want` bytes (at most [`HEAD_BYTES`]) across
/// its first [`HEAD_IOV_WALKED`] buffers into `dst`; returns the count
/// read, contiguous from the first byte (a buffer that faults ends it).
#[inline(always)]
fn gather_head(args: &SendArgs, want: u64, dst: &mut [u8; HEAD_BYTES]) -> u32 {
    let want = want.min(HEAD_BYTES as u64);
    if args.buf != 0 {
        return read_user(dst, args.buf, want);
    }
    let Some(buf) = SEND_GATHER.get_ptr_mut(0) else {
        return 0;
    };
    let mut filled = 0u64;
    for i in 0..HEAD_IOV_WALKED {
        if filled >= want {
            break;
        }
        let Some((base, len)) = segment(args, i) else {
            break;
        };
        let n = len.min(want - filled).min(HEAD_BYTES as u64);
        if n == 0 {
            continue;
        }
        // filled < want <= HEAD_BYTES, a power of two: the mask keeps the
        // offset below it for the verifier, and the scratch is twice that.
        let at = (filled & (HEAD_BYTES as u64 - 1)) as usize;
        // SAFETY: at < HEAD_BYTES and n <= HEAD_BYTES: inside the
        // scratch's 2 * HEAD_BYTES; the helper checks the user address.
        let rc = unsafe {
            generated::bpf_probe_read_user(
                (*buf).as_mut_ptr().add(at).cast(),
                n as u32,
                base as *const _,
            )
        };
        if rc != 0 {
            break;
        }
        filled += n;
    }
    copy_gathered(dst, buf, 0, filled)
}

/// Reads the last bytes of the send's first `span` bytes, up to
/// [`TAIL_BYTES`], across its last [`TAIL_BUFFERS`] buffers into `dst`;
/// returns the count read, contiguous to the last byte. Shorter than both
/// `span` and [`TAIL_BYTES`], the bytes start at a buffer's start.
#[inline(always)]
fn gather_tail(args: &SendArgs, span: u64, span_is_all: bool, dst: &mut [u8; TAIL_BYTES]) -> u32 {
    if args.buf != 0 {
        return read_user_tail(dst, args.buf, span);
    }
    let last = if span_is_all {
        last_entry(args)
    } else {
        entry_of_byte(args, span)
    };
    let Some((mut i, mut base, mut len)) = last else {
        return 0;
    };
    let Some(buf) = SEND_GATHER.get_ptr_mut(0) else {
        return 0;
    };
    // Filled backwards from `END`: each piece goes before the last.
    const END: u64 = 2 * TAIL_BYTES as u64;
    let mut have = 0u64;
    for _ in 0..TAIL_BUFFERS {
        if have >= TAIL_BYTES as u64 {
            break;
        }
        let n = len.min(TAIL_BYTES as u64 - have);
        if n > 0 {
            // Opaque: else LLVM subtracts from the pointer.
            let at = opaque(END - have - n);
            // SAFETY: have + n <= TAIL_BYTES, so TAIL_BYTES <= at < END
            // and at + n <= END, inside the scratch; the helper checks the
            // user address.
            let rc = unsafe {
                generated::bpf_probe_read_user(
                    (*buf).as_mut_ptr().add(at as usize).cast(),
                    n as u32,
                    (base + len - n) as *const _,
                )
            };
            if rc != 0 {
                break;
            }
            have += n;
        }
        if i == 0 {
            break;
        }
        i -= 1;
        let Some((b, l)) = segment(args, i) else {
            break;
        };
        (base, len) = (b, l);
    }
    copy_gathered(dst, buf, END - have, have)
}

/// The last non-empty iovec entry of the send (its index, base and
/// length), looked for back from the array's end past [`HEAD_IOV_WALKED`]
/// entries at most.
#[inline(always)]
fn last_entry(args: &SendArgs) -> Option<(u64, u64, u64)> {
    let mut i = args.iovlen;
    for _ in 0..HEAD_IOV_WALKED {
        if i == 0 {
            return None;
        }
        i -= 1;
        let (base, len) = segment(args, i)?;
        if len > 0 {
            return Some((i, base, len));
        }
    }
    None
}

/// The iovec entry among the first [`SEND_IOV_WALKED`] that holds the
/// send's byte `span` (its last), with the part of it sent.
#[inline(always)]
fn entry_of_byte(args: &SendArgs, span: u64) -> Option<(u64, u64, u64)> {
    let mut done = 0u64;
    for i in 0..SEND_IOV_WALKED {
        let (base, len) = segment(args, i)?;
        if done + len >= span {
            return Some((i, base, span - done));
        }
        done += len;
    }
    None
}

/// Copies `len` gathered bytes from `from` in the scratch `buf` to `dst`.
#[inline(always)]
fn copy_gathered<const N: usize>(
    dst: &mut [u8; N],
    buf: *mut [u8; 2 * HEAD_BYTES],
    from: u64,
    len: u64,
) -> u32 {
    let n = len.min(N as u64);
    if n == 0 || from >= HEAD_BYTES as u64 {
        return 0;
    }
    // SAFETY: from < HEAD_BYTES and n <= N <= HEAD_BYTES: inside the
    // scratch; dst holds N >= n bytes.
    let rc = unsafe {
        generated::bpf_probe_read_kernel(
            dst.as_mut_ptr().cast(),
            n as u32,
            (*buf).as_ptr().add(from as usize).cast(),
        )
    };
    if rc == 0 { n as u32 } else { 0 }
}

/// Copies the first `len` bytes of `src` to `dst` (kernel memory, both
/// `N` bytes); returns the count copied.
#[inline(always)]
pub(crate) fn copy_kernel<const N: usize>(dst: &mut [u8; N], src: &[u8; N], len: u32) -> u32 {
    let n = (len as usize).min(N);
    if n == 0 {
        return 0;
    }
    // SAFETY: both arrays hold N >= n bytes.
    let rc = unsafe {
        generated::bpf_probe_read_kernel(dst.as_mut_ptr().cast(), n as u32, src.as_ptr().cast())
    };
    if rc == 0 { n as u32 } else { 0 }
}
