//! When the first token reached the client: TCP sequence numbers of the
//! server's own socket (from `tcp:tcp_probe`, see
//! [`ttft_trace_common::SegmentEvent`]) matched against the response bytes
//! the server sent.
//!
//! - The request's first segment carries the socket's `snd_nxt`: on an
//!   HTTP/1.1 connection the client sends a request only once it has the
//!   whole previous response, so every byte sent before was transmitted,
//!   and the response starts at that sequence number.
//! - The first token's last byte is then `snd_nxt + bytes sent up to and
//!   including the first-token send` (interim responses and headers count:
//!   they are bytes of the stream).
//! - The client acknowledged it at the first ACK whose `snd_una` reaches
//!   past that byte (compared modulo 2^32, as TCP does).
//!
//! - What a segment acknowledged is its own acknowledgment number, read
//!   from the kernel's control block of the segment where the kernel lets
//!   us find it (`SEGMENT_ACK_EXACT`); otherwise it shows as the move of
//!   `snd_una` at the next segment, and is dated to the previous one.
//!
//! After the server's close, `tcp_probe` (in `tcp_rcv_established`) sees no
//! more segments; the kernel still retransmits and takes ACKs. The state
//! change that says the client acknowledged everything sent (our FIN
//! included: `FIN_WAIT1 -> FIN_WAIT2`, `LAST_ACK -> CLOSE`, `CLOSING ->
//! TIME_WAIT`) then stands for the ACK of a first token still waiting: an
//! upper bound, exact when that ACK covered the whole response (a short
//! response, or a first token held back by loss until the rest had come).
//! With exact acknowledgment numbers every ACK before the close was seen,
//! so a first token still waiting was acknowledged after it. Without, only
//! when no segment arrived after the first token was sent, before the
//! close: otherwise the last one may have been its ACK, unseen, and the
//! bound could be far too late; that first token's delivery is then
//! unknown.
//!
//! Client TTFT ≈ first token acknowledged − request segment arrived: the
//! two one-way trips (request in, ACK out) stand for the client's two
//! (request out, token in). A client that delays its ACK (up to 40-200 ms
//! on Linux, when no later chunk prompts one) makes it read late; a lost
//! ACK is replaced by the next one, later still.

use std::collections::VecDeque;

use ttft_trace_common::{SEGMENT_ACK_EXACT, SEGMENT_ACKED, SEGMENT_DATA, SegmentEvent};

/// ACKs remembered per connection, for a first token registered after the
/// ACK that covers it was applied (both can fall in one socket-lock release).
const RECENT_ACKS: usize = 8;

/// Whether sequence number `a` is at or after `b`, modulo 2^32 (the
/// kernel's `!before(a, b)`): true when `a - b` wraps to less than 2^31.
pub(crate) fn seq_at_or_after(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) < 1 << 31
}

/// What segment `ev` says was acknowledged, and when: `(t_ns, snd_una)`;
/// None when it acknowledged nothing new. Its own acknowledgment number
/// where the probe reads it, else the move of `snd_una` since the previous
/// segment, dated to that one (see the module notes).
pub(crate) fn ack_of(ev: &SegmentEvent) -> Option<(u64, u32)> {
    if ev.flags & SEGMENT_ACKED == 0 {
        return None;
    }
    Some(if ev.flags & SEGMENT_ACK_EXACT != 0 {
        (ev.t_ns, ev.ack_seq)
    } else {
        (ev.t_prev_ns, ev.snd_una)
    })
}

/// An acknowledgement: the bytes before `snd_una` reached the client and
/// it said so at `t_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ack {
    pub t_ns: u64,
    pub snd_una: u32,
    /// Smoothed RTT of the socket then, in ns (the last one seen, for an
    /// ACK known from a state change).
    pub srtt_ns: u64,
    /// Known from the state change that says everything was acknowledged
    /// (after the server's close), not from the ACK itself: no later than.
    pub at_close: bool,
}

/// The request's first segment, as `tcp_probe` saw it arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RequestSegment {
    pub t_ns: u64,
    /// The sequence number the response starts at.
    pub snd_nxt: u32,
    /// Not seen: the connection's first request came with the ACK that
    /// completed the handshake, which `tcp_probe` does not see; its time
    /// and the socket's `snd_nxt` are the handshake's (see
    /// [`AckTracker::handshake`]).
    pub at_handshake: bool,
}

impl RequestSegment {
    /// The same segment, the response starting `bytes` later in sequence
    /// space (the server sent bytes of its own first: TLS records).
    pub fn after(self, bytes: u64) -> Self {
        Self {
            // Sequence numbers wrap modulo 2^32.
            snd_nxt: self.snd_nxt.wrapping_add(bytes as u32),
            ..self
        }
    }
}

/// What is known of the first token's delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Sent, not yet acknowledged; its last byte is `end_seq - 1`.
    Waiting {
        end_seq: u32,
    },
    Acked(Ack),
    /// The connection ended before an ACK was seen.
    Unknown,
}

/// What a request's record says of its first token's delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    Acked(Ack),
    /// Still not acknowledged at this time, when the wait for it ended.
    UnackedAt(u64),
    /// Not known: not awaited, the connection ended first, or the tracer
    /// stopped before the wait was over.
    Unknown,
}

/// Per connection: the next request's first segment, recent ACKs and the
/// first tokens waiting for theirs.
#[derive(Debug, Default)]
pub(crate) struct AckTracker {
    next_request: Option<RequestSegment>,
    /// The handshake's completion, standing for the first request's segment
    /// until a data segment is seen.
    handshake: Option<RequestSegment>,
    recent: VecDeque<Ack>,
    /// `(request index, end_seq, time sent)` in sending order.
    waiting: VecDeque<(u32, u32, u64)>,
    /// The segments carry their own acknowledgment numbers: every ACK the
    /// probe saw is known at once (see the module notes).
    exact: bool,
}

impl AckTracker {
    /// Applies one segment; returns the waiting first tokens it acknowledged
    /// (by request index). `idle` says whether a data segment can start a
    /// request now (no request, or its response has begun); data while a
    /// request is still being received is more of that request.
    pub fn on_segment(&mut self, ev: &SegmentEvent, idle: bool) -> Vec<(u32, Ack)> {
        let mut acked = Vec::new();
        self.exact = ev.flags & SEGMENT_ACK_EXACT != 0;
        if let Some((t_ns, snd_una)) = ack_of(ev) {
            let ack = Ack {
                t_ns,
                snd_una,
                srtt_ns: u64::from(ev.srtt_us) * 1_000,
                at_close: false,
            };
            if self.recent.len() >= RECENT_ACKS {
                self.recent.pop_front();
            }
            self.recent.push_back(ack);
            while let Some(&(index, end_seq, _)) = self.waiting.front() {
                if !seq_at_or_after(ack.snd_una, end_seq) {
                    break;
                }
                self.waiting.pop_front();
                acked.push((index, ack));
            }
        }
        if ev.flags & SEGMENT_DATA != 0 && idle && self.next_request.is_none() {
            self.next_request = Some(RequestSegment {
                t_ns: ev.t_ns,
                snd_nxt: ev.snd_nxt,
                at_handshake: false,
            });
        }
        acked
    }

    /// Whether the last segment carried its own acknowledgment number (see
    /// the module notes).
    pub fn exact(&self) -> bool {
        self.exact
    }

    /// The connection's handshake completed at `t_ns` with the socket's
    /// `snd_nxt` then. The first request's data may have come with the ACK
    /// that completed it (the client's own ACK lost, or overtaken by its
    /// request on another CPU; TCP Fast Open), which `tcp_probe` does not
    /// see: the first request then starts here. Seen on this host with 20 %
    /// loss of the server's packets (a lost SYN-ACK, then the client's ACK
    /// and request racing), and made certain by dropping the client's ACK.
    pub fn handshake(&mut self, t_ns: u64, snd_nxt: u32) {
        self.handshake = Some(RequestSegment {
            t_ns,
            snd_nxt,
            at_handshake: true,
        });
    }

    /// The first segment of a request whose first receive returned at
    /// `t_arrive`; None when none was seen since the last request began (a
    /// lost event, or a connection open before the probe): never the
    /// previous request's. For the connection's first request with no data
    /// segment seen, the handshake's.
    pub fn start_request(&mut self, t_arrive: u64) -> Option<RequestSegment> {
        let handshake = self.handshake.take();
        self.next_request
            .take()
            .or(handshake)
            .filter(|s| s.t_ns <= t_arrive)
    }

    /// A receive took TLS's own records (`requests/connection.rs`): the
    /// next request's segment is `next`, the first whose bytes it left, or
    /// one to come.
    pub fn set_request_segment(&mut self, next: Option<RequestSegment>) {
        self.next_request = next;
        self.handshake = None;
    }

    /// The server sent `bytes` of TLS's own records: a request segment
    /// waiting for its request starts its response that much later.
    pub fn sent_before_response(&mut self, bytes: u64) {
        if let Some(s) = self.next_request.as_mut() {
            *s = s.after(bytes);
        }
    }

    /// The first token of request `index` was sent at `t_ns`, its last byte
    /// ending at `end_seq`: acknowledged already, or now waiting.
    pub fn first_token(&mut self, index: u32, end_seq: u32, t_ns: u64) -> Delivery {
        if let Some(ack) = self
            .recent
            .iter()
            .find(|a| seq_at_or_after(a.snd_una, end_seq))
        {
            return Delivery::Acked(*ack);
        }
        self.waiting.push_back((index, end_seq, t_ns));
        Delivery::Waiting { end_seq }
    }

    /// The connection closed; the last segment `tcp_probe` saw arrived at
    /// `t_last_segment`. Without exact acknowledgment numbers, a first token
    /// sent before it may have been acknowledged by it, unseen: returns
    /// those, given up.
    pub fn closed(&mut self, t_last_segment: u64) -> Vec<u32> {
        if self.exact {
            return Vec::new();
        }
        let (unseen, after): (Vec<_>, Vec<_>) = self
            .waiting
            .drain(..)
            .partition(|&(_, _, sent)| sent < t_last_segment);
        self.waiting = after.into();
        unseen.into_iter().map(|(index, _, _)| index).collect()
    }

    /// Everything sent was acknowledged by `t_ns` (a state change after the
    /// server's close): the first tokens still waiting, with their ACK.
    pub fn all_acked(&mut self, t_ns: u64) -> Vec<(u32, Ack)> {
        let srtt_ns = self.recent.back().map_or(0, |a| a.srtt_ns);
        self.waiting
            .drain(..)
            .map(|(index, end_seq, _)| {
                let ack = Ack {
                    t_ns,
                    snd_una: end_seq,
                    srtt_ns,
                    at_close: true,
                };
                (index, ack)
            })
            .collect()
    }

    /// The connection ended: the first tokens still waiting will not be
    /// acknowledged where the probe sees it.
    pub fn give_up(&mut self) -> impl Iterator<Item = u32> + '_ {
        self.recent.clear();
        self.next_request = None;
        self.handshake = None;
        self.waiting.drain(..).map(|(index, _, _)| index)
    }
}

/// The first token's last byte + 1: the response's start plus every byte
/// sent for the request up to and including the first-token send.
pub(crate) fn first_token_end(seg: RequestSegment, bytes_out: u64) -> u32 {
    // Sequence numbers wrap modulo 2^32: the truncation is the arithmetic.
    seg.snd_nxt.wrapping_add(bytes_out as u32)
}
