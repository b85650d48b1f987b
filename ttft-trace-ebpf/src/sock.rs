//! Socket tracepoints: server connections of the traced tree and the bytes
//! moving on them, for per-request timing.
//!
//! `inet_sock_set_state` tells which sockets are server connections (accepted
//! on a listening port of the tree), when they close, and their later states
//! until the kernel is done with them. The bytes moving on them are timed by
//! one of two hooks, which userspace picks at load time:
//! - the TCP hook (default): the raw tracepoints `tcp:tcp_sendmsg_locked`
//!   (a send starts; its user buffer is read there) and
//!   `tcp:tcp_rcv_space_adjust` (a receive copied bytes). They run for TCP
//!   sends and receives only, so a UNIX socket, pipe or file of any task on
//!   the host pays nothing, and bytes are counted from the socket's
//!   sequence numbers.
//! - the syscall hook (kernels without BTF or those tracepoints): the send
//!   syscalls' tracepoints note the user buffer and `sock_send_length` /
//!   `sock_recv_length` time each send and receive at its end. These run
//!   for every socket call (and the syscall ones put every syscall on the
//!   slow path) of every task on the host while attached.
//!
//! Every program returns at once for a process that is not traced (an
//! array read), before looking the socket up. The first sends of each
//! response are peeked at (HTTP headers or body?) and every send's last
//! bytes (end of a chunked response).

use aya_ebpf::{
    EbpfContext,
    helpers::bpf_get_current_pid_tgid,
    macros::{raw_tracepoint, tracepoint},
    maps::ProgramArray,
    programs::{RawTracePointContext, TracePointContext},
};
use ttft_trace_common::{
    CONN_CLOSE, CONN_OPEN, CONN_STATE, ConnEvent, ConnState, EVENT_CONN, SOCK_RECV, SOCK_SEND,
    SendArgs, SendOffsets, Stat, event::HEAD_SENDS,
};

use crate::{
    h2, listen,
    maps::{
        CONNS, EVENTS, HELD_SEND_RAW, HELD_SEND_TP, HeldSend, SEND_ARGS, bump_stat, is_tracked,
        may_be_traced, offset, offsets, seg_offset, wakeup_flag, workload_of,
    },
    mem::{kernel, now_ns},
    sock_event::{SendView, emit_sock},
    tls, tls_records,
};

const TCP_ESTABLISHED: i32 = 1;
const TCP_SYN_RECV: i32 = 3;
const TCP_CLOSE: i32 = 7;
pub(crate) const TCP_LISTEN: i32 = 10;
const AF_INET: u16 = 2;
const MSG_PEEK: i32 = 2;

#[inline(always)]
pub(crate) fn read<T>(ctx: &TracePointContext, offset: u32) -> Option<T> {
    read_at(ctx, offset as usize)
}

#[inline(always)]
fn read_at<T>(ctx: &TracePointContext, offset: usize) -> Option<T> {
    // SAFETY: offsets come from this kernel's tracefs format files.
    unsafe { ctx.read_at::<T>(offset) }.ok()
}

/// `sock:inet_sock_set_state`.
#[tracepoint]
pub fn inet_sock_set_state(ctx: TracePointContext) -> u32 {
    let off = offsets();
    let (Some(sk), Some(old), Some(new), Some(sport)) = (
        read::<u64>(&ctx, off.state_skaddr),
        read::<i32>(&ctx, off.state_oldstate),
        read::<i32>(&ctx, off.state_newstate),
        read::<u16>(&ctx, off.state_sport),
    ) else {
        return 0;
    };
    if new == TCP_LISTEN {
        // listen() runs in the process's context: a traced server's port.
        if let Some(workload) = workload_of((bpf_get_current_pid_tgid() >> 32) as u32) {
            listen::add(workload, sk, sport);
        }
        return 0;
    }
    if old == TCP_SYN_RECV && new == TCP_ESTABLISHED {
        if listen::is_followed(sk, sport) {
            let _ = CONNS.insert(sk, followed_from_now(sk), 0);
            let mut ev = conn_event(&ctx, CONN_OPEN, sk, old, new, sport);
            if let Some(snd_nxt) = handshake_snd_nxt(sk) {
                (ev.snd_nxt, ev.snd_nxt_known) = (snd_nxt, 1);
            }
            submit_conn(ev);
        }
        return 0;
    }
    let Some(state) = CONNS.get_ptr_mut(sk) else {
        return 0;
    };
    // SAFETY: live map value.
    let closed = unsafe { (*state).closed != 0 };
    if !closed && (old == TCP_ESTABLISHED || new == TCP_CLOSE) {
        // SAFETY: as above.
        let t_last_segment = unsafe {
            (*state).closed = 1;
            (*state).probe_t_ns
        };
        let ev = conn_event(&ctx, CONN_CLOSE, sk, old, new, sport);
        submit_conn(ConnEvent {
            t_last_segment_ns: t_last_segment,
            ..ev
        });
    } else if closed && old != new {
        // After the application's close the kernel still retransmits and
        // takes the client's ACKs: FIN_WAIT2 or LAST_ACK -> CLOSE say when
        // everything sent was acknowledged, CLOSE that the socket is done.
        submit_conn(conn_event(&ctx, CONN_STATE, sk, old, new, sport));
    }
    if new == TCP_CLOSE {
        h2::forget(sk, state);
        let _ = CONNS.remove(sk);
    }
    0
}

/// The socket's `snd_nxt`, where BTF gave its offset (the raw segment
/// program's; 0 where that is not loaded): at the handshake, where the
/// first response starts.
#[inline(always)]
fn handshake_snd_nxt(sk: u64) -> Option<u32> {
    match seg_offset!(snd_nxt) {
        0 => None,
        at => kernel::<u32>(sk + u64::from(at)),
    }
}

#[inline(always)]
fn conn_event(
    ctx: &TracePointContext,
    op: u32,
    sk: u64,
    old: i32,
    new: i32,
    sport: u16,
) -> ConnEvent {
    let off = offsets();
    let family = read::<u16>(ctx, off.state_family).unwrap_or(0);
    let mut ev = ConnEvent {
        kind: EVENT_CONN,
        op,
        oldstate: old as u32,
        newstate: new as u32,
        sk,
        t_ns: now_ns(),
        family,
        sport,
        dport: read::<u16>(ctx, off.state_dport).unwrap_or(0),
        ..ConnEvent::default()
    };
    if family == AF_INET {
        if let Some(a) = read::<[u8; 4]>(ctx, off.state_saddr) {
            ev.saddr[..4].copy_from_slice(&a);
        }
        if let Some(a) = read::<[u8; 4]>(ctx, off.state_daddr) {
            ev.daddr[..4].copy_from_slice(&a);
        }
    } else {
        ev.saddr = read::<[u8; 16]>(ctx, off.state_saddr_v6).unwrap_or([0; 16]);
        ev.daddr = read::<[u8; 16]>(ctx, off.state_daddr_v6).unwrap_or([0; 16]);
    }
    ev
}

#[inline(always)]
fn submit_conn(ev: ConnEvent) {
    match EVENTS.reserve::<ConnEvent>(0) {
        Some(mut entry) => {
            entry.write(ev);
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
}

/// The state of `sk` when it is a followed connection. Followed
/// connections are served by the traced tree, so the socket calls of every
/// other process stop here, at an array read, before the hash lookup of the
/// socket.
#[inline(always)]
fn followed(sk: u64) -> Option<*mut ConnState> {
    if !may_be_traced((bpf_get_current_pid_tgid() >> 32) as u32) {
        return None;
    }
    CONNS.get_ptr_mut(sk)
}

/// A send on a followed connection: returns how many sends came before it
/// since the last receive (the first [`HEAD_SENDS`] carry their head).
#[inline(always)]
fn count_send(state: *mut ConnState) -> u32 {
    // SAFETY: live map value.
    unsafe {
        let sends = (*state).sends_since_recv;
        (*state).sends_since_recv = sends.saturating_add(1);
        sends
    }
}

/// A receive of `bytes` on a followed connection: reported, and the sends
/// after it start a new response.
#[inline(always)]
fn report_recv(sk: u64, state: *mut ConnState, bytes: i32) {
    // SAFETY: live map value.
    let unseen = unsafe {
        (*state).sends_since_recv = 0;
        let unseen = (*state).probe_t_ns == 0 && (*state).unseen_counted == 0;
        if unseen {
            (*state).unseen_counted = 1;
        }
        unseen
    };
    // The request's segment came before this read: none seen is the
    // segment hook's self-check (userspace widens its reach on it).
    if unseen {
        bump_stat(Stat::SegmentsUnseen);
        if !listen::listener_seen(sk) {
            bump_stat(Stat::ListenerUnseen);
        }
    }
    let t_ns = now_ns();
    let tid = bpf_get_current_pid_tgid() as u32;
    let Some(flags) = tls::on_recv(tid, sk, bytes, t_ns) else {
        return;
    };
    emit_sock(SOCK_RECV, sk, bytes, t_ns, SendView::flags_only(flags));
}

/// The end of a receive on socket `sk` (any family), in the receiving
/// task's context.
#[inline(always)]
fn received(sk: u64, ret: i32, flags: i32) {
    // Errors (EAGAIN from non-blocking servers above all) and peeks move no data.
    if ret < 0 || flags & MSG_PEEK != 0 {
        return;
    }
    if let Some(state) = followed(sk) {
        report_recv(sk, state, ret);
    }
}

/// The end of a send on socket `sk` (any family), still inside the
/// syscall, so the user buffer its entry noted is readable (the syscall
/// hook; the TCP hook reports sends where they start).
/// `ctx` and `program`: the hook's context and its held-send program.
#[inline(always)]
fn sent<C: EbpfContext>(ctx: &C, program: &ProgramArray, sk: u64, ret: i32) {
    if ret <= 0 {
        return;
    }
    let Some(state) = followed(sk) else {
        return;
    };
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: copied out at once; the syscall's exit removes it.
    let args = unsafe { SEND_ARGS.get(tid) }
        .copied()
        .unwrap_or(SendArgs::NONE);
    let sends = count_send(state);
    let plain = SendView {
        args,
        head: if sends < HEAD_SENDS { ret as u64 } else { 0 },
        span: ret as u64,
        flags: 0,
        plain: 0,
        held: false,
        // A partial send's last byte may lie in any entry.
        span_is_all: false,
    };
    // TLS records are no HTTP/2 frames: a send that shows a TLS call's
    // plaintext ends here (each way on its own, so that the verifier does
    // not walk the frames after every path of the records' walk).
    if let Some(view) = tls::send_view(tid, sk, ret as u64, sends, plain) {
        emit_sock(SOCK_SEND, sk, ret, now_ns(), view);
        return;
    }
    let send = HeldSend {
        sk,
        skip: 0,
        bytes: ret as u64,
        args: plain.args,
        head: plain.head,
        span: plain.span,
        ret,
        sends,
    };
    tls_records::hand_over(ctx, program, state, send);
    emit_sock(SOCK_SEND, sk, ret, now_ns(), plain);
    if let Some(args) = args.read() {
        let range = h2::SendRange {
            skip: 0,
            new: ret as u32,
            seq: 0,
        };
        h2::on_send(sk, state, &args, &range);
    }
}

/// `sock:sock_recv_length` (classic: the fallback where the raw tracepoint
/// cannot be had): fires at the end of every receive.
#[tracepoint]
pub fn sock_recv_length(ctx: TracePointContext) -> u32 {
    let (Some(sk), Some(ret), Some(flags)) = (
        read_at::<u64>(&ctx, offset!(len_sk)),
        read_at::<i32>(&ctx, offset!(len_ret)),
        read_at::<i32>(&ctx, offset!(len_flags)),
    ) else {
        return 0;
    };
    received(sk, ret, flags);
    0
}

/// `sock:sock_send_length` (classic: the fallback): fires at the end of
/// every send.
#[tracepoint]
pub fn sock_send_length(ctx: TracePointContext) -> u32 {
    let (Some(sk), Some(ret)) = (
        read_at::<u64>(&ctx, offset!(len_sk)),
        read_at::<i32>(&ctx, offset!(len_ret)),
    ) else {
        return 0;
    };
    sent(&ctx, &HELD_SEND_TP, sk, ret);
    0
}

/// Raw `sock_recv_length(struct sock *sk, int ret, int flags)`: the
/// arguments themselves, no perf record filled first and no memory read.
#[raw_tracepoint(tracepoint = "sock_recv_length")]
pub fn raw_sock_recv_length(ctx: RawTracePointContext) -> i32 {
    let (sk, ret, flags): (u64, u64, u64) = (ctx.arg(0), ctx.arg(1), ctx.arg(2));
    received(sk, ret as i32, flags as i32);
    0
}

/// Raw `sock_send_length(struct sock *sk, int ret, int flags)`.
#[raw_tracepoint(tracepoint = "sock_send_length")]
pub fn raw_sock_send_length(ctx: RawTracePointContext) -> i32 {
    let (sk, ret): (u64, u64) = (ctx.arg(0), ctx.arg(1));
    sent(&ctx, &HELD_SEND_RAW, sk, ret as i32);
    0
}

/// Kernel struct offsets for the TCP hook ([`tcp_sendmsg_locked`],
/// [`tcp_rcv_space_adjust`]), set by userspace from the kernel's BTF at
/// load time.
#[unsafe(no_mangle)]
static SEND_OFFSETS: SendOffsets = SendOffsets {
    msg_iter: 0,
    iter_type: 0,
    iov_offset: 0,
    ubuf: 0,
    iov: 0,
    count: 0,
    nr_segs: 0,
    iter_ubuf: 0,
    iter_iovec: 0,
    copied_seq: 0,
    write_seq: 0,
};

/// The state of a connection followed from now on: what the server read
/// and queued so far is not reported (the socket's `copied_seq` and
/// `write_seq` now; 0 where unreadable, or with the syscall hook, which
/// does not use them).
#[inline(always)]
pub(crate) fn followed_from_now(sk: u64) -> ConnState {
    let off = send_offsets();
    ConnState {
        recv_seq: kernel::<u32>(sk + u64::from(off.copied_seq)).unwrap_or(0),
        sent_seq: kernel::<u32>(sk + u64::from(off.write_seq)).unwrap_or(0),
        ..ConnState::default()
    }
}

#[inline(always)]
pub(crate) fn send_offsets() -> SendOffsets {
    // SAFETY: reading a static we own; userspace rewrites it before load.
    unsafe { core::ptr::read_volatile(&SEND_OFFSETS) }
}

/// `tcp:tcp_sendmsg_locked` (raw: `struct sock *`, `struct msghdr *`, ...):
/// fires in every step of a TCP send that copies data into the socket, the
/// first time before any is copied. Reports the send where it starts, with
/// the head and tail of its user buffer, for followed connections only.
///
/// What a send adds is counted in sequence space: the bytes the iterator
/// still holds end at `write_seq + count`, and only those past what was
/// reported already (`sent_seq`) are new. So a send's later steps add
/// nothing, a retry after `EAGAIN` nothing, and the rest of a partial send
/// nothing: a send is counted whole where it first starts, and a send
/// that never completes (the server gives up) is counted all the same.
#[raw_tracepoint(tracepoint = "tcp_sendmsg_locked")]
pub fn tcp_sendmsg_locked(ctx: RawTracePointContext) -> i32 {
    let sk: u64 = ctx.arg(0);
    let Some(state) = followed(sk) else {
        return 0;
    };
    let msg: u64 = ctx.arg(1);
    let off = send_offsets();
    let iter = msg + u64::from(off.msg_iter);
    let field = |o: u32| kernel::<u64>(iter + u64::from(o)).unwrap_or(0);
    let count = field(off.count);
    let Some(write_seq) = kernel::<u32>(sk + u64::from(off.write_seq)) else {
        return 0;
    };
    // SAFETY: live map value.
    let reported = unsafe { (*state).sent_seq };
    // Sequence numbers wrap: compare differences as signed.
    let end = write_seq.wrapping_add(count as u32);
    let new = end.wrapping_sub(reported) as i32;
    if new <= 0 {
        return 0;
    }
    // Bytes at the iterator's start that were reported already.
    let skip = reported.wrapping_sub(write_seq) as i32;
    let skip = if skip > 0 { skip as u64 } else { 0 };
    let kind = u32::from(kernel::<u8>(iter + u64::from(off.iter_type)).unwrap_or(u8::MAX));
    let (ptr, iov_skip) = (field(off.ubuf), field(off.iov_offset));
    let mut args = SendArgs::default();
    if kind == off.iter_ubuf {
        args.buf = ptr + iov_skip;
    } else if kind == off.iter_iovec {
        args.iov = ptr;
        args.iovlen = field(off.nr_segs);
        args.iov_offset = iov_skip;
        args.iov_kernel = 1;
    }
    // Kernel memory (splice, sendfile) has no user buffer (`args` all
    // zero): the send is still counted, without its bytes.
    // SAFETY: live map value.
    unsafe { (*state).sent_seq = end };
    let sends = count_send(state);
    let bytes = (new as u32).min(i32::MAX as u32) as i32;
    // The head is read only where the new bytes start the buffer.
    let plain = SendView {
        args,
        head: if sends < HEAD_SENDS && skip == 0 {
            (bytes as u64).min(count)
        } else {
            0
        },
        span: count,
        flags: 0,
        plain: 0,
        held: false,
        // `count` is every byte the iterator has left.
        span_is_all: true,
    };
    let tid = bpf_get_current_pid_tgid() as u32;
    // As in `sent`: a TLS call's plaintext ends here.
    if let Some(view) = tls::send_view(tid, sk, bytes as u64, sends, plain) {
        emit_sock(SOCK_SEND, sk, bytes, now_ns(), view);
        return 0;
    }
    let send = HeldSend {
        sk,
        skip,
        bytes: bytes as u64,
        args: plain.args,
        head: plain.head,
        span: plain.span,
        ret: bytes,
        sends,
    };
    tls_records::hand_over(&ctx, &HELD_SEND_RAW, state, send);
    emit_sock(SOCK_SEND, sk, bytes, now_ns(), plain);
    if let Some(args) = args.read() {
        let new = new as u32;
        let range = h2::SendRange {
            skip: skip as u32,
            new,
            seq: end.wrapping_sub(new),
        };
        h2::on_send(sk, state, &args, &range);
    }
    0
}

/// `tcp:tcp_rcv_space_adjust` (raw: `struct sock *`): fires in a TCP
/// receive after each run of bytes is copied to the application (peeks
/// too), in the receiving task. Reports what the server read since the
/// last report (`copied_seq` moved), for followed connections only. The
/// end of the stream is told by the connection's state (`CLOSE_WAIT`).
#[raw_tracepoint(tracepoint = "tcp_rcv_space_adjust")]
pub fn tcp_rcv_space_adjust(ctx: RawTracePointContext) -> i32 {
    let sk: u64 = ctx.arg(0);
    let Some(state) = followed(sk) else {
        return 0;
    };
    let Some(copied) = kernel::<u32>(sk + u64::from(send_offsets().copied_seq)) else {
        return 0;
    };
    // SAFETY: live map value.
    let read = copied.wrapping_sub(unsafe { (*state).recv_seq }) as i32;
    if read <= 0 {
        return 0;
    }
    // SAFETY: as above.
    unsafe { (*state).recv_seq = copied };
    report_recv(sk, state, read);
    0
}

#[inline(always)]
fn stash(args: SendArgs) -> u32 {
    let id = bpf_get_current_pid_tgid();
    if is_tracked((id >> 32) as u32) {
        let _ = SEND_ARGS.insert(id as u32, args, 0);
    }
    0
}

/// `syscalls:sys_enter_write`.
#[tracepoint]
pub fn sys_enter_write(ctx: TracePointContext) -> u32 {
    let buf = read::<u64>(&ctx, offsets().write_buf).unwrap_or(0);
    stash(SendArgs {
        buf,
        ..SendArgs::default()
    })
}

/// `syscalls:sys_enter_sendto`.
#[tracepoint]
pub fn sys_enter_sendto(ctx: TracePointContext) -> u32 {
    let buf = read::<u64>(&ctx, offsets().sendto_buf).unwrap_or(0);
    stash(SendArgs {
        buf,
        ..SendArgs::default()
    })
}

/// `syscalls:sys_enter_writev`.
#[tracepoint]
pub fn sys_enter_writev(ctx: TracePointContext) -> u32 {
    let off = offsets();
    let iov = read::<u64>(&ctx, off.writev_vec).unwrap_or(0);
    let iovlen = read::<u64>(&ctx, off.writev_vlen).unwrap_or(0);
    stash(SendArgs {
        iov,
        iovlen,
        ..SendArgs::default()
    })
}

/// `syscalls:sys_enter_sendmsg`: the iovec array is in the user msghdr
/// (`msg_iov` at offset 16, `msg_iovlen` at 24: the stable 64-bit ABI).
#[tracepoint]
pub fn sys_enter_sendmsg(ctx: TracePointContext) -> u32 {
    let msg = read::<u64>(&ctx, offsets().sendmsg_msg).unwrap_or(0);
    // SAFETY: bpf_probe_read_user checks the addresses.
    let iov =
        unsafe { aya_ebpf::helpers::bpf_probe_read_user((msg + 16) as *const u64) }.unwrap_or(0);
    // SAFETY: as above.
    let iovlen =
        unsafe { aya_ebpf::helpers::bpf_probe_read_user((msg + 24) as *const u64) }.unwrap_or(0);
    stash(SendArgs {
        iov,
        iovlen,
        ..SendArgs::default()
    })
}

/// `syscalls:sys_exit_{write,sendto,writev,sendmsg}`: the buffer is gone.
#[tracepoint]
pub fn sys_exit_send(_ctx: TracePointContext) -> u32 {
    let id = bpf_get_current_pid_tgid();
    if is_tracked((id >> 32) as u32) {
        let _ = SEND_ARGS.remove(id as u32);
    }
    0
}
