//! The lines around the requests: GPU episodes, libraries probed, and the
//! totals that end a run. The fields of `attach`, `detach` and `totals`
//! lines are declared in alphabetical order, the order in which they have
//! always been written (from a sorted JSON map): the file stays the same
//! byte for byte.

use std::{collections::BTreeMap, path::PathBuf};

use serde::{Deserialize, Serialize};

/// An episode line as read back (`episodes::EpisodeRecord` writes it).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Episode {
    pub pid: u32,
    pub tid: u32,
    /// `runtime`, `driver` or `runtime+driver`.
    pub api: String,
    pub stream: String,
    #[serde(default)]
    pub copy_stream: String,
    pub kernel_launches: u32,
    pub graph_launches: u32,
    pub t_first_launch_ns: u64,
    pub t_copy_enqueue_ns: u64,
    pub t_copy_done_ns: u64,
    pub launch_to_first_d2h_ns: u64,
    pub copy_bytes: u64,
    /// What completed the copy (`sync_copy`, `stream_sync`, ...).
    pub completion: String,
    /// Return value of the completing call (0 = success).
    pub status: i32,
}

/// A library whose probes were attached.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Attach {
    /// The CUDA APIs probed in it (`runtime`, `driver`).
    pub apis: Vec<String>,
    /// How long creating the uprobes took.
    pub attach_ms: f64,
    /// Symbols whose probe failed (the log names them).
    pub failed: usize,
    pub library: PathBuf,
    /// Symbols probed.
    pub symbols: usize,
    pub t_ns: u64,
    /// [`super::kind::ATTACH`].
    #[serde(rename = "type")]
    pub kind: String,
}

/// A library whose probes were removed (no traced process maps it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Detach {
    pub library: PathBuf,
    pub symbols: usize,
    pub t_ns: u64,
    /// [`super::kind::DETACH`].
    #[serde(rename = "type")]
    pub kind: String,
}

/// The last line of a run: what the kernel counted over all of it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Totals {
    pub episodes_failed: u64,
    pub episodes_ok: u64,
    /// Ring-buffer records the kernel could not send.
    pub events_lost: u64,
    pub graph_launches: u64,
    pub kernel_launches: u64,
    /// Bytes and calls per copy direction (`h2d`, `d2h`, ...).
    pub memcpy_bytes: BTreeMap<String, u64>,
    pub memcpy_calls: BTreeMap<String, u64>,
    /// Each workload's request correlator statistics.
    pub request_stats: Vec<WorkloadStats>,
    pub requests: u64,
    /// Why tracing stopped (`Duration`, `Signal`, `TargetExited`).
    pub stop: String,
    pub t_ns: u64,
    /// [`super::kind::TOTALS`].
    #[serde(rename = "type")]
    pub kind: String,
    /// Events of no known workload.
    pub unrouted_events: u64,
}

/// One workload's request statistics (`requests::CorrelatorStats`, by
/// name).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkloadStats {
    pub stats: BTreeMap<String, u64>,
    pub workload_pid: u32,
}

/// A workload the tracer started to follow, and how it is named: its
/// labels (from the host: the cgroup path and the kubelet's records of its
/// pod UID), and beside them what its processes claim of their pod, with
/// the verdict on that claim. Fields in the order written.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkloadLine {
    /// [`super::kind::WORKLOAD`].
    #[serde(rename = "type")]
    pub kind: String,
    pub t_ns: u64,
    pub workload_pid: u32,
    /// The labels its series carry (the overflow set past the cap).
    pub workload: super::Workload,
    /// The pod UID in its cgroup path; null outside a pod.
    pub pod_uid: Option<String>,
    /// `POD_NAME`, else the container's `/etc/hostname`; null when neither
    /// names a pod.
    pub claimed_pod: Option<String>,
    /// `POD_NAMESPACE`, else the service account's namespace file.
    pub claimed_namespace: Option<String>,
    /// `matches`, `differs` (rejected, counted in
    /// `ttft_trace_label_claims_rejected_total`) or `unverified` (the host
    /// has no record of the UID); null when nothing is claimed.
    pub claim_verdict: Option<String>,
}
