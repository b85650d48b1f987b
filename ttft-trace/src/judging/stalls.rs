//! A request's stalls after the first token (issue 31): found in its gaps
//! between sends and between its chunks' ACKs (`requests::stream_stalls`),
//! each judged on its window, and the stream's pace over its length. What
//! the JSONL, Prometheus and OTLP export.

use serde::Serialize;

use super::{WorkloadSignals, evidence, prefills::Prefills};
use crate::{
    causes::{
        Cause, CauseConfig, RequestId, StallEvidence, attribute_delivery_stall, attribute_stall,
        labels_of,
    },
    nvml::Sampler,
    requests::{
        Outcome, RequestRecord,
        stream_end::{Finish, Terminator},
        stream_stalls::{
            DEGRADING_PERMILLE, SeenAt, StallConfig, Stalls, find_delivery_stalls, find_stalls,
            merge, quarter_ratio_permille,
        },
    },
};

/// One stall, judged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JudgedStall {
    /// The send before the gap and the send after it; seen at the
    /// delivery, the ACKs of those chunks.
    pub t_start_ns: u64,
    pub t_end_ns: u64,
    pub duration_ns: u64,
    /// Where the gap was: between sends, or only between the chunks' ACKs
    /// (the sends on time).
    pub seen_at: SeenAt,
    /// Longest explained first; empty: unexplained.
    pub causes: Vec<Cause>,
    /// The request whose prefill interfered (`prefill_interference`).
    pub interfering_request: Option<RequestId>,
}

impl JudgedStall {
    /// The `cause` label values this stall counts under: one per cause, or `unexplained`.
    pub fn labels(&self) -> Vec<&'static str> {
        labels_of(&self.causes)
    }
}

/// A request's stalls and pace.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct JudgedStalls {
    /// The gap a stall exceeded (fixed, or `max(100 ms, k × median gap)`).
    pub threshold_ns: u64,
    pub count: u32,
    pub total_ns: u64,
    pub longest_ns: u64,
    /// At most `StallConfig::max_listed`, in stream order.
    pub windows: Vec<JudgedStall>,
    /// Stalls beyond those, counted in `count` and `total_ns` but neither listed nor judged.
    pub windows_dropped: u32,
    /// Mean gap of the stream's last quarter over its first, per-mille (`None` under 8
    /// gaps).
    pub pace_ratio_permille: Option<u64>,
    /// `pace_ratio_permille` ≥ `DEGRADING_PERMILLE` (2000).
    pub degrading: bool,
    /// Mean body bytes a chunk in the stream's last quarter over its first,
    /// per-mille (`None` under 8 chunks).
    pub chunk_growth_permille: Option<u64>,
    /// `chunk_growth_permille` ≥ `DEGRADING_PERMILLE`: tokens coalesced
    /// into fewer, larger sends (a side fell behind).
    pub chunks_growing: bool,
    /// How the stream ended without its normal end; `None`: it did not,
    /// or it could not be seen.
    pub truncated: Option<Truncation>,
    /// The stream's last finish reason (`stop`, `length`, ...), where its
    /// protocol carries one and it was seen.
    pub finish_reason: Option<String>,
}

/// How a stream ended without its normal end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// The connection closed mid-response, after the first token.
    Cut,
    /// The body ended without its protocol's terminator (`data: [DONE]`,
    /// `message_stop`).
    MissingTerminator,
    /// The last finish reason the stream gave was `null`.
    NoFinishReason,
}

impl Truncation {
    pub const ALL: [Truncation; 3] = [Self::Cut, Self::MissingTerminator, Self::NoFinishReason];

    pub fn name(self) -> &'static str {
        match self {
            Self::Cut => "cut",
            Self::MissingTerminator => "missing_terminator",
            Self::NoFinishReason => "no_finish_reason",
        }
    }
}

/// How `record`'s stream ended, if not normally (see [`Truncation`]). A
/// close mid-response after the protocol's terminator is no cut: clients
/// such as `openai`'s close once they read `data: [DONE]`, at times before
/// the server wrote the chunked body's end.
fn truncation(record: &RequestRecord) -> Option<Truncation> {
    record.t_first_token_ns?;
    let end = &record.ending;
    match record.outcome {
        Outcome::ClosedMidResponse if end.terminator != Terminator::Seen => Some(Truncation::Cut),
        Outcome::Ok if end.terminator == Terminator::Missing => Some(Truncation::MissingTerminator),
        Outcome::Ok | Outcome::ClosedMidResponse if end.finish == Finish::Null => {
            Some(Truncation::NoFinishReason)
        }
        _ => None,
    }
}

/// Finds `record`'s stalls under `config` and judges each listed one on
/// the workload's signals `w`, the GPU readings and the prefills known.
pub fn judge(
    record: &RequestRecord,
    w: &WorkloadSignals,
    gpu: Option<&Sampler>,
    prefills: &Prefills,
    config: &StallConfig,
    causes: &CauseConfig,
) -> JudgedStalls {
    let pace = quarter_ratio_permille(&record.itl_ns);
    let growth = quarter_ratio_permille(&record.chunk_bytes);
    let mut out = JudgedStalls {
        pace_ratio_permille: pace,
        degrading: pace.is_some_and(|p| p >= DEGRADING_PERMILLE),
        chunk_growth_permille: growth,
        chunks_growing: growth.is_some_and(|g| g >= DEGRADING_PERMILLE),
        truncated: truncation(record),
        finish_reason: match &record.ending.finish {
            Finish::Reason(r) => Some(r.clone()),
            _ => None,
        },
        ..JudgedStalls::default()
    };
    let Some(ft) = record.t_first_token_ns else {
        return out;
    };
    let found = stalls_of(ft, record, config);
    // GPU busy and idle time only for a request joined to GPU work.
    let episodes = w.episodes.filter(|_| record.queue_ns.is_some());
    out.windows = found
        .windows
        .iter()
        .map(|stall| {
            let (a, b) = (stall.t_start_ns, stall.t_end_ns);
            if stall.seen_at == SeenAt::Delivery {
                // Sent on time: only the wire can have held it.
                let ev = evidence::gather_delivery_stall(record, w.store, a, b);
                return JudgedStall {
                    t_start_ns: a,
                    t_end_ns: b,
                    duration_ns: stall.duration_ns(),
                    seen_at: stall.seen_at,
                    causes: attribute_delivery_stall(&ev),
                    interfering_request: None,
                };
            }
            // The GPU step that ended the stall, and what ran before it.
            let join = episodes.map(|h| h.join(a, b));
            let overlaps = prefills.overlapping(w.root, record, a, b);
            let ev = StallEvidence {
                window: evidence::gather_stall(record, w.store, gpu, join.as_ref(), a, b),
                prefill_overlap_ns: overlaps.union_ns,
                longest_prefill: overlaps.longest,
                prefills: overlaps.count,
            };
            let verdict = attribute_stall(&ev, causes);
            JudgedStall {
                t_start_ns: a,
                t_end_ns: b,
                duration_ns: stall.duration_ns(),
                seen_at: stall.seen_at,
                causes: verdict.causes,
                interfering_request: verdict.interfering,
            }
        })
        .collect();
    out.threshold_ns = found.threshold_ns;
    out.count = found.count;
    out.total_ns = found.total_ns;
    out.longest_ns = found.longest_ns;
    out.windows_dropped = found.dropped;
    out
}

/// The stalls of `record`'s stream whose first token was sent at `ft`: those
/// between its sends, and those only between its chunks' ACKs (one stall
/// when seen at both), in time order.
fn stalls_of(ft: u64, record: &RequestRecord, config: &StallConfig) -> Stalls {
    let uncapped = StallConfig {
        max_listed: usize::MAX,
        ..*config
    };
    let sent = find_stalls(ft, &record.itl_ns, &uncapped);
    let delivered = match record.t_first_chunk_acked_ns {
        Some(t) => find_delivery_stalls(t, &record.chunk_ack_gaps_ns, &sent, config),
        None => Stalls::default(),
    };
    merge(sent, delivered, config.max_listed)
}
