//! The request line: written from the judged request ([`RequestLine`]),
//! read back in the compact form a reader needs ([`Request`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    causes::{self, Attribution},
    judging::JudgedStalls,
    nvml::WindowReadings,
    requests::RequestRecord,
    workloads::WorkloadLabels,
};

/// A request's line as written: the record (`requests::RequestRecord`,
/// `type` included), its workload, its attribution (`slow`,
/// `slo_violation`, `causes`), and for slow requests the evidence read (GPU
/// readings included).
#[derive(Debug, Serialize)]
pub struct RequestLine<'a> {
    #[serde(flatten)]
    pub record: &'a RequestRecord,
    pub workload: &'a WorkloadLabels,
    /// The workload's root process.
    pub workload_pid: u32,
    #[serde(flatten)]
    pub attribution: &'a Attribution,
    /// TCP retransmits on the request's connection between its arrival and
    /// its last send (all requests, slow or not).
    pub tcp_retransmits: usize,
    /// NVML readings over [arrival, first token] of the GPU that served it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<&'a WindowReadings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence: Option<&'a causes::Evidence>,
    /// Stalls after the first token, each judged, and the stream's pace
    /// (every request).
    pub stalls: &'a JudgedStalls,
}

/// A request line as read back: the fields a reader (the report, the
/// tests) uses. Absent optional figures are `None`; fields a line of an
/// older tracer may lack take their default. A line without `pid`,
/// `t_arrive_ns` or `outcome` is not a request line.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Request {
    pub pid: u32,
    #[serde(default)]
    pub conn: String,
    #[serde(default)]
    pub client_addr: String,
    #[serde(default)]
    pub client_port: u16,
    #[serde(default)]
    pub request_index: u32,
    pub t_arrive_ns: u64,
    pub t_first_token_ns: Option<u64>,
    pub t_done_ns: Option<u64>,
    pub ttft_ns: Option<u64>,
    pub t_first_token_acked_ns: Option<u64>,
    pub client_ttft_estimate_ns: Option<u64>,
    pub queue_ns: Option<u64>,
    pub gpu_ns: Option<u64>,
    pub egress_ns: Option<u64>,
    pub gpu_steps_waited: Option<u32>,
    /// A reader may move these out (the report keeps them in its ITL
    /// figures).
    #[serde(default)]
    pub itl_ns: Vec<u64>,
    #[serde(default)]
    pub chunks: u32,
    pub tpot_ns: Option<u64>,
    pub e2e_ns: Option<u64>,
    pub http_status: Option<u16>,
    pub outcome: String,
    #[serde(default)]
    pub notes: Vec<String>,
    #[serde(default)]
    pub workload: Workload,
    #[serde(default)]
    pub slow: bool,
    #[serde(default)]
    pub causes: Vec<Cause>,
    #[serde(default)]
    pub tcp_retransmits: u64,
    /// Only on slow requests (the tracer reads evidence for those).
    pub evidence: Option<Evidence>,
    /// Absent from the lines of tracers before stalls were judged.
    #[serde(default)]
    pub stalls: Stalls,
    /// A TLS connection's handshake (absent before tracers read it).
    #[serde(default)]
    pub tls: Option<Tls>,
    /// The interrupted request this one retries, and the TTFT its user saw.
    #[serde(default)]
    pub retry_of: Option<Attempt>,
    #[serde(default)]
    pub user_ttft_ns: Option<u64>,
}

/// A request's TLS connection as read back (`requests::tls::TlsFacts`).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Tls {
    pub version: String,
    pub resumed: Option<bool>,
    pub handshake_ns: Option<u64>,
    pub hello_retry: bool,
    /// The connection's one record that counts its handshake.
    pub handshake_counted: bool,
}

/// A request's stalls after the first token as read back
/// (`judging::JudgedStalls`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct Stalls {
    pub threshold_ns: u64,
    pub count: u32,
    pub total_ns: u64,
    pub longest_ns: u64,
    pub windows: Vec<StallWindow>,
    pub windows_dropped: u32,
    pub pace_ratio_permille: Option<u64>,
    pub degrading: bool,
    pub chunk_growth_permille: Option<u64>,
    pub chunks_growing: bool,
    /// `cut`, `missing_terminator` or `no_finish_reason`.
    pub truncated: Option<String>,
    pub finish_reason: Option<String>,
}

/// One stall as read back (`judging::JudgedStall`): empty `causes` is
/// unexplained.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct StallWindow {
    pub t_start_ns: u64,
    pub t_end_ns: u64,
    pub duration_ns: u64,
    /// `send` (a gap between sends) or `delivery` (between the chunks'
    /// ACKs, the sends on time); `send` on lines of tracers before it.
    #[serde(default = "seen_at_send")]
    pub seen_at: String,
    #[serde(default)]
    pub causes: Vec<Cause>,
    #[serde(default)]
    pub interfering_request: Option<RequestId>,
}

fn seen_at_send() -> String {
    "send".into()
}

/// A request named by its connection and index on it.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct RequestId {
    pub conn: String,
    pub request_index: u32,
}

/// The attempt a retry repeats, as read back (`requests::AttemptId`).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Attempt {
    pub conn: String,
    pub request_index: u32,
    pub client_port: u16,
}

/// The workload's labels as read back (`workloads::WorkloadLabels`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Workload {
    #[serde(default)]
    pub comm: String,
    #[serde(default)]
    pub container: String,
    #[serde(default)]
    pub pod: String,
    #[serde(default)]
    pub namespace: String,
}

/// One cause as read back (`causes::Cause`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Cause {
    pub class: String,
    pub explained_ns: u64,
    #[serde(default)]
    pub evidence: BTreeMap<String, Value>,
}

/// The kernel's evidence over a slow request as read back
/// (`causes::Evidence`): totals over its windows, and the retransmits'
/// times.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct Evidence {
    pub runq_ns: u64,
    pub runq_max_ns: u64,
    pub cpu_stage_oncpu_ns: u64,
    pub cpu_stage_blocked_ns: u64,
    pub cpu_stage_thread_max_ns: u64,
    pub gpu_thread_blocked_ns: u64,
    pub retransmits: u64,
    pub retransmit_times_ns: Vec<u64>,
    pub resets: u64,
    pub large_copies: u64,
    pub large_copy_bytes: u64,
    pub large_copy_h2d_bytes: u64,
    pub large_copy_d2h_bytes: u64,
    pub large_copy_queue_span_ns: u64,
    pub first_gpu_work_in_window: bool,
}
