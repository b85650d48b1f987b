//! `tcp:tcp_probe` on followed server connections: when the client's
//! segments arrive and what they acknowledge, so that userspace can tell when
//! the first token reached the client (see
//! [`ttft_trace_common::SegmentEvent`]).
//!
//! Thin by design: one map lookup for every segment on the host, and an
//! event only for a followed connection's segment that carries data (a
//! request) or acknowledges something new. Pure duplicate ACKs and window
//! updates stay in the kernel.
//!
//! A connection opened before tracing began (a gateway's keep-alive pool
//! lives for hours) is adopted here at its next request: a segment with
//! data for an unknown socket whose local port is a followed listening
//! port. That costs one more lookup per data segment of other connections.

use aya_ebpf::{helpers::bpf_probe_read_kernel, macros::tracepoint, programs::TracePointContext};
use ttft_trace_common::{
    CONN_OPEN, ConnEvent, ConnState, EVENT_CONN, EVENT_SEGMENT, SEGMENT_ACK_EXACT, SEGMENT_ACKED,
    SEGMENT_DATA, SegmentEvent, Stat, TracepointOffsets, offsets::ABSENT,
};

use crate::{
    listen,
    maps::{CONNS, EVENTS, bump_stat, offsets, wakeup_flag},
    sock::{followed_from_now, now_ns, read},
};

const TCP_ESTABLISHED: u32 = 1;
const AF_INET: u16 = 2;

/// `tcp:tcp_probe`: fires at the start of `tcp_rcv_established`, before the
/// segment is processed (so `snd_una` is what the previous segment left).
#[tracepoint]
pub fn tcp_probe(ctx: TracePointContext) -> u32 {
    let off = offsets();
    let Some(sk) = read::<u64>(&ctx, off.probe_sk) else {
        return 0;
    };
    let Some(state) = CONNS.get_ptr_mut(sk).or_else(|| adopt(&ctx, sk)) else {
        return 0;
    };
    let (Some(data_len), Some(snd_nxt), Some(snd_una)) = (
        read::<u16>(&ctx, off.probe_data_len),
        read::<u32>(&ctx, off.probe_snd_nxt),
        read::<u32>(&ctx, off.probe_snd_una),
    ) else {
        return 0;
    };
    let now = now_ns();
    // SAFETY: live map value; the socket lock serialises this tracepoint per
    // socket, and the socket probes touch other fields.
    let (t_prev, prev_una) = unsafe { ((*state).probe_t_ns, (*state).probe_snd_una) };
    // SAFETY: as above.
    unsafe {
        (*state).probe_t_ns = now;
        (*state).probe_snd_una = snd_una;
    }
    let mut flags = 0;
    if data_len > 0 {
        flags |= SEGMENT_DATA;
    }
    let ack_seq = own_ack(&ctx, &off);
    match ack_seq {
        // New bytes acknowledged: after `snd_una`, not past `snd_nxt` (the
        // kernel ignores an ACK of what was never sent).
        Some(ack) => {
            flags |= SEGMENT_ACK_EXACT;
            let new = ack.wrapping_sub(snd_una);
            if new != 0 && new <= snd_nxt.wrapping_sub(snd_una) {
                flags |= SEGMENT_ACKED;
            }
        }
        None if t_prev != 0 && snd_una != prev_una => flags |= SEGMENT_ACKED,
        None => {}
    }
    if flags == 0 {
        return 0;
    }
    let ev = SegmentEvent {
        kind: EVENT_SEGMENT,
        flags,
        sk,
        t_ns: now,
        t_prev_ns: t_prev,
        snd_una,
        snd_nxt,
        srtt_us: read::<u32>(&ctx, off.probe_srtt).unwrap_or(0),
        data_len: u32::from(data_len),
        ack_seq: ack_seq.unwrap_or(0),
        _pad: 0,
    };
    match EVENTS.reserve::<SegmentEvent>(0) {
        Some(mut entry) => {
            entry.write(ev);
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
    0
}

/// The segment's acknowledgment number, from its `tcp_skb_cb` (filled
/// before `tcp_rcv_established` runs), where this kernel lets us find it.
#[inline(always)]
fn own_ack(ctx: &TracePointContext, off: &TracepointOffsets) -> Option<u32> {
    if off.probe_skb == ABSENT || off.skb_ack_seq == ABSENT {
        return None;
    }
    let skb = read::<u64>(ctx, off.probe_skb)?;
    // SAFETY: the helper checks the address.
    unsafe { bpf_probe_read_kernel((skb + u64::from(off.skb_ack_seq)) as *const u32) }.ok()
}

/// A data segment of a socket not followed, whose local port is a followed
/// listening port: a server connection opened before tracing began. It is
/// followed from now on, announced as opened now (`CONN_OPEN` with both
/// states `ESTABLISHED`).
#[inline(always)]
fn adopt(ctx: &TracePointContext, sk: u64) -> Option<*mut ConnState> {
    let off = offsets();
    if read::<u16>(ctx, off.probe_data_len)? == 0 {
        return None;
    }
    let sport = read::<u16>(ctx, off.probe_sport)?;
    if !listen::is_followed(sk, sport) {
        return None;
    }
    // Before this segment is processed: its data is the request's.
    CONNS.insert(sk, followed_from_now(sk), 0).ok()?;
    let family = read::<u16>(ctx, off.probe_family).unwrap_or(0);
    let mut ev = ConnEvent {
        kind: EVENT_CONN,
        op: CONN_OPEN,
        oldstate: TCP_ESTABLISHED,
        newstate: TCP_ESTABLISHED,
        sk,
        t_ns: now_ns(),
        family,
        sport,
        dport: read::<u16>(ctx, off.probe_dport).unwrap_or(0),
        ..ConnEvent::default()
    };
    // `sockaddr_in` has the address at byte 4, `sockaddr_in6` at byte 8.
    if family == AF_INET {
        ev.saddr[..4].copy_from_slice(&read::<[u8; 4]>(ctx, off.probe_saddr + 4).unwrap_or([0; 4]));
        ev.daddr[..4].copy_from_slice(&read::<[u8; 4]>(ctx, off.probe_daddr + 4).unwrap_or([0; 4]));
    } else {
        ev.saddr = read::<[u8; 16]>(ctx, off.probe_saddr + 8).unwrap_or([0; 16]);
        ev.daddr = read::<[u8; 16]>(ctx, off.probe_daddr + 8).unwrap_or([0; 16]);
    }
    match EVENTS.reserve::<ConnEvent>(0) {
        Some(mut entry) => {
            entry.write(ev);
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
    CONNS.get_ptr_mut(sk)
}
