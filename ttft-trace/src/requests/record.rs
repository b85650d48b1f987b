//! What is reported per request: one JSONL line ([`RequestRecord`]), its
//! outcome, and which of its figures enter the histograms.

use serde::{Serialize, Serializer};

use super::{
    chunk_delivery::ChunkDates,
    connection::Finished,
    delivery::Seen,
    join::Join,
    outcome::Outcome,
    response::Framing,
    retries::AttemptId,
    stream_end::Ending,
    streams::{Side, StreamEnd},
    tls::TlsFacts,
};

/// The figures kept per request, for histograms and percentiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    Ttft,
    Queue,
    Gpu,
    Egress,
    Itl,
    E2e,
    Tpot,
}

impl Figure {
    pub const ALL: [Figure; 7] = [
        Self::Ttft,
        Self::Queue,
        Self::Gpu,
        Self::Egress,
        Self::Itl,
        Self::E2e,
        Self::Tpot,
    ];

    /// Short name for the terminal.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ttft => "TTFT",
            Self::Queue => "queue",
            Self::Gpu => "GPU",
            Self::Egress => "egress",
            Self::Itl => "ITL",
            Self::E2e => "E2E",
            Self::Tpot => "TPOT",
        }
    }
}

/// One JSONL line per request. Times are CLOCK_MONOTONIC nanoseconds (the
/// clock of `bpf_ktime_get_ns`); figures are defined in [`super`]. Absent
/// values are `null`, never 0: a missing breakdown is not a zero one.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RequestRecord {
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Process and thread that received the request's first bytes.
    pub pid: u32,
    pub tid: u32,
    /// The socket's kernel address, the connection's key (hex in JSON).
    #[serde(rename = "conn", serialize_with = "hex")]
    pub sk: u64,
    pub client_addr: String,
    pub client_port: u16,
    pub server_addr: String,
    pub server_port: u16,
    /// 0 for the first request on the connection (since tracing began).
    pub request_index: u32,
    pub t_arrive_ns: u64,
    /// Arrival of the request's first TCP segment (`tcp:tcp_probe`), before
    /// the server's receive returned.
    pub t_request_segment_ns: Option<u64>,
    pub t_first_byte_ns: Option<u64>,
    pub t_first_token_ns: Option<u64>,
    pub t_done_ns: Option<u64>,
    pub ttft_ns: Option<u64>,
    /// When the client acknowledged the first token's last byte (the ACK's
    /// arrival at the server; see `requests::delivery`).
    pub t_first_token_acked_ns: Option<u64>,
    /// When the tracer stopped waiting for that ACK, the first token still
    /// unacknowledged (`ack_wait` after it: every retransmission it covers
    /// failed); None when acknowledged or not awaited to the end.
    pub t_first_token_unacked_ns: Option<u64>,
    /// The client's TTFT as the server's socket sees it:
    /// `t_first_token_acked − t_request_segment`.
    pub client_ttft_estimate_ns: Option<u64>,
    /// The socket's smoothed round-trip time at that ACK.
    pub srtt_ns: Option<u64>,
    pub queue_ns: Option<u64>,
    pub gpu_ns: Option<u64>,
    pub egress_ns: Option<u64>,
    /// The episode that produced the first token.
    pub gpu_pid: Option<u32>,
    pub gpu_tid: Option<u32>,
    pub gpu_t_first_launch_ns: Option<u64>,
    pub gpu_t_copy_done_ns: Option<u64>,
    /// Episodes (of any process of the tree) completed in
    /// `[t_arrive, t_first_token]`.
    pub gpu_steps_waited: Option<u32>,
    /// GPU time covered by no episode in `[t_arrive, t_gpu_start]`.
    pub gpu_idle_before_start_ns: Option<u64>,
    /// Every gap between consecutive body sends, at most the configured cap
    /// (note `itl_truncated` when cut; `chunks` still counts all).
    pub itl_ns: Vec<u64>,
    /// When the client acknowledged the first chunk's last byte (see
    /// `requests::chunk_delivery`); None when no chunk's ACK was seen.
    pub t_first_chunk_acked_ns: Option<u64>,
    /// The gaps between consecutive chunks' ACKs, from the first chunk on,
    /// as long as each was seen (at most `itl_ns`'s cap; note
    /// `chunk_acks_incomplete` when some chunk was not dated).
    pub chunk_ack_gaps_ns: Vec<u64>,
    /// The first gap in `chunk_ack_gaps_ns` that ends at the connection's
    /// close rather than at an ACK seen (its chunk's ACK came after the
    /// server closed, where `tcp_probe` does not see it: the state change
    /// that says everything was acknowledged dates it, no later than);
    /// every later gap ends there too.
    pub chunk_ack_gap_by_close: Option<u32>,
    pub chunks: u32,
    /// Body bytes of each chunk (as many as `itl_ns` holds gaps, plus
    /// one): judged, not written (see `judging::stalls`).
    #[serde(skip)]
    pub chunk_bytes: Vec<u32>,
    /// How an event stream's body ended, as far as was seen: judged, not
    /// written.
    #[serde(skip)]
    pub ending: Ending,
    pub tpot_ns: Option<u64>,
    pub e2e_ns: Option<u64>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub http_status: Option<u16>,
    pub content_type: Option<String>,
    pub framing: Option<Framing>,
    /// HTTP/2: the stream's id (`request_index` is the same), and, where
    /// it ended by RST_STREAM or GOAWAY, the frame's error code and who
    /// sent it (`client` or `server`).
    pub http2_stream_id: Option<u32>,
    pub http2_error_code: Option<u32>,
    pub http2_ended_by: Option<&'static str>,
    /// gRPC: the trailers' status code and message (percent-decoding
    /// undone, 256 bytes at most), where HPACK could be decoded (the
    /// connection seen from its start).
    pub grpc_status: Option<u32>,
    pub grpc_message: Option<String>,
    /// A TLS connection followed from its opening: the version, whether the
    /// session was resumed, and the handshake's duration, as the wire shows
    /// them (`requests/tls.rs`).
    pub tls: Option<TlsFacts>,
    /// The interrupted request this one retries (`requests/retries.rs`),
    /// and the TTFT its user saw: from the first attempt's arrival to this
    /// one's first token.
    pub retry_of: Option<AttemptId>,
    pub user_ttft_ns: Option<u64>,
    pub outcome: Outcome,
    /// Why figures are absent or may be off (see the module docs).
    pub notes: Vec<&'static str>,
}

impl RequestRecord {
    pub(crate) fn new(
        f: &Finished,
        join: Option<&Join>,
        delivery: &Seen,
        chunk_dates: Option<&ChunkDates>,
    ) -> Self {
        let req = &f.request;
        let resp = req.response.as_ref();
        let t_arrive = req.t_arrive;
        // TLS records are no tokens: no first token, nor anything timed from it.
        let t_first_token = resp
            .and_then(|r| r.t_first_token)
            .filter(|_| f.outcome != Outcome::TlsUnsupported);
        let t_done = resp.map(|r| r.t_last_send);
        let ttft = t_first_token.map(|t| t.saturating_sub(t_arrive));
        let whole = matches!(f.outcome, Outcome::Ok | Outcome::ErrorStatus);
        let e2e = t_done.filter(|_| whole).map(|t| t.saturating_sub(t_arrive));
        let chunks = resp.map_or(0, |r| r.chunks);
        let tpot = match (e2e, ttft) {
            (Some(e2e), Some(ttft)) if chunks > 1 => {
                Some(e2e.saturating_sub(ttft) / u64::from(chunks - 1))
            }
            _ => None,
        };
        let mut notes = req.notes.clone();
        if let Some(r) = resp {
            notes.extend_from_slice(&r.notes);
            if r.itl_truncated {
                notes.push("itl_truncated");
            }
        }
        // Acknowledged without a first token cannot happen; keep both or neither.
        let (acked, unacked) = match delivery {
            Seen::Acked(a) => (Some(a), None),
            Seen::UnackedAt(t) => (None, Some(*t)),
            Seen::Unknown => (None, None),
        };
        let acked = acked.filter(|_| t_first_token.is_some());
        let unacked = unacked.filter(|_| t_first_token.is_some());
        if acked.is_some_and(|a| a.at_close) {
            notes.push("first_token_acked_by_close");
        }
        if let Some(d) = chunk_dates {
            if d.by_close_from.is_some() {
                notes.push("chunks_acked_by_close");
            }
            if d.lost || d.pending() > 0 {
                notes.push("chunk_acks_incomplete");
            }
        }
        let segment = req.segment;
        if segment.is_some_and(|s| s.at_handshake) {
            notes.push("request_segment_at_handshake");
        }
        let client_ttft = acked
            .zip(segment)
            .map(|(a, s)| a.t_ns.saturating_sub(s.t_ns));
        let episode = join.and_then(|j| j.episode);
        let breakdown = episode.zip(t_first_token).map(|(e, ft)| {
            // Joined a batch already running: the wait for the GPU is 0 and
            // its GPU part counts from arrival, so that the three add up.
            let gpu_start = e.t_first_launch_ns.max(t_arrive);
            (
                gpu_start - t_arrive,
                e.t_copy_done_ns - gpu_start,
                ft - e.t_copy_done_ns,
            )
        });
        match (episode, t_first_token) {
            (Some(e), _) if e.t_first_launch_ns < t_arrive => notes.push("joined_running_batch"),
            (None, Some(_)) => notes.push("no_gpu_episode"),
            _ => {}
        }
        Self {
            kind: "request",
            pid: req.tgid,
            tid: req.tid,
            sk: req.conn.sk,
            client_addr: req.conn.client.ip().to_string(),
            client_port: req.conn.client.port(),
            server_addr: req.conn.server.ip().to_string(),
            server_port: req.conn.server.port(),
            request_index: req.index,
            t_arrive_ns: t_arrive,
            t_request_segment_ns: segment.map(|s| s.t_ns),
            t_first_byte_ns: resp.map(|r| r.t_first_byte),
            t_first_token_ns: t_first_token,
            t_done_ns: t_done,
            ttft_ns: ttft,
            t_first_token_acked_ns: acked.map(|a| a.t_ns),
            t_first_token_unacked_ns: unacked,
            client_ttft_estimate_ns: client_ttft,
            srtt_ns: acked.map(|a| a.srtt_ns),
            queue_ns: breakdown.map(|b| b.0),
            gpu_ns: breakdown.map(|b| b.1),
            egress_ns: breakdown.map(|b| b.2),
            gpu_pid: episode.map(|e| e.tgid),
            gpu_tid: episode.map(|e| e.tid),
            gpu_t_first_launch_ns: episode.map(|e| e.t_first_launch_ns),
            gpu_t_copy_done_ns: episode.map(|e| e.t_copy_done_ns),
            gpu_steps_waited: join.map(|j| j.steps_waited),
            gpu_idle_before_start_ns: join.and_then(|j| j.idle_before_start_ns),
            itl_ns: resp.map(|r| r.itl.clone()).unwrap_or_default(),
            t_first_chunk_acked_ns: chunk_dates.and_then(|d| d.acked_ns.first().copied()),
            chunk_ack_gaps_ns: chunk_dates.map(ChunkDates::gaps_ns).unwrap_or_default(),
            chunk_ack_gap_by_close: chunk_dates
                .and_then(|d| d.by_close_from)
                .and_then(|k| k.checked_sub(1))
                .and_then(|k| u32::try_from(k).ok()),
            chunks,
            chunk_bytes: resp.map(|r| r.chunk_bytes.clone()).unwrap_or_default(),
            ending: resp
                .and_then(|r| r.stream_end.as_ref())
                .map(|e| e.ending())
                .unwrap_or_default(),
            tpot_ns: tpot,
            e2e_ns: e2e,
            bytes_in: req.bytes_in,
            bytes_out: req.bytes_out,
            http_status: resp.and_then(|r| r.status),
            content_type: resp.and_then(|r| r.content_type.clone()),
            framing: resp.map(|r| r.framing),
            http2_stream_id: req.stream_end.map(|_| req.index),
            http2_error_code: stream_error(req.stream_end).map(|(code, _)| code),
            http2_ended_by: stream_error(req.stream_end).map(|(_, by)| match by {
                Side::Client => "client",
                Side::Server => "server",
            }),
            grpc_status: resp.and_then(|r| r.grpc_status),
            grpc_message: resp.and_then(|r| r.grpc_message.clone()),
            tls: req.tls_handshake,
            retry_of: req.retry.map(|r| r.of),
            user_ttft_ns: req
                .retry
                .zip(t_first_token)
                .map(|(r, t)| t.saturating_sub(r.t_first_arrive)),
            outcome: f.outcome,
            notes,
        }
    }

    /// The figures of this request that enter histograms and percentiles,
    /// in nanoseconds. As `vllm bench serve` counts only successful
    /// requests: E2E and TPOT only for `ok`; TTFT, its breakdown and ITL
    /// also for responses that started normally but did not end
    /// (`closed_mid_response`, `in_flight_at_exit`). Error responses,
    /// pipelined and evicted requests give none.
    pub fn observations(&self) -> impl Iterator<Item = (Figure, u64)> + '_ {
        let started = self.outcome.first_token_counts();
        let whole = self.outcome == Outcome::Ok;
        let early = [
            (Figure::Ttft, self.ttft_ns),
            (Figure::Queue, self.queue_ns),
            (Figure::Gpu, self.gpu_ns),
            (Figure::Egress, self.egress_ns),
        ];
        let late = [(Figure::E2e, self.e2e_ns), (Figure::Tpot, self.tpot_ns)];
        early
            .into_iter()
            .filter(move |_| started)
            .chain(late.into_iter().filter(move |_| whole))
            .filter_map(|(f, v)| v.map(|v| (f, v)))
            .chain(
                self.itl_ns
                    .iter()
                    .filter(move |_| started)
                    .map(|&gap| (Figure::Itl, gap)),
            )
    }
}

/// The error code and sender of the frame that ended a stream early.
fn stream_error(end: Option<StreamEnd>) -> Option<(u32, Side)> {
    match end? {
        StreamEnd::Reset { code, by } | StreamEnd::GoAway { code, by } => Some((code, by)),
        StreamEnd::Ended | StreamEnd::Cut | StreamEnd::Evicted => None,
    }
}

/// A socket key as JSON shows it: `"0x…"`.
fn hex<S: Serializer>(sk: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{sk:#x}"))
}
