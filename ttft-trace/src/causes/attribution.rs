//! What the rules say about one request: whether it was slow and which causes explain how
//! much of its time.

use std::collections::BTreeMap;

use serde::{Serialize, Serializer};

/// The six causes of the design, and `prefill_interference`, which only a stall after the
/// first token can have (`super::stalls`). Declaration order breaks ties between causes that
/// explain the same time, so that output is deterministic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CauseClass {
    Queueing,
    Batching,
    Cpu,
    Network,
    GpuMemory,
    ColdStart,
    /// Another request's prefill ran on the GPU during a stall (stalls only).
    PrefillInterference,
}

impl CauseClass {
    /// The causes of a slow TTFT.
    pub const ALL: [CauseClass; 6] = [
        Self::Queueing,
        Self::Batching,
        Self::Cpu,
        Self::Network,
        Self::GpuMemory,
        Self::ColdStart,
    ];

    /// The causes a stall after the first token can have (`super::stalls`).
    pub const STALL: [CauseClass; 6] = [
        Self::PrefillInterference,
        Self::Queueing,
        Self::Batching,
        Self::Cpu,
        Self::Network,
        Self::GpuMemory,
    ];

    /// The name in the JSONL and the `cause` label.
    pub fn name(self) -> &'static str {
        match self {
            Self::Queueing => "queueing",
            Self::Batching => "batching",
            Self::Cpu => "cpu",
            Self::Network => "network",
            Self::GpuMemory => "gpu_memory",
            Self::ColdStart => "cold_start",
            Self::PrefillInterference => "prefill_interference",
        }
    }
}

impl Serialize for CauseClass {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// The name a slow request with no cause is counted under. Not a [`CauseClass`]: it is the
/// absence of one.
pub const UNEXPLAINED: &str = "unexplained";

/// The `cause` label values of something judged slow (a request, a stall)
/// with these causes: one per cause, or `unexplained` when none.
pub fn labels_of(causes: &[Cause]) -> Vec<&'static str> {
    if causes.is_empty() {
        vec![UNEXPLAINED]
    } else {
        causes.iter().map(|c| c.class.name()).collect()
    }
}

/// One cause of one slow request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cause {
    pub class: CauseClass,
    /// Time this cause explains, never more than the TTFT judged (for `network`, the first
    /// token's delivery beyond one round trip, never more than the client's TTFT estimate).
    /// Causes may overlap: their sum can exceed TTFT.
    pub explained_ns: u64,
    /// The numbers the rule read (`_ns` durations, `_ratio` shares, counts), and for causes
    /// involving the GPU the NVML throttle reasons seen.
    pub evidence: BTreeMap<&'static str, serde_json::Value>,
}

/// The verdict on one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Attribution {
    /// TTFT, or the client's TTFT estimate, exceeded the slow threshold: causes were sought.
    pub slow: bool,
    /// The measured (server-side) TTFT exceeded the slow threshold: what
    /// `ttft_trace_slo_violations_total` counts, consistent with the TTFT histogram.
    pub slo_violation: bool,
    /// Ordered by explained time, longest first. Empty on a slow request: unexplained.
    pub causes: Vec<Cause>,
    /// The measured TTFT that was judged (already in the request line, so not serialised);
    /// `None` for a request that was not judged.
    #[serde(skip)]
    pub ttft_ns: Option<u64>,
    /// The client's TTFT estimate that was judged with it (in the request line too).
    #[serde(skip)]
    pub client_ttft_estimate_ns: Option<u64>,
}

impl Attribution {
    /// A slow request that no rule explains.
    pub fn unexplained(&self) -> bool {
        self.slow && self.causes.is_empty()
    }

    /// The TTFT the slow threshold was compared with: the later of the server's and the
    /// client's estimate.
    pub fn judged_ttft_ns(&self) -> Option<u64> {
        let ttft = self.ttft_ns?;
        Some(ttft.max(self.client_ttft_estimate_ns.unwrap_or(0)))
    }

    /// The `cause` label values this request counts under: one per cause, or `unexplained`.
    /// Empty when not slow.
    pub fn labels(&self) -> Vec<&'static str> {
        if self.slow {
            labels_of(&self.causes)
        } else {
            Vec::new()
        }
    }
}
