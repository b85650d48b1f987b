//! What the sinks are shown: a workload's name and labels, a library's
//! probes, the kernel's host-wide readings. The session builds these from
//! routing's workloads and tracking's changes, so that export reaches no
//! correlator, signal store or probe: it sees only what it exports.

use std::path::Path;

use ttft_trace_common::signals::SchedTotals;

use crate::workloads::WorkloadLabels;

/// A workload as its series and lines name it.
#[derive(Debug, Clone, Copy)]
pub struct WorkloadView<'a> {
    /// The root process: the workload's id (`workload_pid`).
    pub root: u32,
    /// The labels its series carry (possibly the overflow set).
    pub labels: &'a WorkloadLabels,
    /// `labels.values()`, computed once per workload for the metric calls.
    pub values: &'a [String],
}

impl WorkloadView<'_> {
    /// Label values as the metrics take them.
    pub fn label_values(&self) -> Vec<&str> {
        self.values.iter().map(String::as_str).collect()
    }
}

/// A library whose probes were attached or detached.
#[derive(Debug, Clone)]
pub struct LibraryView<'a> {
    pub path: &'a Path,
    /// The CUDA APIs probed in it (`runtime`, `driver`).
    pub apis: Vec<&'static str>,
    /// Symbols probed.
    pub symbols: usize,
    /// Symbols whose attach failed, with the reason.
    pub failed: &'a [(String, String)],
    /// How long creating the uprobes took.
    pub attach_ms: f64,
}

/// The kernel's host-wide readings, for their series.
#[derive(Debug, Clone, Copy)]
pub struct KernelView<'a> {
    /// Scheduler totals of every traced process, exited ones included.
    pub sched: &'a SchedTotals,
    /// The run-queue delay histogram (log2 buckets) and its sum.
    pub runq_buckets: &'a [u64],
    pub runq_sum_ns: u64,
    pub events_lost: u64,
    /// Followed connections read with none of their segments seen.
    pub segments_unseen: u64,
    pub thread_state_dropped: u64,
    /// HTTP/2 frames walked but not summarised, and walks that lost their
    /// place (`ttft_trace_common::Stat`).
    pub h2_frames_dropped: u64,
    pub h2_walk_lost: u64,
    /// `SSL_write` calls whose plaintext no followed send carried.
    pub tls_unbound: u64,
    /// `SSL_write` calls whose records went to a memory BIO, and of them
    /// the ones matched to a send.
    pub tls_held: u64,
    pub tls_held_sent: u64,
    /// Inserts refused by a full kernel map, per map.
    pub map_full: &'a [(&'static str, u64)],
    /// What tenants were refused past their share, per resource.
    pub quota_exceeded: &'a [(&'static str, u64)],
    /// Listening pairs followed in the kernel at the last scan.
    pub listeners_followed: usize,
}
