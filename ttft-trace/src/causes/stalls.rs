//! Why a stream stalled after its first token (issue 31, item 2): each stall's window
//! `[send before, send after]` judged by the TTFT rules that read a window's signals
//! (`queueing`, `batching`, `cpu`, `gpu_memory`, same code and thresholds; the stall split as
//! TTFT is, at the GPU step that ended it: *queue* from its start to that step's launch, *GPU*
//! the step), a `network` rule on the request's own connection, and `prefill_interference`. A
//! stall no rule explains is `unexplained`; nothing is forced.
//!
//! | cause | fires when | explains |
//! | --- | --- | --- |
//! | `prefill_interference` | other requests' prefills (the GPU episode of each one's first token, same workload and GPU process) cover ≥ `stall_prefill_min_share` (0.5) of the stall | the covered time; the request with the longest overlap is named |
//! | `network` | the request's connection retransmitted inside the stall or up to [`NETWORK_LOOKBACK_NS`] before it, and the stall from that retransmit on is ≥ the `network` threshold (100 ms, or half the SLO) | the stall from the first such retransmit (all of it when that came before) |
//! | `queueing`, `batching`, `cpu`, `gpu_memory` | as for TTFT, on the stall as the TTFT window and its part before the step that ended it as the queue (the GPU's idle and busy time, steps completed, CPU-stage time, copies there; run-queue delay, NVML memory over the whole stall) | as for TTFT, capped at the stall |

use super::{
    attribution::{Cause, CauseClass},
    config::CauseConfig,
    evidence::Evidence,
    rules::{EvidenceMap, cause, longest_first, window_causes},
};

/// How long before a stall a retransmit on the connection may be and still count: Linux's
/// minimum RTO, the least a timeout-repaired loss holds the stream.
pub const NETWORK_LOOKBACK_NS: u64 = 200_000_000;

pub use crate::requests::RequestId;

/// Another request's prefill overlapping a stall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillOverlap {
    pub request: RequestId,
    pub overlap_ns: u64,
}

/// What the rules read about one stall.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StallEvidence {
    /// The TTFT evidence filled over the stall: `request.t_arrive_ns` is its start,
    /// `ttft_ns` its duration, `queue_ns` and `gpu_ns` the wait for the GPU step that ended
    /// it and that step (`None` when not known); the retransmits are those from
    /// [`NETWORK_LOOKBACK_NS`] before it to its end.
    pub window: Evidence,
    /// Union of other requests' prefills over the stall.
    pub prefill_overlap_ns: u64,
    /// The other request whose prefill overlapped the stall longest.
    pub longest_prefill: Option<PrefillOverlap>,
    /// How many other requests' prefills overlapped it.
    pub prefills: u32,
}

/// The verdict on one stall: its causes, longest explained first (empty: unexplained), and
/// the request that interfered, when named.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StallVerdict {
    pub causes: Vec<Cause>,
    pub interfering: Option<RequestId>,
}

/// Judges one stall.
pub fn attribute_stall(ev: &StallEvidence, cfg: &CauseConfig) -> StallVerdict {
    let span = ev.window.request.ttft_ns.unwrap_or(0);
    let prefill = prefill_interference(ev, cfg, span);
    let interfering = prefill.as_ref().and(ev.longest_prefill).map(|p| p.request);
    let mut causes = window_causes(&ev.window, cfg, span);
    causes.extend(prefill);
    causes.extend(network(&ev.window, cfg, span));
    longest_first(&mut causes);
    StallVerdict {
        causes,
        interfering,
    }
}

fn prefill_interference(ev: &StallEvidence, cfg: &CauseConfig, span: u64) -> Option<Cause> {
    let longest = ev.longest_prefill?;
    if span == 0 || (ev.prefill_overlap_ns as f64) < cfg.stall_prefill_min_share * span as f64 {
        return None;
    }
    let e = EvidenceMap::from([
        ("prefill_overlap_ns", ev.prefill_overlap_ns.into()),
        ("prefills", ev.prefills.into()),
        (
            "interfering_conn",
            format!("{:#x}", longest.request.conn).into(),
        ),
        (
            "interfering_request_index",
            longest.request.request_index.into(),
        ),
        ("interfering_overlap_ns", longest.overlap_ns.into()),
    ]);
    Some(cause(
        CauseClass::PrefillInterference,
        ev.prefill_overlap_ns.min(span),
        e,
    ))
}

/// Judges one stall seen only at the delivery (`ev` filled as for [`StallEvidence`]'s window,
/// its retransmits only): the chunks were sent on time and reached the client late, so the
/// one rule is `network`: a retransmit on the request's connection in the stall or up to
/// [`NETWORK_LOOKBACK_NS`] before it explains all of it (the retransmit that repairs a loss
/// comes at the stall's end, as late as the timeout or the later segments that reveal it: no
/// share of the stall after it is asked for, unlike at the send). Otherwise unexplained
/// (empty).
pub fn attribute_delivery_stall(ev: &Evidence) -> Vec<Cause> {
    let span = ev.request.ttft_ns.unwrap_or(0);
    let Some(&first) = ev.retransmit_times_ns.first() else {
        return Vec::new();
    };
    let e = EvidenceMap::from([
        ("retransmits", ev.retransmits.into()),
        ("resets", ev.resets.into()),
        ("first_retransmit_ns", first.into()),
    ]);
    vec![cause(CauseClass::Network, span, e)]
}

/// Loss on the request's own connection while the stream stood still: the stall from the
/// first retransmit (in it, or shortly before it) on.
fn network(ev: &Evidence, cfg: &CauseConfig, span: u64) -> Option<Cause> {
    let start = ev.request.t_arrive_ns;
    let first = *ev.retransmit_times_ns.first()?;
    let explained = start.saturating_add(span) - first.clamp(start, start.saturating_add(span));
    if explained < cfg.network_min_ns() {
        return None;
    }
    let e = EvidenceMap::from([
        ("retransmits", ev.retransmits.into()),
        ("resets", ev.resets.into()),
        ("first_retransmit_ns", first.into()),
    ]);
    Some(cause(CauseClass::Network, explained, e))
}
