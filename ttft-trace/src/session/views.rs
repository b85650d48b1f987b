//! What the sinks are shown of routing's workloads and tracking's changes
//! (see `export::view`): built here, where both halves meet.

use crate::{
    export::{KernelView, LibraryView, WorkloadView},
    probes::Attached,
    routing::Workload,
    tracking::KernelStats,
};

/// A workload as the sinks see it: its root and labels, not its
/// correlator or signals.
pub(super) fn workload_view(w: &Workload) -> WorkloadView<'_> {
    WorkloadView {
        root: w.root,
        labels: &w.labels,
        values: &w.values,
    }
}

pub(super) fn library_view(a: &Attached) -> LibraryView<'_> {
    LibraryView {
        path: &a.path,
        apis: a.apis.iter().map(|x| x.name()).collect(),
        symbols: a.symbols,
        failed: &a.failed,
        attach_ms: a.attach_ms,
    }
}

pub(super) fn kernel_view(k: &KernelStats) -> KernelView<'_> {
    KernelView {
        sched: &k.sched,
        runq_buckets: &k.runq_buckets,
        runq_sum_ns: k.runq_sum_ns,
        events_lost: k.events_lost,
        segments_unseen: k.segments_unseen,
        thread_state_dropped: k.thread_state_dropped,
        h2_frames_dropped: k.h2_frames_dropped,
        h2_walk_lost: k.h2_walk_lost,
        tls_unbound: k.tls_unbound,
        tls_held: k.tls_held,
        tls_held_sent: k.tls_held_sent,
        map_full: &k.map_full,
        quota_exceeded: &k.quota_exceeded,
        listeners_followed: k.listeners_followed,
    }
}
