//! `tcp:tcp_probe` on followed server connections: when the client's
//! segments arrive and what they acknowledge, so that userspace can tell when
//! the first token reached the client (see
//! [`ttft_trace_common::SegmentEvent`]).
//!
//! Thin by design: one map lookup for every segment on the host, and an
//! event only for a followed connection's segment that carries data (a
//! request) or acknowledges something new. Pure duplicate ACKs and window
//! updates stay in the kernel.

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use ttft_trace_common::{EVENT_SEGMENT, SEGMENT_ACKED, SEGMENT_DATA, SegmentEvent, Stat};

use crate::{
    maps::{CONNS, EVENTS, bump_stat, offsets, wakeup_flag},
    sock::{now_ns, read},
};

/// `tcp:tcp_probe`: fires at the start of `tcp_rcv_established`, before the
/// segment is processed (so `snd_una` is what the previous segment left).
#[tracepoint]
pub fn tcp_probe(ctx: TracePointContext) -> u32 {
    let off = offsets();
    let Some(sk) = read::<u64>(&ctx, off.probe_sk) else {
        return 0;
    };
    let Some(state) = CONNS.get_ptr_mut(sk) else {
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
    if t_prev != 0 && snd_una != prev_una {
        flags |= SEGMENT_ACKED;
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
