//! Why a request was slow: the six causes of the design, each with a rule over the request's
//! [`Evidence`], each threshold in [`CauseConfig`]. Pure code: no kernel, no clock, no I/O.
//!
//! # Slow, SLO violation, causes
//!
//! A request is judged only when it has a TTFT that counts (the one the TTFT histogram
//! records). It is an **SLO violation** when TTFT > `slow_ttft` (350 ms), and **slow** when
//! TTFT or the client's TTFT estimate (first token acknowledged − request segment arrived, see
//! `crate::requests`) exceeds `slow_ttft`. Only slow requests get causes. Every rule is tried;
//! each that fires gives a cause with the time it explains (never more than TTFT; for `network`
//! never more than the client's estimate) and the numbers it read. Causes may overlap, so their times need not add up to TTFT. They are
//! listed longest first. A slow request with no rule firing is `unexplained`.
//!
//! Windows: *queue* = arrival to the first launch of the request's GPU work; *TTFT* = arrival
//! to the first token; "GPU idle" = the part of the queue window covered by no GPU episode.
//!
//! | cause | fires when | explains |
//! | --- | --- | --- |
//! | `queueing` | queue ≥ `queueing_min` (2 s), at least one other GPU step completed in the TTFT window, and the GPU was busy for ≥ `queueing_min_busy_share` (0.5) of the queue | the busy part of the queue |
//! | `batching` | GPU idle ≥ `batching_min_idle` (100 ms), CPU-stage time (on CPU + blocked) < `batching_max_cpu_share` (0.5) of the idle, and the GPU thread blocked ≥ `batching_min_gpu_blocked_share` (0.5) of the idle | idle − CPU-stage time |
//! | `cpu` | run-queue delay of the tree's threads in the TTFT window ≥ `cpu_min_runq` (50 ms), or min(CPU-stage time, GPU idle) ≥ `cpu_min_stage` (100 ms) | the run-queue delay plus that CPU-stage time (each part only if it passed its threshold) |
//! | `network` | the client acknowledged the first token ≥ `network_min_delivery` (100 ms) beyond one smoothed RTT after its send, and the request's own connection retransmitted between arrival and that ACK | the delivery delay: ACK − send − SRTT |
//! | `gpu_memory` | NVML memory used ≥ `gpu_memory_share` (0.95) of total in the TTFT window, or copies of ≥ 1 MiB between host and device in it add up to ≥ `swap_min_bytes` (256 MiB) (not counted in a cold start) | the GPU part of TTFT plus the first-to-last span of the large copies made during the queue (not in a cold start) |
//! | `cold_start` | the GPU process's first-ever episode fell in the TTFT window, or it started < `cold_start_window` (60 s) before arrival | queue + GPU part (the whole TTFT without a breakdown) |
//!
//! Clock throttling (any NVML reason but `gpu_idle`) is not a class: it is listed, with the
//! lowest SM clock, in the evidence of `queueing`, `gpu_memory` and `cold_start`.
//!
//! # Where the rules can be fooled
//!
//! - **Network.** Server-side TTFT ends when the first token is handed to the kernel; loss
//!   delays its *delivery*, which shows only as the client's late ACK of it. The estimate
//!   assumes HTTP/1.1 request/response on the connection. A late ACK without a retransmit (a
//!   client that reads late or delays its ACK, a full receive window, jitter) is not named
//!   network. Loss of the client's own segments (the request itself) is repaired by the client
//!   and is seen only as a later request segment. A reset alone is not a cause: a client that
//!   gives up on a slow response resets too; resets are shown in the evidence.
//! - **CPU.** Run-queue delay and CPU-stage time are summed over threads and are not tied to
//!   the request: on a busy server other requests' work counts too. That is why stage time
//!   counts only inside the GPU's idle gap; with a GPU kept busy by others, a slow tokenizer
//!   cannot be told from ordinary queueing. A server that tokenizes on its GPU-launching
//!   thread shows neither CPU-stage time nor a blocked GPU thread: unexplained.
//! - **Queueing.** With tensor parallelism every rank's episode counts as a step; the busy
//!   share is what tells others' work from the request's own.
//! - **GPU memory.** Engines that pre-allocate the KV cache keep NVML's figure high whatever
//!   the pressure, hence 0.95; copy traffic is the better signal. Large input tensors (images
//!   of a vision model) count as copies too.
//! - **Cold start.** A process already running when tracing began has no known first episode;
//!   only its age can mark it young.

mod attribution;
mod config;
mod evidence;
mod rules;
mod stalls;
mod summary;

pub use attribution::{Attribution, Cause, CauseClass, UNEXPLAINED, labels_of};
pub use config::CauseConfig;
pub use evidence::{Evidence, RETRANSMIT_TIMES_CAP, RequestTimes};
pub use rules::attribute;
pub use stalls::{
    NETWORK_LOOKBACK_NS, PrefillOverlap, RequestId, StallEvidence, StallVerdict,
    attribute_delivery_stall, attribute_stall,
};
pub use summary::CauseSummary;

#[cfg(test)]
mod tests;
