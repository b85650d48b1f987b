//! Every threshold of the attribution rules, with defaults from the field.

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
const MIB: u64 = 1 << 20;

/// Thresholds of the rules in [`super`]. Durations in nanoseconds, shares in 0..1.
/// Read from `--causes-config FILE` (JSON, any subset of the fields).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CauseConfig {
    /// A request whose TTFT exceeds this is an SLO violation, and slow; so is one whose
    /// client TTFT estimate exceeds it. 350 ms: the usual P99 TTFT objective of interactive
    /// serving.
    pub slow_ttft_ns: u64,
    /// `queueing` needs at least this long from arrival to the first launch of the request's
    /// GPU work. 2 s: the design's threshold for scheduler starvation.
    pub queueing_min_ns: u64,
    /// ... and the GPU busy (running others' episodes) for at least this share of that wait.
    pub queueing_min_busy_share: f64,
    /// `batching` needs the GPU idle for at least this long while the request waited. 100 ms:
    /// ten times a typical batching window (vLLM and TGI wait a few ms to fill a batch).
    pub batching_min_idle_ns: u64,
    /// ... CPU-stage time under this share of that idle time (else a CPU stage explains it)...
    pub batching_max_cpu_share: f64,
    /// ... and the GPU-launching thread blocked for at least this share of it (it waited for
    /// the batch to fill, rather than working on the CPU).
    pub batching_min_gpu_blocked_share: f64,
    /// `cpu` fires on at least this much run-queue delay in the TTFT window. 50 ms: a
    /// healthy host's scheduling delays are micro- to low milliseconds.
    pub cpu_min_runq_ns: u64,
    /// ... or on at least this much CPU-stage time (on CPU or blocked) that fits in the GPU's
    /// idle gap before the request's work.
    pub cpu_min_stage_ns: u64,
    /// `network` fires when the first token took at least this long beyond one smoothed
    /// round trip to be acknowledged by the client (ACK time − send − SRTT), with a
    /// retransmit on the connection meanwhile. 100 ms: loss repaired by a timeout costs at
    /// least Linux's 200 ms minimum RTO, and a fast retransmit on a path slow enough to
    /// matter costs a round trip or more; a delayed ACK alone (40 ms minimum) stays below.
    /// Half of `slow_ttft_ns` where that is less: a tail loss probe repairs a lost last
    /// segment in a few round trips (66 ms on a loaded loopback here), which an SLO of
    /// 100 ms counts (a client at 121 ms, 66 of them waiting for the retransmit, was left
    /// without a cause).
    pub network_min_delivery_ns: u64,
    /// `gpu_memory` fires when NVML memory used reaches this share of total. 0.95, not 0.9:
    /// engines that pre-allocate the KV cache sit at 0.90-0.93 by design (vLLM's default
    /// `gpu_memory_utilization` is 0.9), so 0.9 would mark every request.
    pub gpu_memory_share: f64,
    /// ... or when large host<->device copies in the window add up to this many bytes
    /// (KV-cache swap traffic). 256 MiB: a few dozen KV blocks of a 7B-70B model.
    pub swap_min_bytes: u64,
    /// `cold_start` also fires when the GPU process started less than this long before the
    /// request arrived (warm-up: allocator growth, autotuning, graph capture, JIT). 0, off,
    /// by default: a server started a minute ago serves warm requests after its first few,
    /// and the first work and the weight loading below are seen directly.
    pub cold_start_window_ns: u64,
    /// `cold_start` fires when host-to-device copies of at least this many bytes run in the
    /// window while device-to-host traffic stays under a quarter of them: weights being
    /// loaded (a swap moves both ways). 1 GiB: more than any KV-cache swap-in of one step.
    pub load_min_bytes: u64,
    /// A stall after the first token is `prefill_interference` when other requests'
    /// prefills (the GPU episodes of their first tokens) cover at least this share of it. 0.5:
    /// a prefill that ran through most of the gap held the step that would have sent the
    /// next chunk; one that overlapped its edge did not.
    pub stall_prefill_min_share: f64,
}

impl CauseConfig {
    /// The delay `network` needs: `network_min_delivery_ns`, or half the SLO where that is
    /// less (a tail loss repaired by the probe, RACK-TLP, costs a few round trips, tens of
    /// ms, not the 200 ms RTO, which a tight SLO counts).
    pub fn network_min_ns(&self) -> u64 {
        self.network_min_delivery_ns.min(self.slow_ttft_ns / 2)
    }
}

impl Default for CauseConfig {
    fn default() -> Self {
        Self {
            slow_ttft_ns: 350 * MS,
            queueing_min_ns: 2 * S,
            queueing_min_busy_share: 0.5,
            batching_min_idle_ns: 100 * MS,
            batching_max_cpu_share: 0.5,
            batching_min_gpu_blocked_share: 0.5,
            cpu_min_runq_ns: 50 * MS,
            cpu_min_stage_ns: 100 * MS,
            network_min_delivery_ns: 100 * MS,
            gpu_memory_share: 0.95,
            swap_min_bytes: 256 * MIB,
            cold_start_window_ns: 0,
            load_min_bytes: 1024 * MIB,
            stall_prefill_min_share: 0.5,
        }
    }
}
