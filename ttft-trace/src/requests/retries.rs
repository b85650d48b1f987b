//! Interrupted retries (issue 29 item 5): a request that ended without its
//! whole response (reset, GOAWAY, closed before or in the middle of it),
//! followed within a window by a new request from the same client address
//! to the same server port, is what its user retried. The new request's
//! record names the first (`retry_of`) and gives the TTFT its user saw:
//! from the first attempt's arrival (the first of a chain of retries) to
//! the new first token.
//!
//! A client address is shared by every request a gateway forwards, so the
//! evidence asked is more than the address: on HTTP/1.1 the retry is the
//! same request again, byte for byte as many (a client's retry counter
//! header keeps its length: `x-stainless-retry-count: 0` then `1`); an
//! HTTP/2 stream's header block is smaller the second time (HPACK indexes
//! what it has seen), so there only the address, the port and the window
//! tell. Each interruption is the retry of one later request at most: the
//! first to arrive after it.

use std::{collections::VecDeque, net::IpAddr};

use serde::Serialize;

/// Interruptions remembered at most (per workload's correlator); past it
/// the oldest is forgotten, counted in
/// `ttft_trace_table_evictions_total{table="retry_candidates"}`.
pub(crate) const MAX_INTERRUPTIONS: usize = 4_096;

/// A request as the JSONL names it: its connection (`conn`, hex) and
/// `request_index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RequestId {
    #[serde(serialize_with = "hex")]
    pub conn: u64,
    pub request_index: u32,
}

fn hex<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#x}"))
}

/// The attempt a retry repeats, as its JSONL line names it: its connection
/// (`conn`, hex; the kernel gives a freed socket's address to the next
/// one, often the retry's own), its index, and its client port, which
/// tells it from the retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AttemptId {
    #[serde(serialize_with = "hex")]
    pub conn: u64,
    pub request_index: u32,
    pub client_port: u16,
}

/// What a retry's record says of the attempt it repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Retry {
    pub of: AttemptId,
    /// The arrival of the first attempt of the chain.
    pub t_first_arrive: u64,
}

/// What the linking reads of a request (`Request::attempt`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attempt {
    pub id: AttemptId,
    pub client: IpAddr,
    pub server_port: u16,
    /// The connection's serial: an HTTP/1.1 retry comes on another one.
    pub serial: u64,
    pub http2: bool,
    pub bytes_in: u64,
    pub t_arrive: u64,
    /// The arrival of the first attempt of its chain (its own, unless it
    /// is a retry).
    pub t_first_arrive: u64,
    /// When it ended: the event that ended it (the client's close when it
    /// left first, else the close, reset or GOAWAY that finished it), or
    /// its last send if later.
    pub t_end: u64,
}

/// A request that ended interrupted, while its retry may still come.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Interruption {
    attempt: Attempt,
    /// Refused by a GOAWAY: its HTTP/2 retry may come on another connection.
    goaway: bool,
}

impl Interruption {
    pub fn new(attempt: Attempt, goaway: bool) -> Self {
        Self { attempt, goaway }
    }

    /// Whether `req` is its retry: from the same client address to the same
    /// server port, arrived after it ended and within `window_ns`; on
    /// HTTP/1.1 the same request again on another connection; on HTTP/2 a
    /// stream of the same connection (of any, after a GOAWAY).
    pub fn retried_by(&self, req: &Attempt, window_ns: u64) -> bool {
        let i = &self.attempt;
        let same_request = if i.http2 {
            req.http2 && (self.goaway || i.serial == req.serial)
        } else {
            !req.http2 && i.serial != req.serial && i.bytes_in == req.bytes_in
        };
        i.client == req.client
            && i.server_port == req.server_port
            && i.t_end <= req.t_arrive
            && req.t_arrive - i.t_end <= window_ns
            && same_request
    }

    /// The link a retry of it carries.
    pub fn retry(&self) -> Retry {
        Retry {
            of: self.attempt.id,
            t_first_arrive: self.attempt.t_first_arrive,
        }
    }
}

/// The interruptions of the last window, in the order they ended.
#[derive(Debug, Default)]
pub(crate) struct Interruptions {
    recent: VecDeque<Interruption>,
    /// Forgotten for want of room.
    pub dropped: u64,
}

impl Interruptions {
    /// The interruption `req` (arrived, not yet noted) retries, if any,
    /// taken out: the first one it retries.
    pub fn retry_of(&mut self, req: &Attempt, window_ns: u64) -> Option<Retry> {
        let at = self
            .recent
            .iter()
            .position(|i| i.retried_by(req, window_ns))?;
        Some(self.recent.remove(at)?.retry())
    }

    /// Remembers `i` for a later retry. Those ended more than `window_ns`
    /// before it go (they end in order: requests are finished in the
    /// order of the events that end them).
    pub fn note(&mut self, i: Interruption, window_ns: u64) {
        while self
            .recent
            .front()
            .is_some_and(|old| old.attempt.t_end.saturating_add(window_ns) < i.attempt.t_end)
        {
            self.recent.pop_front();
        }
        if self.recent.len() >= MAX_INTERRUPTIONS {
            self.recent.pop_front();
            self.dropped += 1;
        }
        self.recent.push_back(i);
    }
}
