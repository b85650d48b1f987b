//! The labels that name a workload in the metrics, and the bounded set of
//! them: a cap on how many label sets exist (the rest share one overflow
//! set, counted), and retirement of sets whose processes are all gone.

use std::{collections::BTreeMap, time::Instant};

use serde::Serialize;

use super::quota::{Quota, Resource};
use crate::host::{
    cgroups,
    deadline::TargetWork,
    kubelet::{PodName, PodRecords},
};

/// Label names of every per-workload series, in order; `pid` is appended
/// when asked for.
pub const LABEL_NAMES: [&str; 4] = ["comm", "container", "pod", "namespace"];
/// The `comm` of the overflow label set.
pub const OVERFLOW_COMM: &str = "_other";
/// The kernel keeps 15 bytes of a command name; more is not one.
const COMM_MAX: usize = 15;

/// A command name as a label: the process sets it (`prctl`), so control
/// characters and non-ASCII bytes are replaced by `?` and it is cut at the
/// kernel's 15 bytes.
pub fn clean_comm(comm: &str) -> String {
    comm.chars()
        .take(COMM_MAX)
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .collect()
}

/// What was read of a workload's root when it was found, alive: its labels
/// are named from it when the root has exited by the time they are (a
/// short-lived pod, a loaded host), so that its pod is still its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessSeen {
    pub cgroup: Option<String>,
    pub comm: Option<String>,
}

impl ProcessSeen {
    pub fn read(pid: u32) -> Self {
        Self {
            cgroup: cgroups::cgroup_path(pid),
            comm: crate::host::targets::comm(pid),
        }
    }
}

/// What names a workload. Empty values are absent labels to Prometheus.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct WorkloadLabels {
    pub comm: String,
    pub container: String,
    pub pod: String,
    pub namespace: String,
    /// Only with `--label-pid`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

impl WorkloadLabels {
    /// The labels of the workload rooted at `pid`: its command name and,
    /// from its cgroup, container id and pod UID; the pod's namespace and
    /// name are those the host records for that UID (`pods`), else the pod
    /// label is the UID and the namespace empty. What the process claims of
    /// its pod is read (inside a pod only) and judged against the host's
    /// record, never used as a label. What the root has exited since it was
    /// `seen` is named from that.
    pub fn of_process(
        pid: u32,
        seen: &ProcessSeen,
        with_pid: bool,
        pods: &mut PodRecords,
        claims: &mut TargetWork,
    ) -> Naming {
        let path = cgroups::cgroup_path(pid)
            .or_else(|| seen.cgroup.clone())
            .unwrap_or_default();
        let pod_uid = cgroups::pod_uid(&path);
        let host = pod_uid
            .as_deref()
            .and_then(|uid| pods.lookup(uid, Instant::now()));
        let claim = match pod_uid {
            // The claim is read inside the target's root, which may be
            // a mount whose reads never return: off this thread.
            Some(_) => match claims.run(move || cgroups::pod_claim(pid)) {
                Ok((pod, namespace)) => PodClaim { pod, namespace },
                Err(e) => {
                    log::warn!("process {pid}: its claimed pod not read: {e}");
                    PodClaim::default()
                }
            },
            None => PodClaim::default(),
        };
        let verdict = claim.verdict(host.as_ref());
        let (pod, namespace) = match (&host, &pod_uid) {
            (Some(h), _) => (h.name.clone(), h.namespace.clone()),
            (None, Some(uid)) => (uid.clone(), String::new()),
            (None, None) => Default::default(),
        };
        Naming {
            labels: Self {
                comm: clean_comm(
                    &crate::host::targets::comm(pid)
                        .or_else(|| seen.comm.clone())
                        .unwrap_or_default(),
                ),
                container: cgroups::container_id(&path).unwrap_or_default(),
                pod,
                namespace,
                pid: with_pid.then_some(pid),
            },
            pod_uid,
            claim,
            verdict,
        }
    }

    /// The overflow set: every workload past the cap.
    pub fn overflow(with_pid: bool) -> Self {
        Self {
            comm: OVERFLOW_COMM.into(),
            pid: with_pid.then_some(0),
            ..Self::default()
        }
    }

    /// Label values in the order of [`WorkloadLabels::names`].
    pub fn values(&self) -> Vec<String> {
        let mut v = vec![
            self.comm.clone(),
            self.container.clone(),
            self.pod.clone(),
            self.namespace.clone(),
        ];
        if let Some(pid) = self.pid {
            v.push(pid.to_string());
        }
        v
    }

    /// Label names for series with (`with_pid`) or without a pid label.
    pub fn names(with_pid: bool) -> Vec<&'static str> {
        let mut names = LABEL_NAMES.to_vec();
        if with_pid {
            names.push("pid");
        }
        names
    }
}

/// What a workload's processes say their pod is (downward-API variables,
/// files in their root): theirs to write, so shown beside the labels
/// (`claimed_*` in the JSONL), never as one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodClaim {
    pub pod: Option<String>,
    pub namespace: Option<String>,
}

/// A claim held against the host's record of the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimVerdict {
    /// Every part claimed is what the host records.
    Matches,
    /// A part claimed is not: the claim is rejected (and counted).
    Differs,
    /// The host has no record to hold it against (no pod log entry, or an
    /// ambiguous one).
    Unverified,
}

impl ClaimVerdict {
    /// As the JSONL writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Matches => "matches",
            Self::Differs => "differs",
            Self::Unverified => "unverified",
        }
    }
}

impl PodClaim {
    pub fn is_empty(&self) -> bool {
        self.pod.is_none() && self.namespace.is_none()
    }

    /// None when nothing is claimed.
    pub fn verdict(&self, host: Option<&PodName>) -> Option<ClaimVerdict> {
        if self.is_empty() {
            return None;
        }
        let Some(host) = host else {
            return Some(ClaimVerdict::Unverified);
        };
        let differs = |claimed: &Option<String>, recorded: &str| {
            claimed.as_deref().is_some_and(|c| c != recorded)
        };
        Some(
            if differs(&self.pod, &host.name) || differs(&self.namespace, &host.namespace) {
                ClaimVerdict::Differs
            } else {
                ClaimVerdict::Matches
            },
        )
    }
}

/// How a workload is named: its labels, the pod UID they rest on, and what
/// its processes claim.
#[derive(Debug, Clone)]
pub struct Naming {
    pub labels: WorkloadLabels,
    pub pod_uid: Option<String>,
    pub claim: PodClaim,
    /// None when nothing is claimed.
    pub verdict: Option<ClaimVerdict>,
}

#[derive(Debug)]
struct SetState {
    /// Live workloads reported under this set.
    live: usize,
    /// When the last one ended (CLOCK_MONOTONIC ns).
    idle_since_ns: Option<u64>,
}

/// The label sets in use, at most `max` of them plus the overflow set; at
/// most a pod's share of its own (`per_pod`), so that one tenant cannot
/// take the host's sets (past its share, its workloads share its own
/// overflow set).
#[derive(Debug)]
pub struct LabelSets {
    max: usize,
    /// Its `exceeded`: workloads put in their pod's overflow set because
    /// the pod had its share. Tenants are `namespace/pod` labels.
    pub per_pod: Quota<String>,
    retire_after_ns: u64,
    overflow: WorkloadLabels,
    sets: BTreeMap<WorkloadLabels, SetState>,
    /// Workloads put in the overflow set because the cap was reached.
    pub overflowed: u64,
}

/// A pod as a label-set tenant.
fn pod_of(labels: &WorkloadLabels) -> String {
    format!("{}/{}", labels.namespace, labels.pod)
}

impl LabelSets {
    pub fn new(max: usize, max_per_pod: usize, retire_after_ns: u64, with_pid: bool) -> Self {
        Self {
            max,
            per_pod: Quota::new(Resource::LabelSets, max_per_pod),
            retire_after_ns,
            overflow: WorkloadLabels::overflow(with_pid),
            sets: BTreeMap::new(),
            overflowed: 0,
        }
    }

    /// The overflow set of the pod of `labels`: its pod and namespace kept,
    /// so that what it costs stays the pod's.
    fn pod_overflow(&self, labels: &WorkloadLabels) -> WorkloadLabels {
        WorkloadLabels {
            pod: labels.pod.clone(),
            namespace: labels.namespace.clone(),
            ..self.overflow.clone()
        }
    }

    /// A pod's own sets (not its overflow set), of at most `max` + 1.
    fn sets_of_pod(&self, labels: &WorkloadLabels) -> usize {
        self.sets
            .keys()
            .filter(|l| {
                l.pod == labels.pod && l.namespace == labels.namespace && l.comm != OVERFLOW_COMM
            })
            .count()
    }

    /// A workload starts: returns the label set to report it under (its
    /// own; its pod's overflow set when its pod has its share; the overflow
    /// set when the host's cap is reached).
    pub fn admit(&mut self, labels: WorkloadLabels) -> WorkloadLabels {
        let labels = if self.sets.contains_key(&labels)
            || labels.pod.is_empty()
            || self
                .per_pod
                .admit(&pod_of(&labels), self.sets_of_pod(&labels))
        {
            labels
        } else {
            self.pod_overflow(&labels)
        };
        let own = self.sets.len() - usize::from(self.sets.contains_key(&self.overflow));
        let labels = if self.sets.contains_key(&labels) || own < self.max {
            labels
        } else {
            self.overflowed += 1;
            self.overflow.clone()
        };
        let state = self.sets.entry(labels.clone()).or_insert(SetState {
            live: 0,
            idle_since_ns: None,
        });
        state.live += 1;
        state.idle_since_ns = None;
        labels
    }

    /// A workload reported under `labels` ended at `now_ns`.
    pub fn release(&mut self, labels: &WorkloadLabels, now_ns: u64) {
        if let Some(state) = self.sets.get_mut(labels) {
            state.live = state.live.saturating_sub(1);
            if state.live == 0 {
                state.idle_since_ns = Some(now_ns);
            }
        }
    }

    /// Removes and returns the sets idle for the grace period: their series
    /// are to be deleted.
    pub fn retire(&mut self, now_ns: u64) -> Vec<WorkloadLabels> {
        let grace = self.retire_after_ns;
        let expired: Vec<WorkloadLabels> = self
            .sets
            .iter()
            .filter(|(_, s)| {
                s.idle_since_ns
                    .is_some_and(|t| now_ns.saturating_sub(t) >= grace)
            })
            .map(|(l, _)| l.clone())
            .collect();
        for l in &expired {
            self.sets.remove(l);
        }
        // A pod whose sets retired under its share is warned about again
        // if it passes it later.
        let (sets, share) = (&self.sets, self.per_pod.share());
        self.per_pod.settle(|pod| {
            let own = sets
                .keys()
                .filter(|l| l.comm != OVERFLOW_COMM && pod_of(l) == *pod);
            own.count() >= share
        });
        expired
    }

    /// Label sets in use (live or within their grace period).
    pub fn len(&self) -> usize {
        self.sets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sets.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(comm: &str) -> WorkloadLabels {
        WorkloadLabels {
            comm: comm.into(),
            ..WorkloadLabels::default()
        }
    }

    fn in_pod(comm: &str, pod: &str) -> WorkloadLabels {
        WorkloadLabels {
            comm: comm.into(),
            pod: pod.into(),
            namespace: "ns".into(),
            ..WorkloadLabels::default()
        }
    }

    #[test]
    fn a_pod_past_its_share_shares_its_own_overflow_set_and_others_are_untouched() {
        let mut sets = LabelSets::new(10, 2, 10, false);
        assert_eq!(sets.admit(in_pod("a", "greedy")), in_pod("a", "greedy"));
        assert_eq!(sets.admit(in_pod("b", "greedy")), in_pod("b", "greedy"));
        // Its third and fourth workloads: the pod's overflow set, its pod
        // and namespace kept; a known one keeps its own.
        let over = sets.admit(in_pod("c", "greedy"));
        assert_eq!(over, in_pod(OVERFLOW_COMM, "greedy"));
        assert_eq!(sets.admit(in_pod("d", "greedy")), over);
        assert_eq!(sets.admit(in_pod("a", "greedy")), in_pod("a", "greedy"));
        assert_eq!(sets.per_pod.exceeded, 2);
        // Another pod, and host processes (no pod), are not held by it.
        for comm in ["a", "b"] {
            assert_eq!(sets.admit(in_pod(comm, "other")), in_pod(comm, "other"));
        }
        for comm in ["h1", "h2", "h3"] {
            assert_eq!(sets.admit(named(comm)), named(comm));
        }
        assert_eq!((sets.overflowed, sets.per_pod.exceeded), (0, 2));
        // Once one of its sets retires, the pod has room again.
        let a = in_pod("a", "greedy");
        sets.release(&a, 0);
        sets.release(&a, 0);
        assert_eq!(sets.retire(10), vec![a]);
        assert_eq!(sets.admit(in_pod("e", "greedy")), in_pod("e", "greedy"));
    }

    #[test]
    fn caps_the_sets_and_counts_the_overflow() {
        let mut sets = LabelSets::new(2, 2, 10, false);
        assert_eq!(sets.admit(named("a")), named("a"));
        assert_eq!(sets.admit(named("b")), named("b"));
        // A third name overflows; a known name does not.
        assert_eq!(sets.admit(named("c")).comm, OVERFLOW_COMM);
        assert_eq!(sets.admit(named("d")).comm, OVERFLOW_COMM);
        assert_eq!(sets.admit(named("a")), named("a"));
        assert_eq!(sets.overflowed, 2);
        assert_eq!(sets.len(), 3);
    }

    #[test]
    fn a_root_gone_before_it_is_named_is_named_from_what_was_seen() {
        let mut pods = PodRecords::new(std::path::Path::new("/nonexistent"));
        let mut claims = TargetWork::new(std::time::Duration::from_secs(5), 1);
        let uid = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9";
        let seen = ProcessSeen {
            cgroup: Some(format!("/kubepods/besteffort/pod{uid}/{}", "ab".repeat(32))),
            comm: Some("vllm\tserve".into()),
        };
        // No such process (above any pid_max).
        let n = WorkloadLabels::of_process(u32::MAX, &seen, false, &mut pods, &mut claims);
        assert_eq!(n.pod_uid.as_deref(), Some(uid));
        assert_eq!(n.labels.pod, uid, "no record: the UID");
        assert_eq!(n.labels.container, "abababababab");
        assert_eq!(n.labels.comm, "vllm?serve");
        let none = WorkloadLabels::of_process(
            u32::MAX,
            &ProcessSeen::default(),
            false,
            &mut pods,
            &mut claims,
        );
        assert_eq!(none.labels, WorkloadLabels::default());
    }

    #[test]
    fn retires_a_set_only_after_its_last_workload_and_the_grace() {
        let mut sets = LabelSets::new(8, 8, 100, false);
        let a = sets.admit(named("a"));
        let a2 = sets.admit(named("a"));
        sets.release(&a, 1_000);
        assert!(sets.retire(5_000).is_empty(), "one workload still live");
        sets.release(&a2, 2_000);
        assert!(sets.retire(2_050).is_empty(), "within the grace period");
        // A restart within the grace keeps the set.
        let a3 = sets.admit(named("a"));
        sets.release(&a3, 3_000);
        assert!(sets.retire(3_099).is_empty());
        assert_eq!(sets.retire(3_100), vec![named("a")]);
        assert!(sets.is_empty());
        // Retiring frees room under the cap.
        let mut capped = LabelSets::new(1, 1, 0, false);
        let x = capped.admit(named("x"));
        capped.release(&x, 0);
        assert_eq!(capped.retire(0), vec![named("x")]);
        assert_eq!(capped.admit(named("y")), named("y"));
    }

    #[test]
    fn a_claim_is_judged_against_the_hosts_record() {
        let host = PodName {
            namespace: "serving".into(),
            name: "vllm-0".into(),
        };
        let claim = |pod: Option<&str>, ns: Option<&str>| PodClaim {
            pod: pod.map(str::to_string),
            namespace: ns.map(str::to_string),
        };
        use ClaimVerdict::*;
        for (c, h, want) in [
            (claim(None, None), Some(&host), None),
            (
                claim(Some("vllm-0"), Some("serving")),
                Some(&host),
                Some(Matches),
            ),
            (claim(Some("vllm-0"), None), Some(&host), Some(Matches)),
            (
                claim(Some("vllm-0"), Some("kube-system")),
                Some(&host),
                Some(Differs),
            ),
            (
                claim(Some("payments-api"), None),
                Some(&host),
                Some(Differs),
            ),
            (
                claim(Some("vllm-0"), Some("serving")),
                None,
                Some(Unverified),
            ),
        ] {
            assert_eq!(c.verdict(h), want, "{c:?}");
        }
    }

    #[test]
    fn comm_is_printable_and_short() {
        assert_eq!(clean_comm("python3"), "python3");
        assert_eq!(clean_comm("a\nb\u{1b}[2Jc\u{e9}"), "a?b?[2Jc?");
        assert_eq!(clean_comm("0123456789abcdefgh").len(), 15);
    }

    #[test]
    fn values_follow_the_names() {
        let l = WorkloadLabels {
            comm: "python3".into(),
            container: "4f1c3c2a9e8b".into(),
            pod: "vllm-0".into(),
            namespace: "serving".into(),
            pid: Some(42),
        };
        assert_eq!(WorkloadLabels::names(true).len(), l.values().len());
        assert_eq!(l.values()[4], "42");
        assert_eq!(WorkloadLabels::names(false), LABEL_NAMES.to_vec());
        let mut pods = PodRecords::new(std::path::Path::new("/nonexistent"));
        let mut claims = TargetWork::new(std::time::Duration::from_secs(5), 1);
        let own = WorkloadLabels::of_process(
            std::process::id(),
            &ProcessSeen::default(),
            false,
            &mut pods,
            &mut claims,
        )
        .labels;
        assert_eq!(
            own.comm,
            crate::host::targets::comm(std::process::id()).unwrap_or_default()
        );
        assert_eq!(own.pid, None);
    }
}
