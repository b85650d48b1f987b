//! Every Prometheus series the session writes. The per-workload families
//! (episodes and CUDA counters, requests, causes) are created, observed and
//! retired together here, under label sets capped by [`LabelSets`]; the
//! host-wide ones (scheduler, TCP, kernel statistics) beside them.

use std::{path::PathBuf, time::Duration};

use prometheus::{IntCounter, Registry};
use ttft_trace_common::GpuCounters;

use super::prometheus::{
    CauseMetrics, Metrics, MetricsError, RequestMetrics, SignalMetrics, StallMetrics,
};
use super::view::KernelView;
use crate::{
    episodes::EpisodeRecord,
    host::{
        deadline::TargetWork,
        kubelet::{DEFAULT_POD_LOG_DIR, PodRecords},
    },
    judging::JudgedRequest,
    probes::libraries::ReadStats,
    workloads::{ClaimVerdict, LabelSets, Naming, ProcessSeen, WorkloadLabels},
};

/// How workloads are named in the metrics.
#[derive(Debug, Clone)]
pub struct LabelConfig {
    /// Add a `pid` label (the workload root's).
    pub with_pid: bool,
    /// Most label sets; later workloads share the overflow set.
    pub max_sets: usize,
    /// Most of one pod's own; its later workloads share its overflow set.
    pub max_sets_per_pod: usize,
    /// Series of a workload gone this long are removed.
    pub retire_after: Duration,
    /// The kubelet's pod log directory, whose entries name the pods (by
    /// UID) on this host.
    pub pod_log_dir: PathBuf,
}

impl Default for LabelConfig {
    fn default() -> Self {
        Self {
            with_pid: false,
            max_sets: 100,
            max_sets_per_pod: 25,
            retire_after: Duration::from_secs(300),
            pod_log_dir: PathBuf::from(DEFAULT_POD_LOG_DIR),
        }
    }
}

pub struct Series {
    core: Metrics,
    requests: RequestMetrics,
    causes: CauseMetrics,
    stalls: StallMetrics,
    signals: SignalMetrics,
    label_sets: LabelSets,
    with_pid: bool,
    /// The host's records of pod names, by UID.
    pods: PodRecords,
    /// Pod claims a workload made that the host's record contradicts.
    claims_rejected: IntCounter,
    /// Reads of the claims (inside the target's root) off the loop.
    claims: TargetWork,
}

/// A read of a workload's claimed pod that makes no progress this long is
/// abandoned (its claim then unverified); past this many such reads stuck,
/// claims are not read.
const CLAIM_READ_STALL: Duration = Duration::from_millis(500);
const CLAIM_READS_STUCK_MAX: usize = 2;

impl Series {
    pub fn new(labels: &LabelConfig) -> Result<Self, MetricsError> {
        let names = WorkloadLabels::names(labels.with_pid);
        let core = Metrics::new(&names)?;
        let claims_rejected = IntCounter::new(
            "ttft_trace_label_claims_rejected_total",
            "Workloads whose processes claim a pod name or namespace (downward-API variables, \
             files in their root) other than the host's record of their pod UID; the host's \
             names are the labels",
        )?;
        core.registry.register(Box::new(claims_rejected.clone()))?;
        Ok(Self {
            requests: RequestMetrics::new(&core.registry, &names)?,
            causes: CauseMetrics::new(&core.registry, &names)?,
            stalls: StallMetrics::new(&core.registry, &names)?,
            signals: SignalMetrics::new(&core.registry)?,
            core,
            label_sets: LabelSets::new(
                labels.max_sets,
                labels.max_sets_per_pod,
                u64::try_from(labels.retire_after.as_nanos()).unwrap_or(u64::MAX),
                labels.with_pid,
            ),
            with_pid: labels.with_pid,
            pods: PodRecords::new(&labels.pod_log_dir),
            claims_rejected,
            claims: TargetWork::new(CLAIM_READ_STALL, CLAIM_READS_STUCK_MAX),
        })
    }

    pub fn registry(&self) -> &Registry {
        &self.core.registry
    }

    /// The naming of a new workload rooted at `root`: its label set (its
    /// own, or the overflow set past the cap), with every series created at
    /// zero so that rate() works from the first scrape; a claim the host's
    /// record contradicts is counted.
    pub fn admit(&mut self, root: u32, seen: &ProcessSeen) -> Naming {
        let mut naming =
            WorkloadLabels::of_process(root, seen, self.with_pid, &mut self.pods, &mut self.claims);
        self.evictions("pod_log_dir_entries", self.pods.entries_dropped);
        self.evictions("pod_records", self.pods.records_dropped);
        if naming.verdict == Some(ClaimVerdict::Differs) {
            self.claims_rejected.inc();
        }
        naming.labels = self.label_sets.admit(naming.labels);
        let values = naming.labels.values();
        let w: Vec<&str> = values.iter().map(String::as_str).collect();
        self.core.init_workload(&w);
        self.requests.init_workload(&w);
        self.causes.init_workload(&w);
        self.stalls.init_workload(&w);
        naming
    }

    /// A workload using `labels` ended at `now_ns`: its series stay for
    /// the grace period.
    pub fn release(&mut self, labels: &WorkloadLabels, now_ns: u64) {
        self.label_sets.release(labels, now_ns);
    }

    /// Removes the series of label sets unused past the grace period.
    /// Every series and the workloads gauge are updated before the log line
    /// says so (a scrape prompted by the line sees the change).
    /// Returns the label sets retired.
    pub fn retire(&mut self, now_ns: u64) -> Vec<WorkloadLabels> {
        let retired = self.label_sets.retire(now_ns);
        for labels in &retired {
            let values = labels.values();
            let w: Vec<&str> = values.iter().map(String::as_str).collect();
            self.core.retire_workload(&w);
            self.requests.retire_workload(&w);
            self.causes.retire_workload(&w);
            self.stalls.retire_workload(&w);
        }
        self.core
            .set_workloads(self.label_sets.len(), self.label_sets.overflowed);
        let per_pod = &self.label_sets.per_pod;
        self.core
            .set_quota_exceeded(per_pod.resource().name(), per_pod.exceeded);
        for labels in &retired {
            log::info!("retired the series of workload {}", labels.comm);
        }
        retired
    }

    pub fn episode(&self, w: &[&str], rec: &EpisodeRecord) {
        self.core.observe_episode(rec, w);
    }

    pub fn request(&self, w: &[&str], judged: &JudgedRequest) {
        self.requests.observe(&judged.record, w);
        self.causes.observe(&judged.attribution, w);
        self.stalls.observe(&judged.stalls, w);
    }

    pub fn counters(&self, w: &[&str], delta: &GpuCounters) {
        self.core.add_counters(delta, w);
    }

    pub fn tcp_event(&self, what: u32) {
        self.signals.tcp_event(what);
    }

    /// The kernel's host-wide readings.
    pub fn kernel(&self, k: &KernelView) {
        self.signals.set_sched_totals(k.sched);
        self.signals
            .runq
            .set(k.runq_buckets.to_vec(), k.runq_sum_ns);
        self.core
            .set_kernel_stats(k.events_lost, k.segments_unseen, k.thread_state_dropped);
        self.core
            .set_protocol_stats(k.h2_frames_dropped, k.h2_walk_lost);
        self.core
            .set_tls_stats(k.tls_unbound, k.tls_held, k.tls_held_sent);
        for (map, total) in k.map_full {
            self.core.set_map_full(map, *total);
        }
        self.core.set_listeners_followed(k.listeners_followed);
        for (resource, total) in k.quota_exceeded {
            self.core.set_quota_exceeded(resource, *total);
        }
    }

    /// Sets the total refused past the shares of `resource`.
    pub fn quota_exceeded(&self, resource: &str, total: u64) {
        self.core.set_quota_exceeded(resource, total);
    }

    /// Sets the eviction total of a bounded table.
    pub fn evictions(&self, table: &str, total: u64) {
        self.core.set_evictions(table, total);
    }

    /// The entries a per-target table holds now
    /// (`ttft_trace_table_entries{table}`).
    pub fn entries(&self, table: &str, n: usize) {
        self.core.set_table_entries(table, n);
    }

    /// The library scan's given-up reads, and the claims'.
    pub fn target_reads(&self, reads: &ReadStats) {
        let mut all = *reads;
        all.work.add(self.claims.stats());
        self.core.set_target_reads(&all);
    }

    pub fn traced(&self, processes: usize, runtime_libs: usize, driver_libs: usize) {
        self.core.set_traced(processes, runtime_libs, driver_libs);
    }

    pub fn events_lost(&self) -> u64 {
        self.core.events_lost()
    }
}
