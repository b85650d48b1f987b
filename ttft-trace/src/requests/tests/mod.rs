//! Scenario tests: event sequences as the kernel would send them, and the
//! requests the correlator must make of them. They are the specification.

mod bounds;
mod chunk_delivery;
mod delivery;
mod framing;
mod http1;
mod http2;
mod join;
mod output;
mod retries;
mod stream_end;
mod stream_stalls;
mod tls;

use std::collections::HashMap;

use ttft_trace_common::{
    CONN_CLOSE, CONN_OPEN, CONN_STATE, ConnEvent, EVENT_CONN, EVENT_EPISODE, EVENT_SEGMENT,
    EpisodeEvent, SEGMENT_ACK_EXACT, SEGMENT_ACKED, SEGMENT_DATA, SOCK_RECV, SOCK_SEND,
    SOCK_TLS_PLAIN, SegmentEvent, SockEvent,
    event::{HEAD_BYTES, HEAD_IOV_WALKED, HEAD_SENDS, SEND_IOV_WALKED, TAIL_BUFFERS, TAIL_BYTES},
};

use super::{Correlator, CorrelatorConfig, RequestRecord};

/// TCP states (`include/net/tcp_states.h`).
pub(super) const TCP_ESTABLISHED: u32 = 1;
pub(super) const TCP_SYN_RECV: u32 = 3;
pub(super) const TCP_FIN_WAIT1: u32 = 4;
pub(super) const TCP_FIN_WAIT2: u32 = 5;
pub(super) const TCP_CLOSE: u32 = 7;
pub(super) const TCP_CLOSE_WAIT: u32 = 8;
pub(super) const TCP_LAST_ACK: u32 = 9;

/// Milliseconds in nanoseconds.
pub(super) const fn ms(v: u64) -> u64 {
    v * 1_000_000
}

pub(super) const SERVER_PID: u32 = 10;
pub(super) const GPU_PID: u32 = 77;

/// The kernel's side, simulated: builds events the way the probes fill
/// them (a head only for the first sends after a receive, a tail always).
pub(super) struct Wire {
    pub c: Correlator,
    sends_since_recv: HashMap<u64, u32>,
    seq: HashMap<u64, Seq>,
    /// Sends after each receive that carry a head ([`HEAD_SENDS`] as the
    /// probes do; more to model a capture of every send).
    pub head_sends: u32,
    /// Segments carry their own acknowledgment number
    /// (`SEGMENT_ACK_EXACT`), as on kernels where the probe can read it.
    pub exact_acks: bool,
    /// The TLS call the sends and receives are made in
    /// ([`SockEvent::flags`]; 0: none).
    pub tls_flags: u32,
}

/// A server socket's send sequence space, as `tcp_probe` reads it, and the
/// kernel probe's per-socket memory of the previous segment.
#[derive(Debug, Default)]
struct Seq {
    snd_nxt: u32,
    snd_una: u32,
    /// (time, snd_una) at the previous probe.
    last: Option<(u64, u32)>,
}

impl Wire {
    pub fn new() -> Self {
        Self::with(CorrelatorConfig::default())
    }

    pub fn with(cfg: CorrelatorConfig) -> Self {
        Self {
            c: Correlator::new(cfg),
            sends_since_recv: HashMap::new(),
            seq: HashMap::new(),
            head_sends: HEAD_SENDS,
            exact_acks: false,
            tls_flags: 0,
        }
    }

    /// A client on port `40000 + sk` connects to 127.0.0.1:8000.
    pub fn open(&mut self, sk: u64, t: u64) {
        self.c.on_conn(&conn(CONN_OPEN, sk, t));
    }

    /// A connection opens at `t` with the handshake's `snd_nxt` known (the
    /// kernel's BTF offsets), its sequence numbers from `isn`.
    pub fn open_at_handshake(&mut self, sk: u64, t: u64, isn: u32) {
        let mut ev = conn(CONN_OPEN, sk, t);
        (ev.oldstate, ev.newstate) = (TCP_SYN_RECV, TCP_ESTABLISHED);
        (ev.snd_nxt, ev.snd_nxt_known) = (isn, 1);
        self.c.on_conn(&ev);
        self.seq_from(sk, isn);
    }

    /// The connection closes and the kernel is done with it at once (as a
    /// reset does): `ESTABLISHED -> CLOSE`.
    pub fn close(&mut self, sk: u64, t: u64) {
        self.state(CONN_CLOSE, sk, t, TCP_ESTABLISHED, TCP_CLOSE);
    }

    /// A state change of a closing connection; a close carries the time
    /// of the last segment the probe saw ([`Wire::segment`]).
    pub fn state(&mut self, op: u32, sk: u64, t: u64, old: u32, new: u32) {
        let mut ev = conn(op, sk, t);
        (ev.oldstate, ev.newstate) = (old, new);
        if op == CONN_CLOSE {
            ev.t_last_segment_ns = self.seq.get(&sk).and_then(|q| q.last).map_or(0, |(t, _)| t);
        }
        self.c.on_conn(&ev);
    }

    pub fn recv(&mut self, sk: u64, t: u64, bytes: i64) {
        self.sends_since_recv.insert(sk, 0);
        self.c.on_sock(&self.recv_event(sk, t, bytes));
    }

    pub fn recv_event(&self, sk: u64, t: u64, bytes: i64) -> SockEvent {
        SockEvent {
            dir: SOCK_RECV,
            tgid: SERVER_PID,
            tid: SERVER_PID + 1,
            sk,
            t_ns: t,
            bytes,
            flags: self.tls_flags,
            ..SockEvent::default()
        }
    }

    /// A send of `data`, captured as the probes would.
    pub fn send(&mut self, sk: u64, t: u64, data: &[u8]) {
        let ev = self.send_event(sk, t, data);
        self.c.on_sock(&ev);
        if let Some(q) = self.seq.get_mut(&sk) {
            q.snd_nxt = q.snd_nxt.wrapping_add(ev.bytes as u32);
        }
    }

    /// A vectored send (`writev`) of `bufs`, captured as the probes would
    /// (`sock_event.rs`): the head across the first [`HEAD_IOV_WALKED`]
    /// buffers, the tail across the last [`TAIL_BUFFERS`]; none where the
    /// last byte lies past the first [`SEND_IOV_WALKED`], as the syscall
    /// hook reads it (the TCP hook finds it from the end).
    pub fn send_vectored(&mut self, sk: u64, t: u64, bufs: &[&[u8]]) {
        let data = bufs.concat();
        let mut ev = self.send_event(sk, t, &data);
        let walked = bufs.len().min(SEND_IOV_WALKED as usize);
        let head = bufs[..bufs.len().min(HEAD_IOV_WALKED as usize)].concat();
        ev.head_len = (ev.head_len as usize).min(head.len()) as u32;
        let mut done = 0;
        let last = bufs[..walked].iter().position(|b| {
            done += b.len();
            done >= data.len()
        });
        ev.tail = [0; TAIL_BYTES];
        ev.tail_len = 0;
        if let Some(last) = last {
            let from = (last + 1).saturating_sub(TAIL_BUFFERS as usize);
            let seen = bufs[from..=last].concat();
            let k = seen.len().min(TAIL_BYTES);
            ev.tail[..k].copy_from_slice(&seen[seen.len() - k..]);
            ev.tail_len = k as u32;
        }
        self.c.on_sock(&ev);
        if let Some(q) = self.seq.get_mut(&sk) {
            q.snd_nxt = q.snd_nxt.wrapping_add(data.len() as u32);
        }
    }

    /// Follows the socket's sequence numbers from `isn` (sends advance
    /// `snd_nxt`; [`Wire::segment`] makes the probe's events).
    pub fn seq_from(&mut self, sk: u64, isn: u32) {
        self.seq.insert(
            sk,
            Seq {
                snd_nxt: isn,
                snd_una: isn,
                last: None,
            },
        );
    }

    /// A segment from the client arriving at `t` with `data_len` bytes and
    /// acknowledging every byte sent so far, turned into what the kernel
    /// probe sends: it sees the state before the segment is processed.
    pub fn segment(&mut self, sk: u64, t: u64, data_len: u32) {
        let ack = self.seq.get(&sk).expect("seq_from first").snd_nxt;
        self.segment_acking(sk, t, data_len, ack);
    }

    /// A segment from the client that acknowledges nothing new (a
    /// duplicate ACK, or a window update).
    pub fn dup_ack(&mut self, sk: u64, t: u64) {
        let ack = self.seq.get(&sk).expect("seq_from first").snd_una;
        self.segment_acking(sk, t, 0, ack);
    }

    /// A segment from the client acknowledging the bytes before `ack`.
    fn segment_acking(&mut self, sk: u64, t: u64, data_len: u32, ack: u32) {
        let q = self.seq.get_mut(&sk).expect("seq_from first");
        let mut flags = 0;
        if data_len > 0 {
            flags |= SEGMENT_DATA;
        }
        let t_prev = match q.last {
            Some((t_prev, una)) if !self.exact_acks && una != q.snd_una => {
                flags |= SEGMENT_ACKED;
                t_prev
            }
            Some((t_prev, _)) => t_prev,
            None => 0,
        };
        if self.exact_acks {
            flags |= SEGMENT_ACK_EXACT;
            if ack != q.snd_una {
                flags |= SEGMENT_ACKED;
            }
        }
        let ev = SegmentEvent {
            kind: EVENT_SEGMENT,
            flags,
            sk,
            t_ns: t,
            t_prev_ns: t_prev,
            snd_una: q.snd_una,
            snd_nxt: q.snd_nxt,
            srtt_us: 50,
            data_len,
            ack_seq: if self.exact_acks { ack } else { 0 },
            _pad: 0,
        };
        q.last = Some((t, q.snd_una));
        q.snd_una = ack;
        if flags & !SEGMENT_ACK_EXACT != 0 {
            self.c.on_segment(&ev);
        }
    }

    pub fn send_event(&mut self, sk: u64, t: u64, data: &[u8]) -> SockEvent {
        let n = self.sends_since_recv.entry(sk).or_insert(0);
        *n += 1;
        let mut ev = SockEvent {
            dir: SOCK_SEND,
            tgid: SERVER_PID,
            tid: SERVER_PID + 2,
            sk,
            t_ns: t,
            bytes: data.len() as i64,
            flags: self.tls_flags,
            ..SockEvent::default()
        };
        if self.tls_flags == SOCK_TLS_PLAIN {
            // One record: its header, type and tag on the wire (TLS 1.3).
            ev.plain_bytes = data.len() as u32;
            ev.bytes += 22;
        }
        if *n <= self.head_sends {
            let h = data.len().min(HEAD_BYTES);
            ev.head[..h].copy_from_slice(&data[..h]);
            ev.head_len = h as u32;
        }
        let k = data.len().min(TAIL_BYTES);
        ev.tail[..k].copy_from_slice(&data[data.len() - k..]);
        ev.tail_len = k as u32;
        ev
    }

    /// A GPU episode of the worker process.
    pub fn episode(&mut self, launch: u64, done: u64) {
        self.c.on_episode(&EpisodeEvent {
            kind: EVENT_EPISODE,
            tgid: GPU_PID,
            tid: GPU_PID + 1,
            t_first_launch_ns: launch,
            t_copy_enqueue_ns: done.saturating_sub(1),
            t_copy_done_ns: done,
            ..EpisodeEvent::default()
        });
    }

    pub fn drain(&mut self, now: u64) -> Vec<RequestRecord> {
        self.c.drain_finished(now)
    }

    /// Drains at `now` and expects exactly one request.
    pub fn one(&mut self, now: u64) -> RequestRecord {
        let mut v = self.drain(now);
        assert_eq!(v.len(), 1, "{v:#?}");
        v.remove(0)
    }
}

fn conn(op: u32, sk: u64, t: u64) -> ConnEvent {
    let mut ev = ConnEvent {
        kind: EVENT_CONN,
        op,
        sk,
        t_ns: t,
        family: 2,
        sport: 8000,
        dport: 40000u16.wrapping_add(sk as u16),
        ..ConnEvent::default()
    };
    ev.saddr[..4].copy_from_slice(&[127, 0, 0, 1]);
    ev.daddr[..4].copy_from_slice(&[127, 0, 0, 2]);
    ev
}

/// Response headers of a streamed (SSE, chunked) response.
pub(super) const SSE_HEADERS: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
    transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n";

/// One SSE event as one chunk of a chunked body.
pub(super) fn sse_chunk(text: &str) -> Vec<u8> {
    let event = format!("data: {{\"choices\":[{{\"text\":\"{text}\"}}]}}\n\n");
    format!("{:x}\r\n{event}\r\n", event.len()).into_bytes()
}

/// The last event and the terminator, in one send as many servers do.
pub(super) fn sse_done() -> Vec<u8> {
    let event = "data: [DONE]\n\n";
    format!("{:x}\r\n{event}\r\n0\r\n\r\n", event.len()).into_bytes()
}

/// A whole `Content-Length` response.
pub(super) fn json_response(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}
