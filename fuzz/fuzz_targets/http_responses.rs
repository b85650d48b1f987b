//! The request correlator fed what a traced server can send: any bytes in
//! any number of sends, on a few connections, interleaved with receives,
//! closes, GPU episodes and client segments. It must never panic, and the
//! figures it reports must keep their definitions (queue + GPU + egress =
//! TTFT; no figure before the request's arrival).

#![no_main]

use libfuzzer_sys::fuzz_target;
use ttft_trace::requests::{Correlator, CorrelatorConfig, RequestRecord};
use ttft_trace_common::{
    CONN_CLOSE, CONN_OPEN, ConnEvent, EVENT_CONN, EVENT_EPISODE, EVENT_SEGMENT, EpisodeEvent,
    SEGMENT_ACKED, SEGMENT_DATA, SOCK_RECV, SOCK_SEND, SegmentEvent, SockEvent,
    event::{HEAD_BYTES, HEAD_SENDS, TAIL_BYTES},
};

const MS: u64 = 1_000_000;

/// Reads the input as a stream of small numbers and byte runs.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }
}

fn check(r: &RequestRecord) {
    if let (Some(q), Some(g), Some(e), Some(ttft)) = (r.queue_ns, r.gpu_ns, r.egress_ns, r.ttft_ns)
    {
        assert_eq!(q + g + e, ttft, "the breakdown adds up to TTFT: {r:?}");
    }
    for t in [r.t_first_byte_ns, r.t_first_token_ns, r.t_done_ns]
        .into_iter()
        .flatten()
    {
        assert!(t >= r.t_arrive_ns, "nothing before the arrival: {r:?}");
    }
    if let (Some(e2e), Some(ttft)) = (r.e2e_ns, r.ttft_ns) {
        assert!(e2e >= ttft, "E2E covers TTFT: {r:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let mut c = Correlator::new(CorrelatorConfig::default());
    let mut t = 1_000 * MS;
    let mut sends_since_recv = [0u32; 4];
    while let Some(op) = input.byte() {
        t += u64::from(input.byte().unwrap_or(0)) * MS / 4;
        let slot = usize::from(input.byte().unwrap_or(0) % 4);
        let sk = slot as u64 + 1;
        match op % 8 {
            0 => c.on_conn(&ConnEvent {
                kind: EVENT_CONN,
                op: CONN_OPEN,
                newstate: 1,
                sk,
                t_ns: t,
                family: 2,
                sport: 8000,
                dport: 40000 + slot as u16,
                // Half the connections with the handshake's sequence known.
                snd_nxt_known: u32::from(slot % 2 == 0),
                ..ConnEvent::default()
            }),
            1 => {
                sends_since_recv[slot] = 0;
                let bytes = i64::from(input.byte().unwrap_or(0)) * 8 - 64;
                c.on_sock(&SockEvent {
                    dir: SOCK_RECV,
                    tgid: 10,
                    tid: 11,
                    sk,
                    t_ns: t,
                    bytes,
                    // Outside a TLS call, or inside one (any mix of the
                    // flags the kernel sets, and some it never does).
                    flags: u32::from(input.byte().unwrap_or(0) % 8),
                    ..SockEvent::default()
                });
            }
            2 | 3 => {
                // A send of the next bytes, captured as the probes do: the
                // head of the first sends after a receive, every tail.
                let len = usize::from(input.byte().unwrap_or(0));
                let sent = input.bytes(len);
                sends_since_recv[slot] += 1;
                let flags = u32::from(input.byte().unwrap_or(0) % 4);
                let mut ev = SockEvent {
                    dir: SOCK_SEND,
                    tgid: 10,
                    tid: 12,
                    sk,
                    t_ns: t,
                    // Inside `SSL_write`: the wire's bytes are the records'.
                    bytes: sent.len() as i64 + i64::from(flags & 1) * 22,
                    flags,
                    plain_bytes: sent.len() as u32,
                    ..SockEvent::default()
                };
                if sends_since_recv[slot] <= HEAD_SENDS {
                    let h = sent.len().min(HEAD_BYTES);
                    ev.head[..h].copy_from_slice(&sent[..h]);
                    ev.head_len = h as u32;
                }
                let k = sent.len().min(TAIL_BYTES);
                ev.tail[..k].copy_from_slice(&sent[sent.len() - k..]);
                ev.tail_len = k as u32;
                c.on_sock(&ev);
            }
            4 => c.on_conn(&ConnEvent {
                kind: EVENT_CONN,
                op: CONN_CLOSE,
                sk,
                t_ns: t,
                ..ConnEvent::default()
            }),
            5 => {
                let run = u64::from(input.byte().unwrap_or(0)) * MS / 2;
                c.on_episode(&EpisodeEvent {
                    kind: EVENT_EPISODE,
                    tgid: 10,
                    tid: 13,
                    t_first_launch_ns: t.saturating_sub(run),
                    t_copy_enqueue_ns: t.saturating_sub(run / 2),
                    t_copy_done_ns: t,
                    ..EpisodeEvent::default()
                });
            }
            6 => {
                let n = input.bytes(8);
                let mut seq = [0u8; 4];
                seq[..n.len().min(4)].copy_from_slice(&n[..n.len().min(4)]);
                c.on_segment(&SegmentEvent {
                    kind: EVENT_SEGMENT,
                    flags: if op & 8 == 0 {
                        SEGMENT_DATA
                    } else {
                        SEGMENT_ACKED
                    },
                    sk,
                    t_ns: t,
                    snd_una: u32::from_le_bytes(seq),
                    snd_nxt: u32::from_le_bytes(seq).wrapping_add(u32::from(n.len() as u8)),
                    data_len: if op & 8 == 0 { n.len() as u32 } else { 0 },
                    ..SegmentEvent::default()
                });
            }
            _ => c.drain_finished(t).iter().for_each(check),
        }
    }
    c.drain_finished(t + 3_600_000 * MS).iter().for_each(check);
    c.flush().iter().for_each(check);
});
