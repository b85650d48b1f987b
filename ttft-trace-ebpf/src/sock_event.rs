//! The socket event of a send or receive on a followed connection: what
//! bytes of it are read (the head and tail of its buffer, or of the TLS
//! call's plaintext), and its record in the ring buffer.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, generated};
use ttft_trace_common::{
    EVENT_SOCK, SendArgs, SockEvent, Stat,
    event::{HEAD_BYTES, TAIL_BYTES},
};

use crate::{
    maps::{EVENTS, SEND_RECORDS, bump_stat, wakeup_flag},
    mem::segment,
};

/// iovec entries walked to find the first with data and the one holding a
/// send's last byte.
const MAX_IOV: u64 = 8;

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
            if view.head > 0
                && let Some((base, seg_len)) = head_segment(&args)
            {
                (*ev).head_len = read_user(&mut (*ev).head, base, view.head.min(seg_len));
            }
            if view.span > 0
                && let Some((tail_base, tail_len)) = tail_segment(&args, view.span)
            {
                (*ev).tail_len = read_user_tail(&mut (*ev).tail, tail_base, tail_len);
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
    if n == 0 || n > TAIL_BYTES as u64 {
        return 0;
    }
    // SAFETY: n <= TAIL_BYTES = dst.len(); the helper checks the user address.
    let rc = unsafe {
        generated::bpf_probe_read_user(dst.as_mut_ptr().cast(), n as u32, from as *const _)
    };
    if rc == 0 { n as u32 } else { 0 }
}

/// (base, length) of the first segment with data: the plain buffer, or the
/// first non-empty iovec (servers pass empty ones, e.g. an empty prefix).
#[inline(always)]
fn head_segment(args: &SendArgs) -> Option<(u64, u64)> {
    if args.buf != 0 {
        return Some((args.buf, u64::MAX));
    }
    for i in 0..MAX_IOV {
        let seg = segment(args, i)?;
        if seg.1 > 0 {
            return Some(seg);
        }
    }
    None
}

/// (base, bytes) of the segment that holds the send's last byte, with
/// `bytes` the part of that segment that was sent.
#[inline(always)]
fn tail_segment(args: &SendArgs, sent: u64) -> Option<(u64, u64)> {
    if args.buf != 0 {
        return Some((args.buf, sent));
    }
    let mut done = 0u64;
    for i in 0..MAX_IOV {
        let seg = segment(args, i)?;
        if done + seg.1 >= sent {
            return Some((seg.0, sent - done));
        }
        done += seg.1;
    }
    None
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
