//! `tcp:tcp_probe` on followed server connections: when the client's
//! segments arrive and what they acknowledge, so that userspace can tell when
//! the first token reached the client (see
//! [`ttft_trace_common::SegmentEvent`]).
//!
//! Thin by design: a read of the local port and one map lookup for every
//! segment on the host, and an event only for a followed connection's
//! segment that carries data (a request) or acknowledges something new.
//! Pure duplicate ACKs and window updates stay in the kernel.
//!
//! Two programs share the logic ([`on_segment`]): the raw tracepoint
//! (default), whose arguments are the socket and the segment, so that a
//! segment of a connection not followed costs the dispatch and the lookup;
//! and the classic tracepoint (fallback), before which the kernel fills a
//! perf record of every segment on the host (addresses, ports, sequence
//! numbers, window) that the program then mostly ignores.
//!
//! A connection opened before tracing began (a gateway's keep-alive pool
//! lives for hours) is adopted here at its next request: a segment with
//! data for an unknown socket whose local port is a followed listening
//! port. That costs one more lookup per data segment of other connections
//! on that port.

use aya_ebpf::{
    helpers::bpf_probe_read_kernel,
    macros::{raw_tracepoint, tracepoint},
    programs::{RawTracePointContext, TracePointContext},
};
use ttft_trace_common::{
    CONN_MIDLIFE, CONN_OPEN, ConnEvent, ConnState, EVENT_CONN, EVENT_SEGMENT, SEGMENT_ACK_EXACT,
    SEGMENT_ACKED, SEGMENT_DATA, SegmentEvent, Stat, TracepointOffsets, offsets::ABSENT,
};

use crate::{
    listen,
    maps::{CONNS, EVENTS, bump_stat, offsets, seg_offset, wakeup_flag},
    mem::{kernel, now_ns},
    sock::{followed_from_now, read},
};

pub(crate) const TCP_ESTABLISHED: u32 = 1;
pub(crate) const AF_INET: u16 = 2;
/// `tcp_skb_cb.tcp_flags`: each takes one sequence number.
const TCPHDR_FIN: u8 = 0x01;
const TCPHDR_SYN: u8 = 0x02;

/// What [`on_segment`] needs to know of one received segment and its
/// socket: read from the classic tracepoint's record, from the kernel's
/// structs through the raw tracepoint's arguments, or from the packet and
/// the socket of a cgroup's ingress ([`crate::ingress`]).
pub(crate) trait Segment {
    /// The payload's length.
    fn data_len(&self) -> Option<u32>;
    /// The socket's `snd_nxt` and `snd_una` before this segment.
    fn snd_nxt_una(&self) -> Option<(u32, u32)>;
    /// Smoothed round trip, µs.
    fn srtt_us(&self) -> u32;
    /// The segment's own acknowledgment number, where it can be read.
    fn ack_seq(&self) -> Option<u32>;
    /// The end of what an ACK may acknowledge, given `snd_nxt` as read:
    /// `snd_nxt` itself where the segment is seen as the socket processes
    /// it.
    #[inline(always)]
    fn sent_bound(&self, snd_nxt: u32) -> u32 {
        snd_nxt
    }
    /// Local port, host order.
    fn sport(&self) -> Option<u16>;
    /// Family, remote port and both addresses, into a connection event.
    fn fill_peer(&self, ev: &mut ConnEvent);
}

/// `tcp:tcp_probe` (raw: `struct sock *`, `struct sk_buff *`): fires at the
/// start of `tcp_rcv_established`, before the segment is processed (so
/// `snd_una` is what the previous segment left).
#[raw_tracepoint(tracepoint = "tcp_probe")]
pub fn raw_tcp_probe(ctx: RawTracePointContext) -> i32 {
    let seg = Raw {
        sk: ctx.arg(0),
        skb: ctx.arg(1),
    };
    on_segment(seg.sk, &seg);
    0
}

/// `tcp:tcp_probe`, the classic tracepoint (the fallback): as
/// [`raw_tcp_probe`], from the tracepoint's record.
#[tracepoint]
pub fn tcp_probe(ctx: TracePointContext) -> u32 {
    let seg = Classic {
        ctx: &ctx,
        off: offsets(),
    };
    if let Some(sk) = read::<u64>(&ctx, seg.off.probe_sk) {
        on_segment(sk, &seg);
    }
    0
}

#[inline(always)]
pub(crate) fn on_segment<S: Segment>(sk: u64, seg: &S) {
    // Every followed connection was accepted on a followed listening port
    // (and ports are never unfollowed): the port rules out the other
    // segments on the host with one read and one lookup, before the
    // connection table's.
    let Some(sport) = seg.sport() else {
        return;
    };
    if !listen::port_followed(sport) {
        return;
    }
    let Some(state) = CONNS.get_ptr_mut(sk).or_else(|| adopt(sk, sport, seg)) else {
        return;
    };
    let (Some(data_len), Some((snd_nxt, snd_una))) = (seg.data_len(), seg.snd_nxt_una()) else {
        return;
    };
    let now = now_ns();
    // SAFETY: live map value; the socket probes touch other fields. The
    // socket lock serialises `tcp_probe` per socket; a cgroup's ingress runs
    // before the lock is taken, where a flow's segments still come one at a
    // time (one receive queue, one CPU).
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
    let ack_seq = seg.ack_seq();
    match ack_seq {
        // New bytes acknowledged: after `snd_una`, not past `snd_nxt` (the
        // kernel ignores an ACK of what was never sent).
        Some(ack) => {
            flags |= SEGMENT_ACK_EXACT;
            let new = ack.wrapping_sub(snd_una);
            if new != 0 && new <= seg.sent_bound(snd_nxt).wrapping_sub(snd_una) {
                flags |= SEGMENT_ACKED;
            }
        }
        None if t_prev != 0 && snd_una != prev_una => flags |= SEGMENT_ACKED,
        None => {}
    }
    if flags == 0 {
        return;
    }
    let ev = SegmentEvent {
        kind: EVENT_SEGMENT,
        flags,
        sk,
        t_ns: now,
        t_prev_ns: t_prev,
        snd_una,
        snd_nxt,
        srtt_us: seg.srtt_us(),
        data_len,
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
}

/// A data segment of a socket not followed, whose local port is a followed
/// listening port: a server connection opened before tracing began. It is
/// followed from now on, announced as opened now (`CONN_OPEN` with both
/// states `ESTABLISHED`).
#[inline(always)]
fn adopt<S: Segment>(sk: u64, sport: u16, seg: &S) -> Option<*mut ConnState> {
    if !listen::is_followed(sk, sport) || seg.data_len()? == 0 {
        return None;
    }
    // Before this segment is processed: its data is the request's. Its
    // protocol is told from its calls' bytes (no preface will come).
    let state = ConnState {
        h2: CONN_MIDLIFE,
        ..followed_from_now(sk)
    };
    CONNS.insert(sk, state, 0).ok()?;
    let mut ev = ConnEvent {
        kind: EVENT_CONN,
        op: CONN_OPEN,
        oldstate: TCP_ESTABLISHED,
        newstate: TCP_ESTABLISHED,
        sk,
        t_ns: now_ns(),
        sport,
        ..ConnEvent::default()
    };
    seg.fill_peer(&mut ev);
    match EVENTS.reserve::<ConnEvent>(0) {
        Some(mut entry) => {
            entry.write(ev);
            entry.submit(wakeup_flag());
        }
        None => bump_stat(Stat::RingbufLost),
    }
    CONNS.get_ptr_mut(sk)
}

/// The raw tracepoint's arguments.
struct Raw {
    sk: u64,
    skb: u64,
}

impl Raw {
    #[inline(always)]
    fn sock<T>(&self, at: u32) -> Option<T> {
        kernel::<T>(self.sk + u64::from(at))
    }

    #[inline(always)]
    fn skb<T>(&self, at: u32) -> Option<T> {
        kernel::<T>(self.skb + u64::from(at))
    }
}

impl Segment for Raw {
    #[inline(always)]
    fn data_len(&self) -> Option<u32> {
        let seq = self.skb::<u32>(seg_offset!(skb_seq))?;
        let end = self.skb::<u32>(seg_offset!(skb_end_seq))?;
        let flags = self.skb::<u8>(seg_offset!(skb_tcp_flags))?;
        let control = u32::from(flags & TCPHDR_FIN != 0) + u32::from(flags & TCPHDR_SYN != 0);
        Some(end.wrapping_sub(seq).saturating_sub(control))
    }

    #[inline(always)]
    fn snd_nxt_una(&self) -> Option<(u32, u32)> {
        Some((
            self.sock(seg_offset!(snd_nxt))?,
            self.sock(seg_offset!(snd_una))?,
        ))
    }

    #[inline(always)]
    fn srtt_us(&self) -> u32 {
        // The kernel keeps it shifted left by 3 (the classic record is not).
        self.sock::<u32>(seg_offset!(srtt_us)).unwrap_or(0) >> 3
    }

    #[inline(always)]
    fn ack_seq(&self) -> Option<u32> {
        self.skb(seg_offset!(skb_ack_seq))
    }

    #[inline(always)]
    fn sport(&self) -> Option<u16> {
        self.sock(seg_offset!(num))
    }

    #[inline(always)]
    fn fill_peer(&self, ev: &mut ConnEvent) {
        ev.family = self.sock::<u16>(seg_offset!(family)).unwrap_or(0);
        ev.dport = u16::from_be(self.sock::<u16>(seg_offset!(dport)).unwrap_or(0));
        if ev.family == AF_INET {
            ev.saddr[..4].copy_from_slice(
                &self
                    .sock::<[u8; 4]>(seg_offset!(rcv_saddr))
                    .unwrap_or([0; 4]),
            );
            ev.daddr[..4]
                .copy_from_slice(&self.sock::<[u8; 4]>(seg_offset!(daddr)).unwrap_or([0; 4]));
        } else {
            ev.saddr = self.sock(seg_offset!(v6_rcv_saddr)).unwrap_or([0; 16]);
            ev.daddr = self.sock(seg_offset!(v6_daddr)).unwrap_or([0; 16]);
        }
    }
}

/// The classic tracepoint's record and its field offsets (from tracefs).
struct Classic<'a> {
    ctx: &'a TracePointContext,
    off: TracepointOffsets,
}

impl Segment for Classic<'_> {
    #[inline(always)]
    fn data_len(&self) -> Option<u32> {
        read::<u16>(self.ctx, self.off.probe_data_len).map(u32::from)
    }

    #[inline(always)]
    fn snd_nxt_una(&self) -> Option<(u32, u32)> {
        Some((
            read(self.ctx, self.off.probe_snd_nxt)?,
            read(self.ctx, self.off.probe_snd_una)?,
        ))
    }

    #[inline(always)]
    fn srtt_us(&self) -> u32 {
        read::<u32>(self.ctx, self.off.probe_srtt).unwrap_or(0)
    }

    /// From the segment's `tcp_skb_cb`, where this kernel's record has the
    /// segment's address and BTF gave the offset.
    #[inline(always)]
    fn ack_seq(&self) -> Option<u32> {
        if self.off.probe_skb == ABSENT || self.off.skb_ack_seq == ABSENT {
            return None;
        }
        let skb = read::<u64>(self.ctx, self.off.probe_skb)?;
        // SAFETY: the helper checks the address.
        unsafe { bpf_probe_read_kernel((skb + u64::from(self.off.skb_ack_seq)) as *const u32) }.ok()
    }

    #[inline(always)]
    fn sport(&self) -> Option<u16> {
        read(self.ctx, self.off.probe_sport)
    }

    #[inline(always)]
    fn fill_peer(&self, ev: &mut ConnEvent) {
        let (ctx, off) = (self.ctx, &self.off);
        ev.family = read::<u16>(ctx, off.probe_family).unwrap_or(0);
        ev.dport = read::<u16>(ctx, off.probe_dport).unwrap_or(0);
        // `sockaddr_in` has the address at byte 4, `sockaddr_in6` at byte 8.
        if ev.family == AF_INET {
            ev.saddr[..4]
                .copy_from_slice(&read::<[u8; 4]>(ctx, off.probe_saddr + 4).unwrap_or([0; 4]));
            ev.daddr[..4]
                .copy_from_slice(&read::<[u8; 4]>(ctx, off.probe_daddr + 4).unwrap_or([0; 4]));
        } else {
            ev.saddr = read::<[u8; 16]>(ctx, off.probe_saddr + 8).unwrap_or([0; 16]);
            ev.daddr = read::<[u8; 16]>(ctx, off.probe_daddr + 8).unwrap_or([0; 16]);
        }
    }
}
