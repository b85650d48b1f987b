//! The per-connection HTTP/1.1 state machine: which receive starts a
//! request, which sends make its response, what ends the response, and
//! what ends a request early (close, pipelining, idleness, exit). A
//! connection seen to speak HTTP/2 is only marked so.

use std::{
    collections::{HashMap, VecDeque},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use ttft_trace_common::{
    ConnEvent, SEGMENT_DATA, SOCK_TLS_BUFFERED, SOCK_TLS_CONTROL, SOCK_TLS_PLAIN, SegmentEvent,
    SockEvent,
    h2::{H2BlockEvent, H2FramesEvent},
};

/// TCP states (`include/net/tcp_states.h`).
pub(crate) const TCP_ESTABLISHED: u32 = 1;
const TCP_FIN_WAIT1: u32 = 4;
const TCP_FIN_WAIT2: u32 = 5;
const TCP_TIME_WAIT: u32 = 6;
pub(crate) const TCP_CLOSE: u32 = 7;
pub(crate) const TCP_CLOSE_WAIT: u32 = 8;
const TCP_LAST_ACK: u32 = 9;
const TCP_CLOSING: u32 = 11;

use super::{
    chunk_delivery::{ChunkAcks, ChunkDates, Dated},
    delivery::{self, AckTracker, Delivery, RequestSegment},
    http::{self, Head},
    join::Join,
    outcome::Outcome,
    response::{self, End, Outgoing, Response},
    retries::{Attempt, AttemptId, Interruption, Interruptions, Retry},
    streams::{Stream, StreamEnd, StreamTable},
    tls::{APPLICATION_DATA_HEAD, Handshake, TlsFacts},
};

const AF_INET6: u16 = 10;
/// Most client data segments a TLS connection keeps between receives
/// (`Connection::unreceived`): a handshake's flights and a request or two.
const UNRECEIVED_MAX: usize = 16;

/// A server-side connection's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnInfo {
    pub sk: u64,
    /// Which of the connections followed this is, in opening order: the
    /// kernel reuses a freed socket's address (`sk`) for the next one, often
    /// while the last one's requests still wait for their record.
    pub serial: u64,
    pub server: SocketAddr,
    pub client: SocketAddr,
}

impl ConnInfo {
    pub fn new(ev: &ConnEvent, serial: u64) -> Self {
        let ip = |a: [u8; 16]| -> IpAddr {
            if ev.family == AF_INET6 {
                Ipv6Addr::from(a).into()
            } else {
                Ipv4Addr::new(a[0], a[1], a[2], a[3]).into()
            }
        };
        Self {
            sk: ev.sk,
            serial,
            server: SocketAddr::new(ip(ev.saddr), ev.sport),
            client: SocketAddr::new(ip(ev.daddr), ev.dport),
        }
    }
}

/// One request, from its first received bytes to the end of its response.
#[derive(Debug)]
pub(crate) struct Request {
    pub conn: ConnInfo,
    pub index: u32,
    pub tgid: u32,
    pub tid: u32,
    pub t_arrive: u64,
    /// The request's first TCP segment, when `tcp_probe` saw it.
    pub segment: Option<RequestSegment>,
    pub bytes_in: u64,
    /// Every byte sent while this request was current (interim responses
    /// included).
    pub bytes_out: u64,
    /// `None` until the first send that is not an interim response.
    pub response: Option<Response>,
    /// Arrived while the previous response was known to be incomplete: its
    /// sends cannot be told from the previous response's, so they are only
    /// counted, never read as a response.
    pub pipelined: bool,
    /// On a connection that speaks HTTP/2.
    pub http2: bool,
    /// An HTTP/2 stream's request: how the stream ended (its index is
    /// the stream id).
    pub stream_end: Option<StreamEnd>,
    /// On a TLS connection.
    pub tls: bool,
    /// On a TLS connection whose plaintext is read (the server's TLS calls
    /// are seen moving its records): read as HTTP, not `tls_unsupported`.
    pub tls_plaintext: bool,
    /// Its connection's TLS handshake as the wire showed it, when followed
    /// from the opening (set when the request finishes).
    pub tls_handshake: Option<TlsFacts>,
    /// The interrupted request this one retries (set when it finishes).
    pub retry: Option<Retry>,
    /// When the event that ended it happened: the client's close when it
    /// left first, else the event that finished it (0 until then).
    pub t_ended: u64,
    /// For a pipelined request: whether the last send ended a response, so
    /// that the next receive starts a request that can be followed again.
    response_ended: bool,
    t_last_send: Option<u64>,
    pub notes: Vec<&'static str>,
    /// Set when the join is made while the request is still in flight.
    pub join: Option<Join>,
}

impl Request {
    /// On a TLS connection whose plaintext is not read.
    pub fn tls_unread(&self) -> bool {
        self.tls && !self.tls_plaintext
    }

    pub fn t_first_token(&self) -> Option<u64> {
        self.response.as_ref().and_then(|r| r.t_first_token)
    }

    /// What retries are linked by (`requests/retries.rs`).
    fn attempt(&self) -> Attempt {
        Attempt {
            id: AttemptId {
                conn: self.conn.sk,
                request_index: self.index,
                client_port: self.conn.client.port(),
            },
            client: self.conn.client.ip(),
            server_port: self.conn.server.port(),
            serial: self.conn.serial,
            http2: self.http2,
            bytes_in: self.bytes_in,
            t_arrive: self.t_arrive,
            t_first_arrive: self.retry.map_or(self.t_arrive, |r| r.t_first_arrive),
            t_end: self
                .t_ended
                .max(self.t_last_send.unwrap_or(0))
                .max(self.t_arrive),
        }
    }

    /// Whether the server has begun answering: bytes received from now on
    /// are a new request.
    fn answered(&self) -> bool {
        if self.pipelined {
            self.t_last_send.is_some()
        } else {
            self.response.is_some()
        }
    }
}

/// A request that has ended, waiting for its join and its record.
#[derive(Debug)]
pub(crate) struct Finished {
    pub request: Request,
    pub outcome: Outcome,
}

/// Why a request in flight is being finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The framing says the response is complete.
    Ended,
    /// The next request arrived after a response whose end the framing
    /// could not tell.
    NextRequest,
    /// A request arrived while this response was still going.
    Pipelined,
    /// The connection closed: the server closed it first, or a reset.
    Closed,
    /// The client closed first (its FIN came before the server's, or a
    /// receive returned EOF): it left, whatever the framing says.
    PeerClosed,
    /// A response whose end the framing cannot tell fell silent.
    Idle,
    Exit,
    Evicted,
}

fn outcome(req: &Request, cause: Cause) -> Outcome {
    if let Some(end) = req.stream_end {
        return stream_outcome(req, end, cause);
    }
    if req.http2 {
        return Outcome::Http2Unsupported;
    }
    if req.tls_unread() {
        return Outcome::TlsUnsupported;
    }
    if req.pipelined || cause == Cause::Pipelined {
        return Outcome::PipelinedUnsupported;
    }
    let Some(resp) = &req.response else {
        return match cause {
            Cause::Exit => Outcome::InFlightAtExit,
            Cause::Evicted => Outcome::Evicted,
            _ => Outcome::ClosedBeforeResponse,
        };
    };
    match cause {
        Cause::Exit => Outcome::InFlightAtExit,
        Cause::Evicted => Outcome::Evicted,
        Cause::Closed | Cause::PeerClosed if resp.end() == End::Incomplete => {
            Outcome::ClosedMidResponse
        }
        // A body that ends at the close ends at the server's.
        Cause::PeerClosed if resp.until_close() => Outcome::ClosedMidResponse,
        _ if resp.status.is_some_and(|s| s >= 400) => Outcome::ErrorStatus,
        _ => Outcome::Ok,
    }
}

/// How an HTTP/2 stream's request ended.
fn stream_outcome(req: &Request, end: StreamEnd, cause: Cause) -> Outcome {
    let status = req.response.as_ref().and_then(|r| r.status);
    let grpc_status = req.response.as_ref().and_then(|r| r.grpc_status);
    match end {
        StreamEnd::Ended if status.is_some_and(|s| s >= 400) => Outcome::ErrorStatus,
        StreamEnd::Ended if grpc_status.is_some_and(|s| s != 0) => Outcome::ErrorStatus,
        StreamEnd::Ended => Outcome::Ok,
        StreamEnd::Reset { .. } => Outcome::Reset,
        StreamEnd::GoAway { .. } => Outcome::GoAway,
        StreamEnd::Evicted => Outcome::Evicted,
        StreamEnd::Cut => match cause {
            Cause::Exit => Outcome::InFlightAtExit,
            Cause::Evicted => Outcome::Evicted,
            _ if req.response.is_none() => Outcome::ClosedBeforeResponse,
            _ => Outcome::ClosedMidResponse,
        },
    }
}

/// What the state machines hand to the correlator, and what they count.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    pub finished: VecDeque<Finished>,
    /// `(t_first_token, sk, request index)` of requests whose first token
    /// was sent, in that order: joined in flight once the grace has passed.
    pub first_tokens: VecDeque<(u64, u64, u32)>,
    pub max_finished: usize,
    pub finished_dropped: u64,
    pub pipelined: u64,
    pub sends_without_request: u64,
    pub socket_errors: u64,
    /// First-token deliveries by `(connection serial, request index)`, of
    /// requests in flight or finished, until their record is made.
    pub deliveries: HashMap<(u64, u32), Delivery>,
    /// Every chunk's delivery by `(connection serial, request index)`, of
    /// requests in flight or finished, until their record is made.
    pub chunk_dates: HashMap<(u64, u32), ChunkDates>,
    /// Chunks given up for want of room (`chunk_delivery::MAX_PENDING_CHUNKS`
    /// waiting on one connection).
    pub chunk_acks_evicted: u64,
    /// HTTP/2 streams not followed (`streams::MAX_STREAMS` open on their
    /// connection), and server frames on streams never seen opening.
    pub streams_dropped: u64,
    pub stream_frames_unseen: u64,
    /// Interrupted requests whose retry may still come
    /// (`requests/retries.rs`), within `retry_window_ns`.
    pub interruptions: Interruptions,
    pub retry_window_ns: u64,
}

impl Outbox {
    fn first_token(&mut self, t_ns: u64, sk: u64, index: u32) {
        // Without drains the queue would grow; a request whose entry is
        // dropped is joined when it is emitted instead.
        if self.first_tokens.len() >= self.max_finished.max(1) {
            self.first_tokens.pop_front();
        }
        self.first_tokens.push_back((t_ns, sk, index));
    }

    /// A chunk of request `key` (connection serial, index) sent at `t_ns`,
    /// its last byte ending at `end_seq`: its delivery is awaited in the
    /// connection's `acks`; at most `cap` dates kept.
    fn chunk_sent(
        &mut self,
        acks: &mut ChunkAcks,
        cap: usize,
        key: (u64, u32),
        (end_seq, t_ns): (u32, u64),
    ) {
        self.chunk_dates
            .entry(key)
            .or_insert_with(|| ChunkDates::new(cap))
            .on_sent();
        if let Some(dated) = acks.sent(key.1, end_seq, t_ns) {
            self.chunk_acks_evicted += u64::from(matches!(dated, Dated::Lost { .. }));
            self.chunk_dated(key.0, dated);
        }
    }

    /// Request `index` of connection `serial`: its next chunk's fate.
    fn chunk_dated(&mut self, serial: u64, dated: Dated) {
        let index = match dated {
            Dated::Acked { index, .. } | Dated::ByClose { index, .. } | Dated::Lost { index } => {
                index
            }
        };
        // Absent: the request was reported already (it waited too long).
        if let Some(d) = self.chunk_dates.get_mut(&(serial, index)) {
            d.on_dated(dated);
        }
    }

    fn finish(&mut self, mut request: Request, cause: Cause) {
        if cause == Cause::Idle {
            request.notes.push("end_by_idle");
        }
        if self.finished.len() >= self.max_finished.max(1)
            && let Some(dropped) = self.finished.pop_front()
        {
            let r = &dropped.request;
            self.deliveries.remove(&(r.conn.serial, r.index));
            self.chunk_dates.remove(&(r.conn.serial, r.index));
            self.finished_dropped += 1;
        }
        let outcome = outcome(&request, cause);
        // A window of 0 turns the linking off.
        let window = self.retry_window_ns;
        if window > 0 {
            request.retry = self.interruptions.retry_of(&request.attempt(), window);
            if outcome.interrupted() {
                let i = Interruption::new(request.attempt(), outcome == Outcome::GoAway);
                // Its retry may have finished already (a client that left
                // while the server kept it open): the earliest such one,
                // while its record waits, takes the link.
                let later = self
                    .finished
                    .iter_mut()
                    .filter(|f| {
                        f.request.retry.is_none() && i.retried_by(&f.request.attempt(), window)
                    })
                    .min_by_key(|f| f.request.t_arrive);
                match later {
                    Some(f) => f.request.retry = Some(i.retry()),
                    None => self.interruptions.note(i, window),
                }
            }
        }
        self.finished.push_back(Finished { request, outcome });
    }
}

#[derive(Debug)]
pub(crate) struct Connection {
    info: ConnInfo,
    next_index: u32,
    current: Option<Request>,
    pub last_event_ns: u64,
    itl_cap: usize,
    acks: AckTracker,
    /// Every chunk's ACK (`requests/chunk_delivery.rs`).
    chunks: ChunkAcks,
    /// The server's first send was HTTP/2's connection preface (or a 101 to
    /// `h2c`): every request from then on is HTTP/2.
    http2: bool,
    /// The server's first send was TLS records: every request from then on
    /// is encrypted.
    tls: bool,
    /// The server's TLS calls were seen moving this connection's records
    /// (`SOCK_TLS_*` flags): its plaintext is read, and the records moved
    /// outside a data call are TLS's own.
    tls_read: bool,
    /// When the last receive of client bytes was: where a read served from
    /// the TLS library's buffer ([`SOCK_TLS_BUFFERED`]) had its bytes from.
    tls_received_ns: Option<u64>,
    /// The last client data segment, and of it, the one a receive of TLS's
    /// own records took last (with the server's TLS records sent since
    /// counted in its sequence): the request segment of a request read
    /// ahead with them.
    last_data_segment: Option<RequestSegment>,
    read_ahead: Option<RequestSegment>,
    /// On a TLS connection, the client data segments not yet received, with
    /// their bytes: a receive of TLS's own records takes its bytes from
    /// the front, and the first segment it leaves is the next request's.
    unreceived: VecDeque<(RequestSegment, u32)>,
    /// The client closed its side (FIN, or a receive returned EOF) while
    /// the response was unfinished by its framing: the server may still
    /// finish it (a client that stops reading at `data: [DONE]` and closes
    /// before the chunked terminator is written, as the `openai` client
    /// does). The request stays current until the framing ends it (`ok`),
    /// or the server closes or falls silent (`closed_mid_response`).
    peer_closed: bool,
    /// When either side closed it: no more requests; its ACKs are still
    /// followed until the kernel is done with the socket.
    pub closed_at: Option<u64>,
    /// The connection's HTTP/2 streams, once the kernel walks its frames:
    /// its requests come from there, not from the receives and sends.
    streams: Option<StreamTable>,
    /// Its TLS handshake, followed on a connection seen from its opening
    /// (`requests/tls.rs`); it gives up on one that is not TLS.
    tls_handshake: Option<Handshake>,
    /// The first and last client data segments since the last receive:
    /// when the bytes a receive takes arrived.
    segments_since_recv: Option<(u64, u64)>,
}

impl Connection {
    /// `opened`: the connection's opening was seen (not adopted later).
    pub fn new(info: ConnInfo, t_ns: u64, itl_cap: usize, opened: bool) -> Self {
        Self {
            info,
            next_index: 0,
            current: None,
            last_event_ns: t_ns,
            itl_cap,
            acks: AckTracker::default(),
            chunks: ChunkAcks::default(),
            http2: false,
            tls: false,
            tls_read: false,
            tls_received_ns: None,
            last_data_segment: None,
            read_ahead: None,
            unreceived: VecDeque::new(),
            peer_closed: false,
            closed_at: None,
            streams: None,
            tls_handshake: opened.then(Handshake::new),
            segments_since_recv: None,
        }
    }

    /// The handshake completed at `t_ns` (see [`AckTracker::handshake`]).
    pub fn handshake(&mut self, t_ns: u64, snd_nxt: u32) {
        self.acks.handshake(t_ns, snd_nxt);
    }

    pub fn on_recv(&mut self, ev: &SockEvent, out: &mut Outbox) {
        self.last_event_ns = self.last_event_ns.max(ev.t_ns);
        let mut ev = *ev;
        if ev.flags & SOCK_TLS_BUFFERED != 0 {
            // Plaintext from records an earlier receive took: they
            // arrived then.
            ev.t_ns = self.tls_received_ns.unwrap_or(ev.t_ns);
        } else if ev.bytes > 0 {
            let segments = self.segments_since_recv.take();
            if let Some(hs) = self.tls_handshake.as_mut() {
                let (first, last) = segments.unwrap_or((ev.t_ns, ev.t_ns));
                hs.on_client(first, last);
            }
            self.tls_received_ns = Some(ev.t_ns);
        }
        let ev = &ev;
        if self.tls_own_records(ev) {
            // Its segments brought TLS's records, not a request.
            let next = self.take_received(u64::try_from(ev.bytes).unwrap_or(0));
            self.acks.set_request_segment(next);
            self.read_ahead = self.last_data_segment;
            return;
        }
        self.unreceived.clear();
        if let Some(streams) = self.streams.as_mut() {
            match ev.bytes {
                0 => self.end_streams(Cause::PeerClosed, out),
                n if n > 0 => streams.on_recv(ev.t_ns, ev.tgid, ev.tid),
                _ => out.socket_errors += 1,
            }
            return;
        }
        let n = match u64::try_from(ev.bytes) {
            Ok(0) => return self.peer_closes(out),
            Ok(n) => n,
            Err(_) => {
                out.socket_errors += 1;
                return;
            }
        };
        let Some(mut req) = self.current.take() else {
            return self.start(ev, n, false);
        };
        if !req.answered() {
            // More of the same request (a body in several reads, or the
            // body after `100 Continue`).
            req.bytes_in += n;
            self.current = Some(req);
            return;
        }
        let end = req.response.as_ref().map(Response::end);
        let (cause, pipelined) = if req.pipelined {
            (Cause::Pipelined, !req.response_ended)
        } else if end == Some(End::Incomplete) {
            (Cause::Pipelined, true)
        } else {
            (Cause::NextRequest, false)
        };
        self.finish(req, cause, out);
        if pipelined {
            out.pipelined += 1;
        }
        self.start(ev, n, pipelined);
    }

    pub fn on_send(&mut self, ev: &SockEvent, out: &mut Outbox) {
        self.last_event_ns = self.last_event_ns.max(ev.t_ns);
        if let Some(hs) = self.tls_handshake.as_mut().filter(|_| ev.bytes > 0) {
            // A send inside `SSL_write` carries the plaintext's head, and
            // application data records on the wire.
            let head = if ev.flags == SOCK_TLS_PLAIN {
                &APPLICATION_DATA_HEAD[..]
            } else {
                ev.head()
            };
            hs.on_server(ev.t_ns, head);
        }
        let first_flagged = !self.tls_read && ev.flags != 0;
        if self.tls_own_records(ev) {
            if first_flagged {
                self.retract_client_hello();
            }
            self.sent_before_response(u64::try_from(ev.bytes).unwrap_or(0));
            return;
        }
        if self.streams.is_some() {
            // Its frames come in the HTTP/2 events.
            return;
        }
        let wire = match u64::try_from(ev.bytes) {
            Ok(0) => return,
            Ok(n) => n,
            Err(_) => {
                out.socket_errors += 1;
                return;
            }
        };
        // The response's bytes as HTTP frames them: a send inside
        // `SSL_write` carries `plain_bytes` of plaintext in its records;
        // the wire's count the bytes the client acknowledges.
        let n = if ev.flags == SOCK_TLS_PLAIN {
            u64::from(ev.plain_bytes)
        } else {
            wire
        };
        // The first send of a response tells the protocol; a server may send
        // its HTTP/2 preface before it reads any request.
        let opens = self.current.as_ref().is_none_or(|r| r.response.is_none());
        let head = opens.then(|| {
            if self.http2 {
                Head::Http2
            } else {
                http::parse_head(ev.head(), n)
            }
        });
        self.http2 |= head == Some(Head::Http2);
        self.tls |= head == Some(Head::Tls);
        let Some(req) = self.current.as_mut() else {
            out.sends_without_request += 1;
            return;
        };
        req.http2 |= self.http2;
        req.tls |= self.tls || self.tls_read;
        req.tls_plaintext |= self.tls_read;
        req.bytes_out += wire;
        req.t_last_send = Some(ev.t_ns);
        let send = Outgoing {
            t_ns: ev.t_ns,
            bytes: n,
            head: ev.head(),
            tail: ev.tail(),
        };
        if req.pipelined {
            req.response_ended = response::ends_a_response(&send);
            return;
        }
        let had_token = req.t_first_token().is_some();
        let chunks_before = req.response.as_ref().map_or(0, |r| r.chunks);
        match req.response.as_mut() {
            Some(r) => r.on_send(&send),
            None => match head.unwrap_or_else(|| http::parse_head(send.head, n)) {
                Head::Interim => return,
                head => req.response = Some(Response::start(head, &send, self.itl_cap)),
            },
        }
        if let (false, Some(t)) = (had_token, req.t_first_token()) {
            out.first_token(t, self.info.sk, req.index);
            if let Some(seg) = req.segment {
                let end = delivery::first_token_end(seg, req.bytes_out);
                let d = self.acks.first_token(req.index, end, t);
                out.deliveries.insert((self.info.serial, req.index), d);
            }
        }
        // A body send (a chunk): its delivery is awaited.
        if let (Some(seg), Some(r)) = (req.segment, req.response.as_ref())
            && r.chunks > chunks_before
        {
            let key = (self.info.serial, req.index);
            let end = delivery::first_token_end(seg, req.bytes_out);
            let cap = self.itl_cap.saturating_add(1);
            out.chunk_sent(&mut self.chunks, cap, key, (end, ev.t_ns));
        }
        if req.response.as_ref().map(Response::end) == Some(End::Complete) {
            self.finish_current(Cause::Ended, out);
        }
    }

    /// HTTP/2 frames the kernel walked: from the first, the connection's
    /// requests are its streams. A request begun before (read before the
    /// server's preface showed the protocol) ends as HTTP/2 unsupported.
    pub fn on_h2(&mut self, ev: &H2FramesEvent, out: &mut Outbox) {
        self.last_event_ns = self.last_event_ns.max(ev.t_ns);
        self.http2 = true;
        if self.streams.is_none() {
            if let Some(req) = self.current.as_mut() {
                req.http2 = true;
            }
            self.finish_current(Cause::Closed, out);
        }
        let streams = self
            .streams
            .get_or_insert_with(|| StreamTable::new(self.itl_cap));
        let mut done = Vec::new();
        streams.on_frames(ev, &mut done);
        // Awaited before the streams finish: their ACK may come first.
        for c in streams.take_chunks_sent() {
            let key = (self.info.serial, c.stream);
            if c.first {
                let d = self.acks.first_token(c.stream, c.end_seq, c.t_ns);
                out.deliveries.insert(key, d);
            }
            let cap = self.itl_cap.saturating_add(1);
            out.chunk_sent(&mut self.chunks, cap, key, (c.end_seq, c.t_ns));
        }
        self.finish_streams(done, Cause::Ended, out);
    }

    /// A header block the server sent (HPACK: `header_blocks.rs`), before
    /// the frames event of its call. Only on a connection whose streams are
    /// followed already: the server's blocks follow its preface.
    pub fn on_h2_block(&mut self, ev: &H2BlockEvent) {
        self.last_event_ns = self.last_event_ns.max(ev.t_ns);
        if let Some(streams) = self.streams.as_mut() {
            streams.on_block(ev);
        }
    }

    /// The connection ended: its open streams are cut.
    fn end_streams(&mut self, cause: Cause, out: &mut Outbox) {
        let mut done = Vec::new();
        if let Some(streams) = self.streams.as_mut() {
            streams.cut(&mut done);
        }
        self.finish_streams(done, cause, out);
    }

    fn finish_streams(&mut self, done: Vec<(Stream, StreamEnd)>, cause: Cause, out: &mut Outbox) {
        if let Some(streams) = self.streams.as_mut() {
            out.streams_dropped += std::mem::take(&mut streams.dropped);
            out.stream_frames_unseen += std::mem::take(&mut streams.unseen_frames);
        }
        for (stream, end) in done {
            let mut notes = Vec::new();
            if stream.t_arrive.is_none() {
                notes.push("arrival_from_segment");
            }
            let request = Request {
                conn: self.info,
                index: stream.id,
                tgid: stream.tgid,
                tid: stream.tid,
                t_arrive: stream.t_arrive.unwrap_or(stream.t_segment),
                segment: Some(RequestSegment {
                    t_ns: stream.t_segment,
                    snd_nxt: 0,
                    at_handshake: false,
                }),
                bytes_in: stream.bytes_in,
                bytes_out: stream.bytes_out,
                response: Response::of_stream(&stream),
                pipelined: false,
                http2: true,
                stream_end: Some(end),
                tls: false,
                tls_plaintext: false,
                tls_handshake: None,
                retry: None,
                t_ended: self.last_event_ns,
                response_ended: true,
                t_last_send: stream.t_last_send,
                notes,
                join: None,
            };
            out.finish(request, cause);
        }
    }

    /// An incoming TCP segment: a request's first bytes, or an ACK that may
    /// cover a first token.
    pub fn on_segment(&mut self, ev: &SegmentEvent, out: &mut Outbox) {
        self.last_event_ns = self.last_event_ns.max(ev.t_ns);
        if self.tls_handshake.is_some() && ev.flags & SEGMENT_DATA != 0 && ev.data_len > 0 {
            let first = self.segments_since_recv.map_or(ev.t_ns, |(f, _)| f);
            self.segments_since_recv = Some((first, ev.t_ns));
        }
        if ev.flags & SEGMENT_DATA != 0 && ev.data_len > 0 {
            let seg = RequestSegment {
                t_ns: ev.t_ns,
                snd_nxt: ev.snd_nxt,
                at_handshake: false,
            };
            self.last_data_segment = Some(seg);
            if (self.tls_read || self.in_handshake()) && self.unreceived.len() < UNRECEIVED_MAX {
                self.unreceived.push_back((seg, ev.data_len));
            }
        }
        let idle = self.current.as_ref().is_none_or(Request::answered);
        for (index, ack) in self.acks.on_segment(ev, idle) {
            // Absent: the request was reported already (it waited too long).
            if let Some(d) = out.deliveries.get_mut(&(self.info.serial, index)) {
                *d = Delivery::Acked(ack);
            }
        }
        if let Some((t_ns, snd_una)) = delivery::ack_of(ev) {
            for dated in self.chunks.acked(t_ns, snd_una) {
                out.chunk_dated(self.info.serial, dated);
            }
        }
    }

    /// The connection left `ESTABLISHED` (`CONN_CLOSE`): the request in
    /// flight ends; first tokens not yet acknowledged still wait (see
    /// [`Connection::on_state`]).
    pub fn close(&mut self, ev: &ConnEvent, out: &mut Outbox) {
        self.last_event_ns = self.last_event_ns.max(ev.t_ns);
        self.end_streams(Cause::Closed, out);
        if ev.newstate == TCP_CLOSE_WAIT {
            self.peer_closes(out);
        } else {
            self.finish_current(Cause::Closed, out);
        }
        self.closed_at = Some(ev.t_ns);
        for index in self.acks.closed(ev.t_last_segment_ns) {
            if let Some(d) = out.deliveries.get_mut(&(self.info.serial, index)) {
                *d = Delivery::Unknown;
            }
        }
        let exact = self.acks.exact();
        for dated in self.chunks.closed(ev.t_last_segment_ns, exact) {
            out.chunk_dated(self.info.serial, dated);
        }
    }

    /// A state change after the close (`CONN_STATE`, or `CONN_CLOSE`
    /// itself): when it says the client acknowledged everything sent, the
    /// first tokens still waiting were acknowledged by then.
    pub fn on_state(&mut self, ev: &ConnEvent, out: &mut Outbox) {
        self.last_event_ns = self.last_event_ns.max(ev.t_ns);
        // The server closed too, the response still unfinished.
        if self.peer_closed && ev.oldstate == TCP_CLOSE_WAIT {
            self.finish_current(Cause::PeerClosed, out);
        }
        let all_acked = matches!(
            (ev.oldstate, ev.newstate),
            (TCP_FIN_WAIT1, TCP_FIN_WAIT2)
                | (TCP_LAST_ACK, TCP_CLOSE)
                | (TCP_CLOSING, TCP_TIME_WAIT | TCP_CLOSE)
        );
        if !all_acked {
            return;
        }
        for (index, ack) in self.acks.all_acked(ev.t_ns) {
            if let Some(d) = out.deliveries.get_mut(&(self.info.serial, index)) {
                *d = Delivery::Acked(ack);
            }
        }
        for dated in self.chunks.all_acked(ev.t_ns) {
            out.chunk_dated(self.info.serial, dated);
        }
    }

    /// The kernel is done with the socket (`TCP_CLOSE`), or it was reused.
    pub fn gone(&mut self, out: &mut Outbox) {
        self.end(Cause::Closed, out);
    }

    pub fn exit(&mut self, out: &mut Outbox) {
        self.end(Cause::Exit, out);
    }

    pub fn evict(&mut self, out: &mut Outbox) {
        self.end(Cause::Evicted, out);
    }

    /// The connection is gone: its request in flight finishes, and first
    /// tokens not acknowledged yet never will be (where the probe sees it).
    fn end(&mut self, cause: Cause, out: &mut Outbox) {
        self.finish_current(cause, out);
        self.end_streams(cause, out);
        for index in self.acks.give_up() {
            if let Some(d) = out.deliveries.get_mut(&(self.info.serial, index)) {
                *d = Delivery::Unknown;
            }
        }
        for dated in self.chunks.give_up() {
            out.chunk_dated(self.info.serial, dated);
        }
    }

    /// Ends a response whose end the framing cannot tell (or a pipelined
    /// request) once nothing has been sent for `quiet_ns` before `now_ns`,
    /// so that a keep-alive connection left open does not hold it back.
    pub fn end_if_quiet(&mut self, now_ns: u64, quiet_ns: u64, out: &mut Outbox) {
        let Some(req) = &self.current else { return };
        let open_ended = req.pipelined
            || req
                .response
                .as_ref()
                .is_some_and(|r| r.end() == End::Unknown);
        let quiet = req
            .t_last_send
            .is_some_and(|t| t.saturating_add(quiet_ns) <= now_ns);
        if self.peer_closed && quiet {
            self.finish_current(Cause::PeerClosed, out);
        } else if open_ended && quiet {
            self.finish_current(Cause::Idle, out);
        }
    }

    /// The client closed, and the server may still finish the response
    /// in flight (see `peer_closed`).
    pub fn finishing_after_peer_close(&self) -> bool {
        self.peer_closed
    }

    /// The client closed its side: the request in flight ends, unless its
    /// response is unfinished by its framing and the server may still
    /// finish it (see `peer_closed`).
    fn peer_closes(&mut self, out: &mut Outbox) {
        let unfinished = self.current.as_ref().is_some_and(|r| {
            !r.pipelined
                && !r.http2
                && !r.tls_unread()
                && r.response.as_ref().map(Response::end) == Some(End::Incomplete)
        });
        if unfinished {
            self.peer_closed = true;
            // The client left now, whenever the server finishes.
            if let Some(r) = self.current.as_mut() {
                r.t_ended = self.last_event_ns;
            }
        } else {
            self.finish_current(Cause::PeerClosed, out);
        }
    }

    /// The current request, when it has the given index (for the join).
    pub fn current_mut(&mut self, index: u32) -> Option<&mut Request> {
        self.current.as_mut().filter(|r| r.index == index)
    }

    fn finish_current(&mut self, cause: Cause, out: &mut Outbox) {
        self.peer_closed = false;
        if let Some(req) = self.current.take() {
            self.finish(req, cause, out);
        }
    }

    /// A request of this connection ends: it takes the connection's TLS
    /// handshake as far as it went.
    fn finish(&mut self, mut req: Request, cause: Cause, out: &mut Outbox) {
        if req.t_ended == 0 {
            req.t_ended = self.last_event_ns;
        }
        req.tls_handshake = self.tls_handshake.as_mut().and_then(Handshake::facts);
        out.finish(req, cause);
    }

    /// Takes `bytes` received from the front of the unreceived segments;
    /// returns the first segment with bytes left, if any.
    fn take_received(&mut self, mut bytes: u64) -> Option<RequestSegment> {
        while let Some((seg, len)) = self.unreceived.front_mut() {
            if bytes < u64::from(*len) {
                *len -= bytes as u32;
                return Some(*seg);
            }
            bytes -= u64::from(*len);
            self.unreceived.pop_front();
        }
        None
    }

    /// The server sent `wire` bytes of TLS's own records: a response to a
    /// segment that arrived before (held for its request, or not yet
    /// received) starts that much later in sequence space. Every such
    /// segment is moved, whichever of them turns out to be the request's:
    /// under uvloop the tickets can go out between a request's segment and
    /// the receive that takes it.
    fn sent_before_response(&mut self, wire: u64) {
        self.acks.sent_before_response(wire);
        self.read_ahead = self.read_ahead.map(|s| s.after(wire));
        self.last_data_segment = self.last_data_segment.map(|s| s.after(wire));
        for (seg, _) in &mut self.unreceived {
            *seg = seg.after(wire);
        }
        if let Some(seg) = self.current.as_mut().and_then(|r| r.segment.as_mut()) {
            *seg = seg.after(wire);
        }
    }

    /// The server's TLS calls showed themselves (a memory BIO's first
    /// records, matched after they were sent): the client bytes read
    /// before, outside any call, were its `ClientHello`, not a request.
    /// The request they began is dropped, unreported, and its index given
    /// back.
    fn retract_client_hello(&mut self) {
        if self.current.as_ref().is_some_and(|r| r.response.is_none()) {
            self.current = None;
            self.next_index = self.next_index.wrapping_sub(1);
            self.acks.set_request_segment(None);
        }
    }

    /// Whether the connection's handshake, followed from its opening, is
    /// still under way.
    fn in_handshake(&self) -> bool {
        self.tls_handshake
            .as_ref()
            .is_some_and(Handshake::in_progress)
    }

    /// Whether `ev` moved TLS's own records (the handshake, tickets, alerts)
    /// rather than a request's or a response's, as the server's TLS calls
    /// tell ([`SockEvent::flags`]): bytes moved inside the handshake or a
    /// shutdown (or received by a read before it sent: one driving the
    /// handshake), or outside any call on a connection whose calls are
    /// seen. A receive of a read that returned plaintext carries a
    /// request's bytes, whatever else it took with them (a `Finished`). An
    /// end of stream or an error is never TLS's own.
    fn tls_own_records(&mut self, ev: &SockEvent) -> bool {
        self.tls_read |= ev.flags != 0;
        if ev.bytes <= 0 {
            return false;
        }
        match ev.flags & (SOCK_TLS_CONTROL | SOCK_TLS_PLAIN) {
            SOCK_TLS_CONTROL => true,
            SOCK_TLS_PLAIN => false,
            _ => self.tls_read,
        }
    }

    fn start(&mut self, ev: &SockEvent, bytes: u64, pipelined: bool) {
        self.current = Some(Request {
            conn: self.info,
            index: self.next_index,
            tgid: ev.tgid,
            tid: ev.tid,
            t_arrive: ev.t_ns,
            // A request read ahead with TLS's records came in their
            // receive's last segment.
            segment: if ev.flags & SOCK_TLS_BUFFERED != 0 {
                self.acks.set_request_segment(None);
                self.read_ahead.take()
            } else {
                self.acks.start_request(ev.t_ns)
            },
            bytes_in: bytes,
            bytes_out: 0,
            response: None,
            pipelined,
            http2: self.http2,
            stream_end: None,
            tls: self.tls || self.tls_read,
            tls_plaintext: self.tls_read,
            tls_handshake: None,
            retry: None,
            t_ended: 0,
            response_ended: false,
            t_last_send: None,
            notes: Vec::new(),
            join: None,
        });
        self.next_index = self.next_index.wrapping_add(1);
    }
}
