//! OpenSSL's calls in the traced processes: which TLS call a thread is in,
//! so that the socket hooks can tell a call's records from the rest. The
//! uprobes are attached per traced process, never host-wide
//! (`ttft-trace/src/probes/openssl.rs`): no other process takes a trap.
//!
//! With a socket BIO (nginx, CPython's blocking `ssl`), `SSL_write`
//! encrypts and sends its records itself, on the calling thread, before it
//! returns. So a TCP send by that thread inside the call carries that
//! call's records, on whichever connection it goes: the binding is the
//! kernel's own evidence, never "the thread's last socket". The send hook
//! then reads the head and tail of the call's plaintext in place of the
//! ciphertext, and the send keeps its time and its wire bytes (when the
//! record crossed TCP, what the client will acknowledge). The receives
//! inside `SSL_read` are reported as one at its return, timed by the first:
//! the request's records, or TLS's own where the call returned the peer's
//! close (a `close_notify`, which is no request). A send or receive inside
//! the handshake, a shutdown or the other direction's call is TLS's own; so
//! is what a read received before it sent (a read that drives the
//! handshake), reported at that send.
//!
//! With a memory BIO the process sends the records later, outside the
//! call, as asyncio does: the records are held and bound by their
//! ciphertext (`tls_records.rs`). A successful `SSL_write` that neither sent
//! on a followed connection nor held a record is counted in
//! `Stat::TlsUnbound`; its plaintext is not read.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use ttft_trace_common::{
    SOCK_RECV, SOCK_TLS_BUFFERED, SOCK_TLS_CONTROL, SOCK_TLS_PLAIN, SendArgs, Stat,
    TLS_CALL_CONTROL, TLS_CALL_READ, TLS_CALL_READ_EX, TLS_CALL_WRITE, TlsCall, TlsKey,
    event::HEAD_SENDS,
};

use crate::{
    maps::{CONNS, TLS_CALLS, TLS_MEMORY_BIO, TLS_SOCKETS, bump_stat, is_tracked},
    mem::now_ns,
    sock_event::{SendView, emit_sock},
};

/// Most bytes of one alert record on the wire (TLS 1.2 with an AEAD's
/// explicit nonce: 5 + 8 + 2 + 16).
const ALERT_RECORD_MAX: u64 = 31;

/// A traced thread enters a TLS call on `ssl`; `buf` and `len` the
/// plaintext of a write.
#[inline(always)]
fn enter(what: u32, ssl: u64, buf: u64, len: u64) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let tgid = (id >> 32) as u32;
    if !is_tracked(tgid) {
        return 0;
    }
    let call = TlsCall {
        ssl,
        buf,
        len,
        what,
        tgid,
        ..TlsCall::default()
    };
    let _ = TLS_CALLS.insert(id as u32, call, 0);
    0
}

/// `SSL_write(SSL *, const void *buf, int num)`: `num` is an int, whose
/// register's upper half is not defined.
#[uprobe]
pub fn ssl_write(ctx: ProbeContext) -> u32 {
    let num: i32 = ctx.arg(2).unwrap_or(0);
    let (ssl, buf) = (ctx.arg(0).unwrap_or(0), ctx.arg(1).unwrap_or(0));
    enter(TLS_CALL_WRITE, ssl, buf, num.max(0) as u64)
}

/// `SSL_write_ex(SSL *, const void *buf, size_t num, size_t *written)`.
#[uprobe]
pub fn ssl_write_ex(ctx: ProbeContext) -> u32 {
    let (ssl, buf) = (ctx.arg(0).unwrap_or(0), ctx.arg(1).unwrap_or(0));
    enter(TLS_CALL_WRITE, ssl, buf, ctx.arg(2).unwrap_or(0))
}

/// `SSL_read(SSL *, void *buf, int num)`: the plaintext is not read (the
/// request's framing comes from the receives' sizes and times).
#[uprobe]
pub fn ssl_read(ctx: ProbeContext) -> u32 {
    enter(TLS_CALL_READ, ctx.arg(0).unwrap_or(0), 0, 0)
}

/// `SSL_read_ex(SSL *, void *buf, size_t num, size_t *readbytes)`: the
/// count's address is kept for the return.
#[uprobe]
pub fn ssl_read_ex(ctx: ProbeContext) -> u32 {
    let (ssl, count) = (ctx.arg(0).unwrap_or(0), ctx.arg(3).unwrap_or(0));
    enter(TLS_CALL_READ_EX, ssl, count, 0)
}

/// `SSL_do_handshake`, `SSL_accept`, `SSL_shutdown`.
#[uprobe]
pub fn ssl_control(ctx: ProbeContext) -> u32 {
    enter(TLS_CALL_CONTROL, ctx.arg(0).unwrap_or(0), 0, 0)
}

/// Set in a `TLS_SOCKETS` value (a socket's address, so its low bits
/// are free) where the `SSL` moved the connection's bytes inside a call: a
/// socket BIO, whose records are never held (`tls_records.rs`).
pub const SOCKET_BIO: u64 = 1;

/// The key of `ssl` of the calling process.
#[inline(always)]
pub(crate) fn key(ssl: u64) -> TlsKey {
    TlsKey {
        ssl,
        tgid: (bpf_get_current_pid_tgid() >> 32) as u32,
        _pad: 0,
    }
}

/// The call moved bytes on connection `sk`: its `SSL` is that
/// connection's (a socket BIO moves one socket's bytes). Looked at once per
/// data call (at its first bytes) and at each of the handshake's; written
/// only when it changed (a lookup, not an LRU update, on every write).
#[inline(always)]
fn bind(call: &TlsCall, sk: u64) {
    if call.wire != 0 {
        return;
    }
    set_socket(call.ssl, sk | SOCKET_BIO);
}

/// Writes `ssl`'s connection (`value`: a socket, with [`SOCKET_BIO`] or
/// not) only where it changed: a lookup, not an LRU update, per call.
#[inline(always)]
pub(crate) fn set_socket(ssl: u64, value: u64) {
    let key = key(ssl);
    // SAFETY: copied out at once.
    if unsafe { TLS_SOCKETS.get(key) }.copied() != Some(value) {
        let _ = TLS_SOCKETS.insert(key, value, 0);
    }
}

/// The thread's TLS call, if it is in one (of its own process: see
/// [`TlsCall::tgid`]).
#[inline(always)]
pub(crate) fn current(tid: u32) -> Option<*mut TlsCall> {
    let call = TLS_CALLS.get_ptr_mut(tid)?;
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a live map value.
    (unsafe { (*call).tgid } == tgid).then_some(call)
}

/// The return of every probed TLS call. The call ends whether its process
/// is still traced or not.
#[uretprobe]
pub fn ssl_return(ctx: RetProbeContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: copied out at once.
    let Some(call) = current(tid).map(|c| unsafe { *c }) else {
        return 0;
    };
    let _ = TLS_CALLS.remove(tid);
    let ret: i32 = ctx.ret();
    match call.what {
        TLS_CALL_WRITE if call.wire == 0 && ret > 0 && call.held > 0 => bump_stat(Stat::TlsHeld),
        TLS_CALL_WRITE if call.wire == 0 && ret > 0 => {
            bump_stat(Stat::TlsUnbound);
            // SAFETY: copied out at once.
            if unsafe { TLS_MEMORY_BIO.get(call.tgid) }.is_none() {
                let _ = TLS_MEMORY_BIO.insert(call.tgid, 1, 0);
            }
        }
        TLS_CALL_READ | TLS_CALL_READ_EX => read_returned(&call, ret),
        _ => {}
    }
    0
}

/// The end of a read that returned `ret`. Its receives are reported as
/// one, timed by the first: a request's records when the call returned
/// plaintext (or waits for the rest of a record); TLS's own when it
/// returned the peer's close (`SSL_read_ex` tells no wait from a close: its
/// failures are all taken as TLS's own). Plaintext returned with no
/// receive came from records an earlier call took: reported as such, on
/// the connection its `SSL` was last seen on.
#[inline(always)]
fn read_returned(call: &TlsCall, ret: i32) {
    let ex = call.what == TLS_CALL_READ_EX;
    let got = ret > 0;
    if call.wire > 0 {
        // `SSL_read_ex`'s failure is a close when what it took is no more
        // than an alert record (a `close_notify`: 24 bytes with TLS 1.3's
        // AEAD, 31 with TLS 1.2's), a wait for the rest of a record when
        // it took more.
        let closed = ret == 0 || (ex && !got && call.wire <= ALERT_RECORD_MAX);
        let flags = if closed {
            SOCK_TLS_CONTROL
        } else {
            SOCK_TLS_PLAIN
        };
        let bytes = call.wire.min(i32::MAX as u64) as i32;
        emit_sock(
            SOCK_RECV,
            call.sk,
            bytes,
            call.t_first_ns,
            SendView::flags_only(flags),
        );
        return;
    }
    if !got {
        return;
    }
    let bytes = if ex {
        // SAFETY: the helper checks the user address.
        unsafe { bpf_probe_read_user(call.buf as *const u64) }.unwrap_or(1)
    } else {
        ret as u64
    };
    // SAFETY: copied out at once.
    let Some(sk) = unsafe { TLS_SOCKETS.get(key(call.ssl)) }.map(|v| v & !SOCKET_BIO) else {
        return;
    };
    // Only on a connection still followed (an `SSL` freed and its address
    // reused for one on a connection not followed keeps the old entry).
    let Some(state) = CONNS.get_ptr_mut(sk) else {
        return;
    };
    // A receive, as far as the response's first sends go: their heads are
    // read (the handshake's own sends since the records' receive were
    // counted).
    // SAFETY: a live map value.
    unsafe { (*state).sends_since_recv = 0 };
    let bytes = bytes.clamp(1, i32::MAX as u64) as i32;
    let flags = SOCK_TLS_PLAIN | SOCK_TLS_BUFFERED;
    emit_sock(SOCK_RECV, sk, bytes, now_ns(), SendView::flags_only(flags));
}

/// A send of `bytes` new wire bytes by thread `tid`, `sends` the sends
/// since the last receive on its connection, `plain` what it shows outside
/// a TLS call: None where the thread is in none. Inside `SSL_write`, the call's plaintext: its head
/// on the call's first send, its tail on the send that completes the wire
/// bytes of the call (records are never smaller than their plaintext, so
/// that is the last send at the latest; earlier only when the records'
/// overhead passed the plaintext left, a few bytes).
#[inline(always)]
pub fn send_view(tid: u32, sk: u64, bytes: u64, sends: u32, plain: SendView) -> Option<SendView> {
    let call = current(tid)?;
    let span_is_all = plain.span_is_all;
    // SAFETY: a live map value of this thread.
    unsafe {
        bind(&*call, sk);
        let what = (*call).what;
        if (what == TLS_CALL_READ || what == TLS_CALL_READ_EX) && (*call).wire > 0 {
            // A read that sends drives the handshake (`SSL_read` before
            // any `SSL_do_handshake`, as gunicorn and CPython's
            // `do_handshake_on_connect=False` do): what it received so
            // far is the handshake's, reported now, before this send.
            let bytes = (*call).wire.min(i32::MAX as u64) as i32;
            let view = SendView::flags_only(SOCK_TLS_CONTROL);
            emit_sock(SOCK_RECV, (*call).sk, bytes, (*call).t_first_ns, view);
            (*call).wire = 0;
        }
        if what != TLS_CALL_WRITE {
            return Some(SendView {
                flags: SOCK_TLS_CONTROL,
                ..plain
            });
        }
        let first = (*call).wire == 0;
        (*call).wire += bytes;
        let tail = (*call).tail_given == 0 && (*call).wire >= (*call).len;
        if tail {
            (*call).tail_given = 1;
        }
        let left = (*call).len.saturating_sub((*call).plain_sent);
        let plain = if tail { left } else { bytes.min(left) };
        (*call).plain_sent += plain;
        Some(SendView {
            args: SendArgs {
                buf: (*call).buf,
                ..SendArgs::NONE
            },
            head: if first && sends < HEAD_SENDS {
                (*call).len
            } else {
                0
            },
            span: if tail { (*call).len } else { 0 },
            flags: SOCK_TLS_PLAIN,
            plain: plain.min(u64::from(u32::MAX)) as u32,
            held: false,
            // A plain buffer (the call's): the hook's own, for one way.
            span_is_all,
        })
    }
}

/// A receive of `bytes` on `sk` at `t_ns` by thread `tid`: the flags to
/// report it with now, or None where it is held for the return of the
/// `SSL_read` it is made in (whose result tells what its bytes were). An end
/// of stream is reported at once.
#[inline(always)]
pub fn on_recv(tid: u32, sk: u64, bytes: i32, t_ns: u64) -> Option<u32> {
    let Some(call) = current(tid) else {
        return Some(0);
    };
    // SAFETY: a live map value of this thread.
    unsafe {
        bind(&*call, sk);
        let what = (*call).what;
        if what != TLS_CALL_READ && what != TLS_CALL_READ_EX {
            return Some(SOCK_TLS_CONTROL);
        }
        // A socket BIO reads one socket; another is reported as it is.
        if bytes <= 0 || ((*call).wire > 0 && (*call).sk != sk) {
            return Some(SOCK_TLS_PLAIN);
        }
        if (*call).wire == 0 {
            (*call).sk = sk;
            (*call).t_first_ns = t_ns;
        }
        (*call).wire += bytes as u64;
    }
    None
}
