//! The correlator: connection and socket events in time order through the
//! per-connection state machines, GPU episodes into a bounded history, and
//! finished requests out, joined to the episodes once late ones had time
//! to arrive.

use std::{
    cmp::{Ordering, Reverse},
    collections::{BinaryHeap, HashMap, VecDeque},
};

use serde::Serialize;
use ttft_trace_common::{
    CONN_CLOSE, CONN_OPEN, CONN_STATE, ConnEvent, EpisodeEvent, SOCK_RECV, SOCK_SEND, SegmentEvent,
    SockEvent,
    h2::{H2BlockEvent, H2FramesEvent},
};

use super::{
    connection::{ConnInfo, Connection, Outbox, TCP_CLOSE, TCP_ESTABLISHED},
    delivery::{Delivery, Seen},
    join::EpisodeHistory,
    record::RequestRecord,
};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

/// How often connections are checked for idleness.
const SWEEP_EVERY_NS: u64 = S;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorrelatorConfig {
    /// Most inter-token gaps kept per request (JSONL and histograms).
    pub itl_cap: usize,
    /// Connection and socket events are applied in timestamp order once
    /// they are this much older than `now`: events from different CPUs can
    /// arrive out of order by a few milliseconds.
    pub reorder_window_ns: u64,
    /// A request is joined to the episodes this long after its first token,
    /// so that an episode event arriving a little after the send counts.
    pub join_grace_ns: u64,
    /// Episodes older than this are forgotten: a TTFT longer than it loses
    /// the start of its join window.
    pub episode_history_ns: u64,
    pub episode_cap: usize,
    /// A request whose first token is not yet acknowledged by the client
    /// (see `requests/delivery.rs`) is held up to this long after the first
    /// token, then reported without a delivery time. 5 s covers Linux's
    /// 200 ms minimum retransmission timeout doubled four times.
    pub ack_wait_ns: u64,
    /// A finished request whose chunks are not all acknowledged (see
    /// `requests/chunk_delivery.rs`) is held up to this long after its
    /// last send, then reported with the deliveries seen. 1 s covers a
    /// stall on the wire of several retransmission timeouts (200 ms, then
    /// 400 ms) after the last chunk.
    pub chunk_ack_wait_ns: u64,
    /// A connection with no event for this long is dropped (its close was
    /// probably lost). A closed one is dropped `ack_wait_ns` after its close.
    pub conn_idle_ns: u64,
    /// A response whose end the framing cannot tell (opaque, body until
    /// close) is ended after this long without a send.
    pub response_quiet_ns: u64,
    pub max_connections: usize,
    /// Events held for reordering; beyond it the oldest is applied at once.
    pub max_pending_events: usize,
    /// Finished requests waiting for their join; beyond it the oldest is dropped.
    pub max_finished: usize,
    /// A request that follows an interrupted one from the same client
    /// address to the same server port within this long is its retry
    /// (`requests/retries.rs`).
    pub retry_window_ns: u64,
}

impl Default for CorrelatorConfig {
    fn default() -> Self {
        Self {
            itl_cap: 4096,
            reorder_window_ns: 10 * MS,
            join_grace_ns: 50 * MS,
            episode_history_ns: 60 * S,
            episode_cap: 100_000,
            ack_wait_ns: 5 * S,
            chunk_ack_wait_ns: S,
            conn_idle_ns: 600 * S,
            response_quiet_ns: 5 * S,
            max_connections: 65_536,
            max_pending_events: 65_536,
            max_finished: 65_536,
            retry_window_ns: 10 * S,
        }
    }
}

/// What the correlator counted, ignored or dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CorrelatorStats {
    pub connections: usize,
    pub episodes_held: usize,
    pub pending_events: usize,
    /// Socket events for a connection never opened (or already closed).
    pub unknown_conn_events: u64,
    /// Events of an unknown `op` or `dir`.
    pub malformed_events: u64,
    /// Events that arrived after later ones had been applied (beyond the
    /// reorder window).
    pub late_events: u64,
    /// Events applied before the reorder window passed (too many held).
    pub reorder_overflow: u64,
    /// Requests that arrived while the previous response was incomplete.
    pub pipelined: u64,
    /// Sends on a connection with no request in flight.
    pub sends_without_request: u64,
    /// Socket calls that returned an error (`EAGAIN` included).
    pub socket_errors: u64,
    /// Opens refused because `max_connections` were held.
    pub connections_refused: u64,
    /// Connections dropped after `conn_idle_ns` without an event.
    pub connections_evicted: u64,
    /// Opens of a socket still held open (its close was lost).
    pub connections_reopened: u64,
    /// Connections the kernel stopped following while they were open here
    /// (its `CONNS` map is LRU: a full map evicts the least recently used),
    /// seen when one is adopted again at its next request; what happened
    /// on it in between was not seen, and its request in flight is cut.
    pub connections_lost_in_kernel: u64,
    /// Connections opened before tracing began, followed from their next
    /// request (an open event from `ESTABLISHED`).
    pub connections_adopted: u64,
    pub episodes_dropped: u64,
    /// Finished requests dropped before being drained (`max_finished`).
    pub requests_dropped: u64,
    /// Chunks whose ACK was no longer awaited because
    /// `chunk_delivery::MAX_PENDING_CHUNKS` waited on their connection.
    pub chunk_acks_evicted: u64,
    /// HTTP/2 streams not followed: `streams::MAX_STREAMS` were open on
    /// their connection.
    pub http2_streams_dropped: u64,
    /// Interrupted requests forgotten before their window ended
    /// (`retries::MAX_INTERRUPTIONS`).
    pub retry_candidates_dropped: u64,
    /// HTTP/2 frames the server sent on streams never seen opening (opened
    /// before tracing began, or their client's segments not walked).
    pub http2_frames_unseen: u64,
}

impl CorrelatorStats {
    /// Whether nothing was counted but what is held now (connections,
    /// episodes, events): a workload that served nothing.
    pub fn is_quiet(&self) -> bool {
        *self
            == Self {
                connections: self.connections,
                episodes_held: self.episodes_held,
                pending_events: self.pending_events,
                ..Self::default()
            }
    }
}

#[derive(Debug)]
enum Pending {
    Conn(ConnEvent),
    /// A socket event is large (its captured bytes): it waits in
    /// [`SockSlots`], so that the heap moves small entries.
    Sock(usize),
    Segment(SegmentEvent),
    H2(Box<H2FramesEvent>),
    H2Block(Box<H2BlockEvent>),
}

/// Slots kept allocated when none is in use.
const SOCK_SLOTS_KEPT: usize = 4096;

/// Socket events held for reordering, in slots reused as they are applied:
/// no allocation per event.
#[derive(Debug, Default)]
struct SockSlots {
    slots: Vec<SockEvent>,
    free: Vec<usize>,
}

impl SockSlots {
    fn put(&mut self, ev: &SockEvent) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = *ev;
                i
            }
            None => {
                self.slots.push(*ev);
                self.slots.len() - 1
            }
        }
    }

    /// With nothing held: every slot is free; memory beyond a working set
    /// goes back (a burst held at the cap is 20 MiB).
    fn reset(&mut self) {
        self.slots.clear();
        self.free.clear();
        self.slots.shrink_to(SOCK_SLOTS_KEPT);
        self.free.shrink_to(SOCK_SLOTS_KEPT);
    }

    fn take(&mut self, i: usize) -> Option<SockEvent> {
        let ev = *self.slots.get(i)?;
        self.free.push(i);
        Some(ev)
    }
}

/// A held event, ordered by time, then by arrival; at the same time, a
/// send's header blocks before its frames (the kernel sends the blocks
/// after the walk, and a send of many frames has its frames events sent
/// as they fill: a stream's trailers must be decoded before the frame
/// that ends the stream).
#[derive(Debug)]
struct Held {
    t_ns: u64,
    seq: u64,
    event: Pending,
}

impl Held {
    fn rank(&self) -> u8 {
        u8::from(!matches!(self.event, Pending::H2Block(_)))
    }
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Held {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.t_ns, self.rank(), self.seq).cmp(&(other.t_ns, other.rank(), other.seq))
    }
}

/// Whether a connection event is the socket's last (`TCP_CLOSE`): after the
/// close (`CONN_CLOSE`), its later states (`CONN_STATE`) still matter.
pub fn ends_socket(ev: &ConnEvent) -> bool {
    ev.newstate == TCP_CLOSE
}

/// Turns a traced tree's connection, socket and episode events into one
/// [`RequestRecord`] per request. Pure: no clock, no I/O; the caller
/// passes the time.
pub struct Correlator {
    cfg: CorrelatorConfig,
    conns: HashMap<u64, Connection>,
    /// Connections opened so far: each one's serial (see [`ConnInfo`]).
    conns_opened: u64,
    held: BinaryHeap<Reverse<Held>>,
    socks: SockSlots,
    seq: u64,
    applied_until: u64,
    episodes: EpisodeHistory,
    out: Outbox,
    next_sweep_ns: u64,
    stats: CorrelatorStats,
}

impl Correlator {
    /// Recent GPU episodes (what stalls after the first token are judged on).
    pub(crate) fn episodes(&self) -> &EpisodeHistory {
        &self.episodes
    }

    pub fn new(cfg: CorrelatorConfig) -> Self {
        let episodes = EpisodeHistory::new(cfg.episode_history_ns, cfg.episode_cap);
        let out = Outbox {
            max_finished: cfg.max_finished,
            retry_window_ns: cfg.retry_window_ns,
            ..Outbox::default()
        };
        Self {
            cfg,
            conns: HashMap::new(),
            conns_opened: 0,
            held: BinaryHeap::new(),
            socks: SockSlots::default(),
            seq: 0,
            applied_until: 0,
            episodes,
            out,
            next_sweep_ns: 0,
            stats: CorrelatorStats::default(),
        }
    }

    pub fn on_conn(&mut self, ev: &ConnEvent) {
        self.hold(ev.t_ns, Pending::Conn(*ev));
    }

    pub fn on_sock(&mut self, ev: &SockEvent) {
        let slot = self.socks.put(ev);
        self.hold(ev.t_ns, Pending::Sock(slot));
    }

    pub fn on_segment(&mut self, ev: &SegmentEvent) {
        self.hold(ev.t_ns, Pending::Segment(*ev));
    }

    /// HTTP/2 frames sent or received (`ttft_trace_common::h2`).
    pub fn on_h2(&mut self, ev: Box<H2FramesEvent>) {
        self.hold(ev.t_ns, Pending::H2(ev));
    }

    /// A header block the server sent, before its call's frames.
    pub fn on_h2_block(&mut self, ev: Box<H2BlockEvent>) {
        self.hold(ev.t_ns, Pending::H2Block(ev));
    }

    pub fn on_episode(&mut self, ev: &EpisodeEvent) {
        self.episodes.insert(ev);
    }

    /// Requests finished since the last call, ready to log and record.
    /// `now_ns` (CLOCK_MONOTONIC) moves the reorder window, the join grace
    /// and the idle timeouts; a request is returned once `join_grace_ns`
    /// has passed since its first token.
    pub fn drain_finished(&mut self, now_ns: u64) -> Vec<RequestRecord> {
        let watermark = now_ns.saturating_sub(self.cfg.reorder_window_ns);
        while self.held.peek().is_some_and(|h| h.0.t_ns <= watermark) {
            self.apply_oldest();
        }
        if self.held.is_empty() {
            self.socks.reset();
        }
        self.join_in_flight(now_ns);
        if now_ns >= self.next_sweep_ns {
            self.sweep(watermark);
            self.next_sweep_ns = now_ns.saturating_add(SWEEP_EVERY_NS);
        }
        let (grace, ack_wait) = (self.cfg.join_grace_ns, self.cfg.ack_wait_ns);
        let chunk_wait = self.cfg.chunk_ack_wait_ns;
        let due = |t_first_token: u64, waiting_for_ack: bool, chunks_since: Option<u64>| {
            t_first_token.saturating_add(grace) <= now_ns
                && (!waiting_for_ack || t_first_token.saturating_add(ack_wait) <= now_ns)
                && chunks_since.is_none_or(|t| t.saturating_add(chunk_wait) <= now_ns)
        };
        let ready = self.emit(due, Some(ack_wait));
        self.episodes.prune(now_ns);
        ready
    }

    /// At shutdown: every held event applied, every request in flight
    /// finished as `in_flight_at_exit`, all returned, joined with the
    /// episodes received so far.
    pub fn flush(&mut self) -> Vec<RequestRecord> {
        while !self.held.is_empty() {
            self.apply_oldest();
        }
        for (_, mut conn) in self.conns.drain() {
            conn.exit(&mut self.out);
        }
        self.out.first_tokens.clear();
        // At exit a delivery still awaited was not awaited its full time.
        self.emit(|_, _, _| true, None)
    }

    /// Whether connection `sk` is followed (opened, not closed or evicted).
    pub fn follows(&self, sk: u64) -> bool {
        self.conns.contains_key(&sk)
    }

    pub fn stats(&self) -> CorrelatorStats {
        CorrelatorStats {
            connections: self.conns.len(),
            episodes_held: self.episodes.len(),
            pending_events: self.held.len(),
            pipelined: self.out.pipelined,
            sends_without_request: self.out.sends_without_request,
            socket_errors: self.out.socket_errors,
            episodes_dropped: self.episodes.dropped,
            requests_dropped: self.out.finished_dropped,
            chunk_acks_evicted: self.out.chunk_acks_evicted,
            http2_streams_dropped: self.out.streams_dropped,
            retry_candidates_dropped: self.out.interruptions.dropped,
            http2_frames_unseen: self.out.stream_frames_unseen,
            ..self.stats.clone()
        }
    }

    fn hold(&mut self, t_ns: u64, event: Pending) {
        self.seq += 1;
        self.held.push(Reverse(Held {
            t_ns,
            seq: self.seq,
            event,
        }));
        if self.held.len() > self.cfg.max_pending_events {
            self.stats.reorder_overflow += 1;
            self.apply_oldest();
        }
    }

    fn apply_oldest(&mut self) {
        let Some(Reverse(held)) = self.held.pop() else {
            return;
        };
        if held.t_ns < self.applied_until {
            self.stats.late_events += 1;
        }
        self.applied_until = self.applied_until.max(held.t_ns);
        match held.event {
            Pending::Conn(ev) => self.apply_conn(&ev),
            Pending::Sock(slot) => match self.socks.take(slot) {
                Some(ev) => self.apply_sock(&ev),
                None => self.stats.malformed_events += 1,
            },
            Pending::Segment(ev) => match self.conns.get_mut(&ev.sk) {
                Some(conn) => conn.on_segment(&ev, &mut self.out),
                None => self.stats.unknown_conn_events += 1,
            },
            Pending::H2(ev) => match self.conns.get_mut(&ev.sk) {
                Some(conn) => conn.on_h2(&ev, &mut self.out),
                None => self.stats.unknown_conn_events += 1,
            },
            Pending::H2Block(ev) => match self.conns.get_mut(&ev.sk) {
                Some(conn) => conn.on_h2_block(&ev),
                None => self.stats.unknown_conn_events += 1,
            },
        }
    }

    fn apply_conn(&mut self, ev: &ConnEvent) {
        match ev.op {
            CONN_OPEN => {
                if let Some(mut old) = self.conns.remove(&ev.sk) {
                    if ev.oldstate == TCP_ESTABLISHED && old.closed_at.is_none() {
                        self.stats.connections_lost_in_kernel += 1;
                    } else {
                        self.stats.connections_reopened += 1;
                    }
                    old.gone(&mut self.out);
                }
                if self.conns.len() >= self.cfg.max_connections {
                    self.stats.connections_refused += 1;
                    return;
                }
                if ev.oldstate == TCP_ESTABLISHED {
                    self.stats.connections_adopted += 1;
                }
                self.conns_opened += 1;
                let info = ConnInfo::new(ev, self.conns_opened);
                let opened = ev.oldstate != TCP_ESTABLISHED;
                let mut conn = Connection::new(info, ev.t_ns, self.cfg.itl_cap, opened);
                if ev.snd_nxt_known == 1 && ev.oldstate != TCP_ESTABLISHED {
                    conn.handshake(ev.t_ns, ev.snd_nxt);
                }
                self.conns.insert(ev.sk, conn);
            }
            CONN_CLOSE | CONN_STATE => {
                let Some(conn) = self.conns.get_mut(&ev.sk) else {
                    self.stats.unknown_conn_events += 1;
                    return;
                };
                if ev.op == CONN_CLOSE {
                    conn.close(ev, &mut self.out);
                }
                conn.on_state(ev, &mut self.out);
                if ends_socket(ev)
                    && let Some(mut conn) = self.conns.remove(&ev.sk)
                {
                    conn.gone(&mut self.out);
                }
            }
            _ => self.stats.malformed_events += 1,
        }
    }

    fn apply_sock(&mut self, ev: &SockEvent) {
        // A closed connection makes no more requests; after the client's
        // close, the server may still finish the response in flight.
        let Some(conn) = self
            .conns
            .get_mut(&ev.sk)
            .filter(|c| c.closed_at.is_none() || c.finishing_after_peer_close())
        else {
            self.stats.unknown_conn_events += 1;
            return;
        };
        match ev.dir {
            SOCK_RECV => conn.on_recv(ev, &mut self.out),
            SOCK_SEND => conn.on_send(ev, &mut self.out),
            _ => self.stats.malformed_events += 1,
        }
    }

    /// Joins requests still in flight whose first token is older than the
    /// grace, while the episodes around it are surely held (a long stream
    /// would otherwise outlive them).
    fn join_in_flight(&mut self, now_ns: u64) {
        while let Some(&(t, sk, index)) = self.out.first_tokens.front() {
            if t.saturating_add(self.cfg.join_grace_ns) > now_ns {
                break;
            }
            self.out.first_tokens.pop_front();
            // Finished meanwhile: joined when it is emitted. The first token
            // names its request: the socket may since carry a new connection
            // (the kernel reuses `sk`) whose request has the same index.
            if let Some(req) = self
                .conns
                .get_mut(&sk)
                .and_then(|c| c.current_mut(index))
                .filter(|r| r.t_first_token() == Some(t))
            {
                req.join = Some(self.episodes.join(req.t_arrive, t));
            }
        }
    }

    fn sweep(&mut self, watermark: u64) {
        let Self {
            conns,
            out,
            cfg,
            stats,
            ..
        } = self;
        conns.retain(|_, conn| {
            conn.end_if_quiet(watermark, cfg.response_quiet_ns, out);
            // Closed: only ACKs are awaited, and no longer than `ack_wait_ns`
            // (a server that closes after every response has many).
            if let Some(t) = conn.closed_at
                && t.saturating_add(cfg.ack_wait_ns) <= watermark
            {
                conn.gone(out);
                return false;
            }
            if conn.last_event_ns.saturating_add(cfg.conn_idle_ns) > watermark {
                return true;
            }
            stats.connections_evicted += 1;
            conn.evict(out);
            false
        });
    }

    /// Records for the finished requests that `due` (given the first-token
    /// time, whether the client's ACK of it is still awaited, and the last
    /// send when some chunk's ACK is) says are ready; requests without a
    /// first token are always ready. One still awaiting its ACK after the whole
    /// `ack_waited` is reported as unacknowledged that long after its first
    /// token (the evidence of a delivery held up past every retransmission
    /// the wait covers).
    fn emit(
        &mut self,
        due: impl Fn(u64, bool, Option<u64>) -> bool,
        ack_waited: Option<u64>,
    ) -> Vec<RequestRecord> {
        let mut ready = Vec::new();
        let mut waiting = VecDeque::new();
        for mut f in std::mem::take(&mut self.out.finished) {
            let key = (f.request.conn.serial, f.request.index);
            let awaited = matches!(
                self.out.deliveries.get(&key),
                Some(Delivery::Waiting { .. })
            );
            let t_first_token = f.request.t_first_token();
            let chunks_since = self
                .out
                .chunk_dates
                .get(&key)
                .filter(|c| c.pending() > 0)
                .and(f.request.response.as_ref())
                .map(|r| r.t_last_send);
            if !t_first_token.is_none_or(|t| due(t, awaited, chunks_since)) {
                waiting.push_back(f);
                continue;
            }
            let delivery = match self.out.deliveries.remove(&key) {
                Some(Delivery::Acked(ack)) => Seen::Acked(ack),
                Some(Delivery::Waiting { .. }) => match (t_first_token, ack_waited) {
                    (Some(t), Some(w)) => Seen::UnackedAt(t.saturating_add(w)),
                    _ => Seen::Unknown,
                },
                Some(Delivery::Unknown) | None => Seen::Unknown,
            };
            let join = f
                .request
                .join
                .take()
                .or_else(|| t_first_token.map(|t| self.episodes.join(f.request.t_arrive, t)));
            let chunks = self.out.chunk_dates.remove(&key);
            ready.push(RequestRecord::new(
                &f,
                join.as_ref(),
                &delivery,
                chunks.as_ref(),
            ));
        }
        self.out.finished = waiting;
        ready
    }
}

#[cfg(test)]
mod slot_tests {
    use super::*;

    #[test]
    fn socket_events_wait_in_reused_slots() {
        let mut slots = SockSlots::default();
        let ev = |sk| SockEvent {
            sk,
            ..SockEvent::default()
        };
        let (a, b) = (slots.put(&ev(1)), slots.put(&ev(2)));
        assert_ne!(a, b);
        assert_eq!(slots.take(a).map(|e| e.sk), Some(1));
        // The freed slot is reused, the other still holds its event.
        assert_eq!(slots.put(&ev(3)), a);
        assert_eq!(slots.take(b).map(|e| e.sk), Some(2));
        assert_eq!(slots.take(a).map(|e| e.sk), Some(3));
        slots.reset();
        assert_eq!(slots.take(a), None);
        assert_eq!(slots.put(&ev(4)), 0);
    }
}
