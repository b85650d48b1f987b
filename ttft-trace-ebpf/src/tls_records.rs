//! TLS records written to a memory BIO, bound to the TCP send that carries
//! them. With a memory BIO (CPython's `ssl` under asyncio or uvloop, gRPC's
//! core, Node), `SSL_write` encrypts into a buffer and returns; the process
//! sends the records later, outside any TLS call, so no send inside the
//! call tells the connection (`tls.rs`).
//!
//! The binding is the ciphertext itself: inside a traced thread's TLS call,
//! each record OpenSSL writes with `BIO_write` is held in `TLS_RECORDS`,
//! keyed by its first bytes (header and ciphertext, random to 2^-88 and
//! more), with what the send event is to show of the call's plaintext (read
//! now, while the call's buffer is valid). A TCP send on a followed
//! connection, outside a TLS call, by a process that held records, has the
//! record starting at its first new byte looked up; a match binds the
//! record's `SSL` to that connection and the send carries the plaintext, and
//! the records after it in the same send are walked (a few). A record split
//! across sends is followed by its length (`ConnState::tls_record_left`).
//! Nothing is guessed: a send whose bytes match no record shows none.
//!
//! A socket BIO's records go through `BIO_write` too, inside the call that
//! sends them: once its `SSL` was seen sending in a call, its records are
//! not held (`tls::SOCKET_BIO`).

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user, generated},
    macros::{raw_tracepoint, tracepoint, uprobe},
    maps::ProgramArray,
    programs::{ProbeContext, RawTracePointContext, TracePointContext},
};
use ttft_trace_common::{
    CONN_TLS_LEFT_CONTROL, ConnState, RECORD_KEY_BYTES, RecordKey, SOCK_SEND, SOCK_TLS_CONTROL,
    SOCK_TLS_PLAIN, SendArgs, Stat, TLS_CALL_WRITE, event::HEAD_SENDS,
};

use crate::{
    maps::{
        CONNS, HELD_SEND, HOLD_SCRATCH, HeldSend, SEND_RECORDS, SendRecords, TLS_HOLDERS,
        TLS_RECORDS, TLS_SOCKETS, bump_stat,
    },
    mem::{now_ns, segment},
    sock_event::{SendView, copy_kernel, emit_sock, read_user, read_user_tail},
    tls::{SOCKET_BIO, current, key, set_socket},
};

/// Records looked up in one send after its first (a flush of several
/// calls' records).
const MAX_RECORDS: u32 = 4;

/// iovec entries walked to find where a record starts.
const MAX_IOV: u64 = 8;

/// TLS record content types: `change_cipher_spec` to `application_data`.
const FIRST_TYPE: u8 = 20;
const APPLICATION_DATA: u8 = 23;

/// The key of the record at `addr` (of which `avail` bytes are readable in
/// one piece) in process `tgid`, and the record's bytes on the wire; None
/// where the bytes are no TLS record's header, or where its key bytes are
/// not all there.
#[inline(always)]
fn record_key(tgid: u32, addr: u64, avail: u64) -> Option<(RecordKey, u64)> {
    if avail < 5 {
        return None;
    }
    // SAFETY: the helper checks the user address.
    let header = unsafe { bpf_probe_read_user(addr as *const [u8; 5]) }.ok()?;
    if !(FIRST_TYPE..=APPLICATION_DATA).contains(&header[0]) || header[1] != 3 {
        return None;
    }
    let wire = 5 + u64::from(u16::from_be_bytes([header[3], header[4]]));
    let n = wire.min(RECORD_KEY_BYTES as u64);
    if n > avail || n == 0 || n > RECORD_KEY_BYTES as u64 {
        return None;
    }
    let mut key = RecordKey {
        tgid,
        len: n as u32,
        bytes: [0; RECORD_KEY_BYTES],
    };
    // SAFETY: n <= RECORD_KEY_BYTES = key.bytes.len(); the helper checks
    // the user address.
    let rc = unsafe {
        generated::bpf_probe_read_user(key.bytes.as_mut_ptr().cast(), n as u32, addr as *const _)
    };
    (rc == 0).then_some((key, wire))
}

/// `BIO_write(BIO *, const void *data, int dlen)`.
#[uprobe]
pub fn bio_write(ctx: ProbeContext) -> u32 {
    let len: i32 = ctx.arg(2).unwrap_or(0);
    hold(ctx.arg(1).unwrap_or(0), len.max(0) as u64)
}

/// `BIO_write_ex(BIO *, const void *data, size_t dlen, size_t *written)`.
#[uprobe]
pub fn bio_write_ex(ctx: ProbeContext) -> u32 {
    hold(ctx.arg(1).unwrap_or(0), ctx.arg(2).unwrap_or(0))
}

/// A `BIO_write` of `len` bytes at `data`: inside a TLS call of a traced
/// thread whose `SSL` is not known to send in its calls, the record that
/// begins them is held for the send that will carry it. (A buffering BIO in
/// front of the memory BIO, as in the handshake, writes the same record
/// twice: the same key, held once.)
#[inline(always)]
fn hold(data: u64, len: u64) -> u32 {
    let id = bpf_get_current_pid_tgid();
    let Some(call) = current(id as u32) else {
        return 0;
    };
    // SAFETY: a live map value of this thread; copied out at once.
    let ssl = unsafe { (*call).ssl };
    // SAFETY: copied out at once.
    if unsafe { TLS_SOCKETS.get(key(ssl)) }.is_some_and(|sk| sk & SOCKET_BIO != 0) {
        return 0;
    }
    let tgid = (id >> 32) as u32;
    let Some((record, wire)) = record_key(tgid, data, len) else {
        return 0;
    };
    let Some(rec) = HOLD_SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: the call and the scratch slot are live map values of this
    // thread and CPU.
    unsafe {
        (*rec).ssl = ssl;
        (*rec).wire = wire as u32;
        (*rec).head_len = 0;
        (*rec).tail_len = 0;
        (*rec).first = 0;
        (*rec).plain = 0;
        (*rec).flags = SOCK_TLS_CONTROL;
        let header_type = record.bytes[0];
        if (*call).what == TLS_CALL_WRITE && header_type == APPLICATION_DATA {
            // A data call's record: the plaintext is shared out as a socket
            // BIO's sends share it (`tls::send_view`).
            let first = (*call).held == 0;
            (*call).held += wire;
            let tail = (*call).tail_given == 0 && (*call).held >= (*call).len;
            let left = (*call).len.saturating_sub((*call).plain_held);
            let plain = if tail { left } else { wire.min(left) };
            (*call).plain_held += plain;
            (*rec).plain = plain.min(u64::from(u32::MAX)) as u32;
            (*rec).flags = SOCK_TLS_PLAIN;
            if first {
                (*rec).first = 1;
                (*rec).head_len = read_user(&mut (*rec).head, (*call).buf, (*call).len);
            }
            if tail {
                (*call).tail_given = 1;
                (*rec).tail_len = read_user_tail(&mut (*rec).tail, (*call).buf, (*call).len);
            }
        }
        // By reference: by value, the record (352 bytes) would be copied
        // onto the stack.
        #[allow(clippy::needless_borrows_for_generic_args)]
        let _ = TLS_RECORDS.insert(record, &*rec, 0);
    }
    // SAFETY: copied out at once.
    if unsafe { TLS_HOLDERS.get(tgid) }.is_none() {
        let _ = TLS_HOLDERS.insert(tgid, 1, 0);
    }
    0
}

/// (address, bytes readable in one piece from it) of the byte `pos` of a
/// send.
#[inline(always)]
fn user_at(args: &SendArgs, pos: u64) -> Option<(u64, u64)> {
    if args.buf != 0 {
        return Some((args.buf + pos, u64::MAX));
    }
    let mut done = 0u64;
    for i in 0..MAX_IOV {
        let (base, len) = segment(args, i)?;
        if pos < done + len {
            return Some((base + (pos - done), done + len - pos));
        }
        done += len;
    }
    None
}

/// What a send of `bytes` new bytes on `sk` (the first `skip` bytes of its
/// buffer were reported before), outside any TLS call, shows of held
/// records: None where it carries none. `sends`
/// counts the sends since the last receive (the first [`HEAD_SENDS`] carry
/// the plaintext's head).
///
/// The records are looked for in the piece of the buffer (one iovec) where
/// the first new record begins. What the walk gathers is kept in
/// `SEND_RECORDS`, not in registers: every path through one record's
/// lookup then leaves the verifier the same state, and the walk costs it
/// a few records' instructions, not their product.
#[inline(always)]
fn held_view(
    sk: u64,
    state: *mut ConnState,
    args: Option<SendArgs>,
    skip: u64,
    bytes: u64,
    sends: u32,
) -> Option<SendView> {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let args = args?;
    // SAFETY: live map value.
    let (left, left_control) = unsafe {
        (
            u64::from((*state).tls_record_left),
            (*state).h2 & CONN_TLS_LEFT_CONTROL != 0,
        )
    };
    let left_flags = if left_control {
        SOCK_TLS_CONTROL
    } else {
        SOCK_TLS_PLAIN
    };
    if left >= bytes {
        // All of it is the rest of a record matched before.
        // SAFETY: live map value.
        unsafe { (*state).tls_record_left = (left - bytes) as u32 };
        return Some(SendView::flags_only(left_flags));
    }
    let walk = SEND_RECORDS.get_ptr_mut(0)?;
    let (base, avail) = user_at(&args, skip + left)?;
    let room = avail.min(skip + bytes - (skip + left));
    // SAFETY: the walk's slot is this CPU's, written whole before it is
    // read; the records are live map values, copied before their removal.
    unsafe {
        (*walk).at = 0;
        (*walk).plain = 0;
        (*walk).flags = if left > 0 { left_flags } else { 0 };
        (*walk).last_control = 0;
        (*walk).head_len = 0;
        (*walk).tail_len = 0;
        (*walk).base = base;
        (*walk).room = room;
        for _ in 0..MAX_RECORDS {
            if !next_record(walk, tgid, sk, sends) {
                break;
            }
        }
        let flags = (*walk).flags;
        if flags == 0 {
            return None;
        }
        // Where the last record matched ends, past this send's bytes: the
        // rest comes in the next sends.
        let end = left + (*walk).at;
        (*state).tls_record_left = end.saturating_sub(bytes).min(u64::from(u32::MAX)) as u32;
        if (*walk).last_control != 0 {
            (*state).h2 |= CONN_TLS_LEFT_CONTROL;
        } else {
            (*state).h2 &= !CONN_TLS_LEFT_CONTROL;
        }
        Some(SendView {
            held: true,
            flags,
            plain: (*walk).plain.min(u64::from(u32::MAX)) as u32,
            ..SendView::flags_only(0)
        })
    }
}

/// Looks up the record at `walk.at` bytes into the piece at `walk.base`
/// (`walk.room` bytes of this send); a match is taken into the walk (and out
/// of `TLS_RECORDS`), its `SSL` bound to `sk`. Returns whether one was.
///
/// # Safety
/// `walk` is this CPU's live slot of `SEND_RECORDS`.
#[inline(always)]
unsafe fn next_record(walk: *mut SendRecords, tgid: u32, sk: u64, sends: u32) -> bool {
    // SAFETY: as the caller promises; the record is a live map value.
    unsafe {
        // Read back from the map, never carried in a register from the last
        // record: the verifier then sees one state per record, not one per
        // path through the records before.
        let at = core::ptr::read_volatile(&(*walk).at);
        let base = core::ptr::read_volatile(&(*walk).base);
        let room = core::ptr::read_volatile(&(*walk).room);
        if at >= room {
            return false;
        }
        let Some((record, _)) = record_key(tgid, base + at, room - at) else {
            return false;
        };
        let Some(rec) = TLS_RECORDS.get_ptr(record) else {
            return false;
        };
        if core::ptr::read_volatile(&(*walk).flags) == 0 {
            (*walk).flags = (*rec).flags;
        }
        let plain = core::ptr::read_volatile(&(*walk).plain);
        (*walk).plain = plain + u64::from((*rec).plain);
        if (*rec).head_len > 0
            && core::ptr::read_volatile(&(*walk).head_len) == 0
            && sends < HEAD_SENDS
        {
            (*walk).head_len = copy_kernel(&mut (*walk).head, &(*rec).head, (*rec).head_len);
        }
        if (*rec).tail_len > 0 {
            (*walk).tail_len = copy_kernel(&mut (*walk).tail, &(*rec).tail, (*rec).tail_len);
        }
        if (*rec).first != 0 {
            bump_stat(Stat::TlsHeldSent);
        }
        set_socket((*rec).ssl, sk);
        (*walk).last_control = u32::from((*rec).flags == SOCK_TLS_CONTROL);
        core::ptr::write_volatile(&mut (*walk).at, at + u64::from((*rec).wire));
        let _ = TLS_RECORDS.remove(record);
    }
    true
}

/// The event's view of `send` where it carries no held record: its own
/// bytes, as its hook would report them.
#[inline(always)]
fn plain(send: &HeldSend) -> SendView {
    SendView {
        args: send.args,
        head: send.head,
        span: send.span,
        ..SendView::flags_only(0)
    }
}

/// Hands a send outside any TLS call to the held-record program in
/// `program` (`HELD_SEND_RAW` or `HELD_SEND_TP`) where it may carry held
/// records: its process held some, and its new bytes begin a TLS record or
/// the rest of one. A tail call: on success this never returns; it returns
/// where the send carries none (or the tail call failed), for the caller
/// to report it as it is. Kept out of the hooks' own programs so that the
/// verifier walks the records once, not after every path of theirs.
#[inline(always)]
pub fn hand_over<C: EbpfContext>(
    ctx: &C,
    program: &ProgramArray,
    state: *const ConnState,
    send: HeldSend,
) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: copied out at once.
    if unsafe { TLS_HOLDERS.get(tgid) }.is_none() {
        return;
    }
    // SAFETY: live map value.
    let left = unsafe { (*state).tls_record_left };
    if left == 0 && !begins_record(send.args.read(), send.skip) {
        return;
    }
    let Some(slot) = HELD_SEND.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot, read by the program called next.
    unsafe {
        *slot = send;
        program.tail_call(ctx, 0);
    }
}

/// Whether the byte `skip` of a send's buffer is a TLS record type's (read
/// where it lies in the first piece of the buffer).
#[inline(always)]
fn begins_record(args: Option<SendArgs>, skip: u64) -> bool {
    let Some(args) = args else {
        return false;
    };
    let addr = if args.buf != 0 {
        args.buf + skip
    } else {
        match segment(&args, 0) {
            Some((base, len)) if skip < len => base + skip,
            _ => return false,
        }
    };
    // SAFETY: the helper checks the user address.
    let first = unsafe { bpf_probe_read_user(addr as *const u8) }.unwrap_or(0);
    (FIRST_TYPE..=APPLICATION_DATA).contains(&first)
}

/// The send [`hand_over`] handed over, reported with what it shows of
/// held records.
#[inline(always)]
fn held_send() {
    // SAFETY: copied out at once.
    let Some(send) = HELD_SEND.get(0).copied() else {
        return;
    };
    let Some(state) = CONNS.get_ptr_mut(send.sk) else {
        return;
    };
    let held = held_view(
        send.sk,
        state,
        send.args.read(),
        send.skip,
        send.bytes,
        send.sends,
    );
    // TLS's own records show their wire bytes (the handshake is read from
    // them), as inside a handshake call.
    let view = match held {
        Some(v) if v.flags == SOCK_TLS_CONTROL => SendView {
            flags: SOCK_TLS_CONTROL,
            ..plain(&send)
        },
        Some(v) => v,
        None => plain(&send),
    };
    emit_sock(SOCK_SEND, send.sk, send.ret, now_ns(), view);
}

/// [`held_send`] for the raw tracepoints' hooks (`tcp_sendmsg_locked`,
/// `sock_send_length`): never attached, only tail-called.
#[raw_tracepoint(tracepoint = "sock_send_length")]
pub fn held_send_raw(_ctx: RawTracePointContext) -> i32 {
    held_send();
    0
}

/// [`held_send`] for the classic `sock:sock_send_length` hook.
#[tracepoint]
pub fn held_send_tp(_ctx: TracePointContext) -> u32 {
    held_send();
    0
}
