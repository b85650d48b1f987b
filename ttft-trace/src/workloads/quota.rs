//! Host capacity shared by quota: one tenant (a pod, else a cgroup) may
//! hold at most a configured share of a host-wide resource (label sets,
//! followed listening sockets, tracked threads, sampled threads). Past its share that
//! tenant alone is degraded: what it asks for beyond is refused or taken
//! back, counted in `ttft_trace_quota_exceeded_total{resource}`, and
//! warned about once while it stays past its share. One [`Quota`] serves
//! every resource; each resource decides what a unit is and what refusing
//! it means.

use std::{collections::BTreeSet, fmt};

use crate::host::cgroups;

/// A host-wide resource shared by quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// Workload label sets (per pod).
    LabelSets,
    /// (network namespace, port) pairs followed (`LISTEN_NETNS`).
    Listeners,
    /// Entries of `TRACKED` (a traced process's threads and children).
    Threads,
    /// Threads sampled for `--sched sampled` (one open file each).
    SampledThreads,
    /// Attribute sets of the OTLP GenAI metrics (a cumulative histogram
    /// each in the SDK).
    OtlpAttributeSets,
    /// Threads left stuck in a read of its files (a stalled FUSE or NFS
    /// mount), of the few the library scan may leave so.
    StuckReads,
}

impl Resource {
    /// The `resource` label of `ttft_trace_quota_exceeded_total`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::LabelSets => "label_sets",
            Self::Listeners => "listeners",
            Self::Threads => "threads",
            Self::SampledThreads => "sampled_threads",
            Self::OtlpAttributeSets => "otlp_attribute_sets",
            Self::StuckReads => "stuck_reads",
        }
    }

    /// What a tenant past its share loses, for the warning and `check`.
    pub const fn consequence(self) -> &'static str {
        match self {
            Self::LabelSets => "its later workloads are reported under its own comm=\"_other\" set",
            Self::Listeners => "its further listening sockets are not followed",
            Self::Threads => {
                "its new child processes are not traced (its threads still are); \
                 its thread ids past it are dropped from the kernel's map"
            }
            Self::SampledThreads => {
                "its other threads are not sampled (no scheduler spells of theirs)"
            }
            Self::OtlpAttributeSets => {
                "its requests on new attribute sets are recorded in its own \
                 ttft_trace.workload.comm=\"_other\" set of the OTLP metrics"
            }
            Self::StuckReads => {
                "its processes' files are not read until one of its reads returns \
                 (its new workloads and libraries are not found meanwhile)"
            }
        }
    }
}

/// Who a share is counted for: the pod (its UID in the cgroup path, which
/// the kubelet writes), else the cgroup.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tenant {
    Pod(String),
    Cgroup(String),
}

impl Tenant {
    /// The tenant of `pid`; None when its cgroup cannot be read (it exited).
    pub fn of_process(pid: u32) -> Option<Self> {
        let path = cgroups::cgroup_path(pid)?;
        Some(match cgroups::pod_uid(&path) {
            Some(uid) => Self::Pod(uid),
            None => Self::Cgroup(path),
        })
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pod(uid) => write!(f, "pod {uid}"),
            Self::Cgroup(path) => write!(f, "cgroup {path}"),
        }
    }
}

/// One resource's quota: each tenant's share, what was refused past it.
#[derive(Debug)]
pub struct Quota<T> {
    resource: Resource,
    share: usize,
    /// Tenants past their share: warned about once while they stay so.
    over: BTreeSet<T>,
    /// Units refused or taken back since the start.
    pub exceeded: u64,
}

impl<T: Ord + Clone + fmt::Display> Quota<T> {
    pub fn new(resource: Resource, share: usize) -> Self {
        Self {
            resource,
            share,
            over: BTreeSet::new(),
            exceeded: 0,
        }
    }

    pub fn share(&self) -> usize {
        self.share
    }

    pub fn resource(&self) -> Resource {
        self.resource
    }

    /// Whether `tenant`, holding `held` units, may take one more; a
    /// refusal is counted.
    pub fn admit(&mut self, tenant: &T, held: usize) -> bool {
        if held < self.share {
            return true;
        }
        self.refuse(tenant, 1);
        false
    }

    /// `n` units of `tenant` refused or taken back: counted; the tenant is
    /// warned about the first time (again once it was settled under its
    /// share, see [`Quota::settle`]).
    pub fn refuse(&mut self, tenant: &T, n: u64) {
        self.exceeded += n;
        if self.over.insert(tenant.clone()) {
            log::warn!(
                "{tenant} has its share of {} {}: {} \
                 (ttft_trace_quota_exceeded_total{{resource=\"{}\"}})",
                self.share,
                self.resource.name().replace('_', " "),
                self.resource.consequence(),
                self.resource.name()
            );
        }
    }

    /// How many of `held` units are past the share: what a tenant holding
    /// them would be refused.
    pub fn past(&self, held: usize) -> usize {
        held.saturating_sub(self.share)
    }

    /// Splits `units`, one tenant's in order of preference, into those
    /// within its share, of which it holds `held` already, and those past
    /// it (not counted here: the caller knows which are new).
    pub fn split<U>(&self, held: usize, mut units: Vec<U>) -> (Vec<U>, Vec<U>) {
        let past = self.past(held + units.len()).min(units.len());
        let past = units.split_off(units.len() - past);
        (units, past)
    }

    /// Keeps the tenants still past their share (`still_over`): the others
    /// are warned about again if they pass it later. Bounds the set by the
    /// tenants that exist.
    pub fn settle(&mut self, still_over: impl Fn(&T) -> bool) {
        self.over.retain(|t| still_over(t));
    }

    /// Whether `tenant` was past its share (warned about, not settled).
    pub fn is_over(&self, tenant: &T) -> bool {
        self.over.contains(tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_its_share_a_tenant_is_refused_counted_and_settled() {
        let mut q: Quota<String> = Quota::new(Resource::Listeners, 2);
        let (a, b) = ("a".to_string(), "b".to_string());
        assert!(q.admit(&a, 0) && q.admit(&a, 1));
        assert!(!q.admit(&a, 2));
        assert!(q.admit(&b, 1), "another tenant is untouched");
        q.refuse(&a, 3);
        assert_eq!(q.exceeded, 4);
        assert!(q.is_over(&a) && !q.is_over(&b));
        q.settle(|_| false);
        assert!(!q.is_over(&a));
        let (kept, past) = q.split(0, vec![1, 2, 3, 4]);
        assert_eq!((kept, past), (vec![1, 2], vec![3, 4]));
        assert_eq!(q.split(0, vec![1]), (vec![1], vec![]));
        assert_eq!(q.split(1, vec![1, 2]), (vec![1], vec![2]));
        assert_eq!(q.split(3, vec![1]), (vec![], vec![1]));
        assert_eq!((q.past(1), q.past(2), q.past(5)), (0, 0, 3));
    }

    #[test]
    fn a_tenant_is_its_pod_else_its_cgroup() {
        let own = Tenant::of_process(std::process::id()).expect("own cgroup");
        assert!(matches!(own, Tenant::Cgroup(_) | Tenant::Pod(_)), "{own}");
        assert_eq!(Tenant::Pod("u".into()).to_string(), "pod u");
    }
}
