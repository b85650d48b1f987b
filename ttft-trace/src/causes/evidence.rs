//! What the rules read about one request: its timeline (from the [`RequestRecord`]) and the
//! kernel's and NVML's signals over it. Filled by the session, judged by [`super::attribute`].
//!
//! Windows, with `t_gpu_start = t_arrive + queue` and `t_first_token = t_arrive + TTFT`:
//! *TTFT window* `[t_arrive, t_first_token]`, *queue window* `[t_arrive, t_gpu_start]`,
//! *request window* `[t_arrive, t_done]`, *delivery window* `[t_arrive, max(t_first_token,
//! t_first_token_acked)]` (to `t_first_token_unacked` when the ACK never came). A signal is the part of it that overlaps its window.

use serde::Serialize;

use crate::nvml::WindowReadings;

use crate::requests::{Figure, RequestRecord};

/// Retransmit times kept per request (the earliest ones; later ones are only counted).
pub const RETRANSMIT_TIMES_CAP: usize = 64;

/// The request's own figures, as the rules need them. Build with `From<&RequestRecord>`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestTimes {
    pub t_arrive_ns: u64,
    /// `None` when the request has no TTFT that counts (no first token, or an outcome whose
    /// TTFT enters no histogram: error status, pipelined, evicted): such a request is not judged.
    pub ttft_ns: Option<u64>,
    /// Breakdown of TTFT; `None` without a joined GPU episode.
    pub queue_ns: Option<u64>,
    pub gpu_ns: Option<u64>,
    /// Episodes completed in the TTFT window, the request's own included.
    pub gpu_steps_waited: Option<u32>,
    /// Time of the queue window covered by no episode.
    pub gpu_idle_before_start_ns: Option<u64>,
    /// When the client acknowledged the first token, and the socket's smoothed RTT then;
    /// `None` when not seen.
    pub t_first_token_acked_ns: Option<u64>,
    /// When the wait for that ACK ended with the first token unacknowledged.
    pub t_first_token_unacked_ns: Option<u64>,
    pub srtt_ns: Option<u64>,
    /// The client's TTFT as the socket sees it (request segment in to first token acked).
    pub client_ttft_estimate_ns: Option<u64>,
    /// Set when the first token's ACK is known only from the state change after the
    /// server's close that says everything sent was acknowledged (note
    /// `first_token_acked_by_close`): the ACK came after the close (every ACK before it was
    /// seen), which the response's last send, this time, precedes; `t_first_token_acked_ns`
    /// is then only an upper bound.
    pub acked_after_ns: Option<u64>,
}

impl From<&RequestRecord> for RequestTimes {
    fn from(r: &RequestRecord) -> Self {
        // Judge exactly the TTFT the histograms count.
        let ttft_ns = r
            .observations()
            .find(|&(f, _)| f == Figure::Ttft)
            .map(|(_, ns)| ns);
        Self {
            t_arrive_ns: r.t_arrive_ns,
            ttft_ns,
            queue_ns: r.queue_ns,
            gpu_ns: r.gpu_ns,
            gpu_steps_waited: r.gpu_steps_waited,
            gpu_idle_before_start_ns: r.gpu_idle_before_start_ns,
            t_first_token_acked_ns: r.t_first_token_acked_ns,
            t_first_token_unacked_ns: r.t_first_token_unacked_ns,
            srtt_ns: r.srtt_ns,
            client_ttft_estimate_ns: r.client_ttft_estimate_ns,
            acked_after_ns: r
                .notes
                .contains(&"first_token_acked_by_close")
                .then(|| r.t_done_ns.or(r.t_first_token_ns))
                .flatten(),
        }
    }
}

impl RequestTimes {
    /// End of the queue window, when the request's GPU work is known.
    pub fn t_gpu_start_ns(&self) -> Option<u64> {
        self.queue_ns.map(|q| self.t_arrive_ns + q)
    }

    /// The first token's ACK as far as it is known under `retransmits` on the connection:
    /// its time, and the client TTFT estimate. An ACK known only by the close
    /// (`acked_after_ns`) is exact when nothing was retransmitted (the whole response went
    /// through at once); after retransmits it may be timeouts later than the client's (the
    /// response's tail lost after the client had the first token: issue 34), and only the
    /// close is certain: the ACK and the estimate then count from there.
    pub fn ack_for_judging(&self, retransmits: u32) -> Option<(u64, u64)> {
        let acked = self.t_first_token_acked_ns?;
        let estimate = self.client_ttft_estimate_ns?;
        match self.acked_after_ns {
            Some(after) if retransmits > 0 && after < acked => {
                Some((after, estimate.saturating_sub(acked - after)))
            }
            _ => Some((acked, estimate)),
        }
    }

    /// End of the delivery window: the first token's ACK, or the end of the wait for it
    /// when it never came, or the first token when the ACK was not seen (or, ACKed within its
    /// own send, stamped a little before its return).
    pub fn t_delivered_ns(&self) -> Option<u64> {
        let ft = self.t_arrive_ns.saturating_add(self.ttft_ns?);
        let end = self
            .t_first_token_acked_ns
            .or(self.t_first_token_unacked_ns);
        Some(end.map_or(ft, |a| a.max(ft)))
    }
}

/// Signals over one request. Times are CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`); durations
/// are ns clipped to their window. "The tree" is the traced process tree; "GPU threads" are
/// the threads that issued kernel launches (the `tid` of episodes), the others are "CPU-stage
/// threads". A signal that was not traced stays at its `Default` (0, `None`, `false`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Evidence {
    /// The record's figures (already in the JSONL line, so not serialised again).
    #[serde(skip)]
    pub request: RequestTimes,
    /// Run-queue delay (woken or preempted, runnable, not running) of every thread of the
    /// tree in the TTFT window, summed over threads.
    pub runq_ns: u64,
    /// The longest single run-queue wait among those.
    pub runq_max_ns: u64,
    /// On-CPU time of the CPU-stage threads in the queue window, summed over threads.
    pub cpu_stage_oncpu_ns: u64,
    /// Off-CPU time of the CPU-stage threads in the queue window while *blocked* (sleeping,
    /// on a lock or I/O; not runnable), summed over threads.
    pub cpu_stage_blocked_ns: u64,
    /// The largest CPU-stage time of any *one* such thread in the queue window (its on-CPU
    /// time plus its blocked spells that ended in the window): a single stage that stalled
    /// (a tokenizer spinning or sleeping), told apart from many threads each doing a little
    /// of other requests' work.
    pub cpu_stage_thread_max_ns: u64,
    /// Blocked off-CPU time in the queue window of the GPU thread that blocked longest
    /// (the maximum over GPU threads, not their sum).
    pub gpu_thread_blocked_ns: u64,
    /// `tcp:tcp_retransmit_skb` on the request's own socket in the delivery window (arrival
    /// to the client's ACK of the first token).
    pub retransmits: u32,
    /// Their times, ascending, the earliest [`RETRANSMIT_TIMES_CAP`] only; fill with
    /// [`Evidence::add_retransmit`].
    pub retransmit_times_ns: Vec<u64>,
    /// `tcp:tcp_receive_reset` plus `tcp:tcp_send_reset` on the socket, same window.
    pub resets: u32,
    /// Copy calls of at least 1 MiB, host to device or device to host, by the tree's
    /// processes, entered in the TTFT window.
    pub large_copies: u32,
    /// Bytes of those copies, and the part host to device / device to host
    /// (loading weights is one way; swapping goes both ways).
    pub large_copy_bytes: u64,
    pub large_copy_h2d_bytes: u64,
    pub large_copy_d2h_bytes: u64,
    /// First to last entry of the large copies entered in the *queue* window (0 for fewer
    /// than two): swap traffic that held the request before its GPU work began.
    pub large_copy_queue_span_ns: u64,
    /// NVML readings of the request's GPU(s) over the TTFT window; `None` without NVML.
    pub gpu: Option<WindowReadings>,
    /// The process of the request's episode had its first-ever GPU episode in the TTFT
    /// window. Only for a process seen from its exec on: for one already running when
    /// tracing began, its first traced episode is not its first, so leave this false.
    pub first_gpu_work_in_window: bool,
    /// `t_arrive` minus the start (exec) of that process; `None` when unknown.
    pub gpu_process_age_ns: Option<u64>,
}

impl Evidence {
    /// Evidence with the request's figures and no signal yet.
    pub fn new(request: RequestTimes) -> Self {
        Self {
            request,
            ..Self::default()
        }
    }

    /// Counts a retransmit on the request's socket, keeping its time while there is room.
    /// Calls may come in any order; the kept times stay sorted.
    pub fn add_retransmit(&mut self, t_ns: u64) {
        self.retransmits = self.retransmits.saturating_add(1);
        let at = self.retransmit_times_ns.partition_point(|&t| t <= t_ns);
        if self.retransmit_times_ns.len() < RETRANSMIT_TIMES_CAP {
            self.retransmit_times_ns.insert(at, t_ns);
        } else if at < RETRANSMIT_TIMES_CAP {
            // Earlier than a kept one: it matters more than the latest kept.
            self.retransmit_times_ns.pop();
            self.retransmit_times_ns.insert(at, t_ns);
        }
    }
}
