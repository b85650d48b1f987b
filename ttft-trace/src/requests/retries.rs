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

use super::connection::Request;

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

/// What a retry's record says of the attempt it repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Retry {
    pub of: RequestId,
    /// The arrival of the first attempt of the chain.
    pub t_first_arrive: u64,
}

/// A request that ended interrupted, while its retry may still come.
#[derive(Debug, Clone, Copy)]
struct Interruption {
    id: RequestId,
    client: IpAddr,
    server_port: u16,
    /// The connection's serial: an HTTP/1.1 retry comes on another one.
    serial: u64,
    http2: bool,
    bytes_in: u64,
    t_first_arrive: u64,
    /// Its last sign of life (its last send, or its arrival).
    t_end: u64,
}

/// The interruptions of the last window.
#[derive(Debug, Default)]
pub(crate) struct Interruptions {
    recent: VecDeque<Interruption>,
    /// Forgotten for want of room.
    pub dropped: u64,
}

impl Interruptions {
    /// The interruption `req` (arrived, not yet noted) retries, if any,
    /// taken out: the first one before its arrival, within `window_ns`, of
    /// its client address and server port.
    pub fn retry_of(&mut self, req: &Request, window_ns: u64) -> Option<Retry> {
        let client = req.conn.client.ip();
        let port = req.conn.server.port();
        let at = self.recent.iter().position(|i| {
            i.client == client
                && i.server_port == port
                && i.t_end <= req.t_arrive
                && req.t_arrive - i.t_end <= window_ns
                && (i.http2 && req.http2
                    || i.serial != req.conn.serial && i.bytes_in == req.bytes_in)
        })?;
        let i = self.recent.remove(at)?;
        Some(Retry {
            of: i.id,
            t_first_arrive: i.t_first_arrive,
        })
    }

    /// `req` ended interrupted (its retry link already made): a later
    /// request may retry it. Those older than `window_ns` before it go.
    pub fn note(&mut self, req: &Request, window_ns: u64) {
        let t_end = req.t_last_send().unwrap_or(req.t_arrive).max(req.t_arrive);
        while self
            .recent
            .front()
            .is_some_and(|i| i.t_end.saturating_add(window_ns) < t_end)
        {
            self.recent.pop_front();
        }
        if self.recent.len() >= MAX_INTERRUPTIONS {
            self.recent.pop_front();
            self.dropped += 1;
        }
        self.recent.push_back(Interruption {
            id: RequestId {
                conn: req.conn.sk,
                request_index: req.index,
            },
            client: req.conn.client.ip(),
            server_port: req.conn.server.port(),
            serial: req.conn.serial,
            http2: req.http2,
            bytes_in: req.bytes_in,
            t_first_arrive: req.retry.map_or(req.t_arrive, |r| r.t_first_arrive),
            t_end,
        });
    }
}
