//! The host-wide kernel maps shared by quota between workloads (a pod,
//! else a cgroup: a [`Tenant`]): the followed listening sockets
//! (`LISTEN_NETNS`) and the tracked ids (`TRACKED`: processes, and the
//! threads the kernel adds at fork). At each scan every tenant's use is
//! counted from what its processes hold; what is past its share is
//! refused (not added, or taken out of the map), and its workloads are
//! flagged in `OVER_SHARE` so that the kernel refuses their further
//! `listen()` pairs and forked children until a scan finds them under
//! their share. See [`crate::workloads::quota`].

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use ttft_trace_common::{QUOTA_LISTENERS, QUOTA_THREADS, Stat};

use super::processes::Census;
use crate::{
    config::Quotas as Shares,
    host::ports::HeldListener,
    probes::Probes,
    workloads::quota::{Quota, Resource, Tenant},
};

/// Most processes remembered as refused (each counted once): past it the
/// memory is emptied, and those still refused are counted again.
const REFUSED_PROCESSES_MAX: usize = 16_384;

/// A (network namespace, port) pair of `LISTEN_NETNS`.
type Pair = (u32, u16);

/// What one tenant holds: its workloads (roots), and its pairs, each
/// marked new (not followed yet) or not.
type Holding = (BTreeSet<u32>, BTreeSet<(bool, Pair)>);

pub(super) struct Quotas {
    listeners: Quota<Tenant>,
    threads: Quota<Tenant>,
    /// The tenant of each traced workload (by its root), as found when
    /// first needed; forgotten with the workload.
    tenants: BTreeMap<u32, Option<Tenant>>,
    /// Listening pairs refused at the last scan: each is counted once,
    /// at the scan that first refuses it.
    refused: BTreeSet<Pair>,
    /// Processes the scan found and did not track, their tenant at its
    /// share of `TRACKED`: each counted once while it lives.
    refused_processes: BTreeSet<u32>,
    /// Tenants whose `TRACKED` ids reached their share at the last scan
    /// (processes alone may: threads that existed before tracing are not
    /// in the map).
    at_thread_share: BTreeSet<Tenant>,
    /// Workloads at their share, by `QUOTA_*` bit: `OVER_SHARE` holds
    /// their union.
    flagged: BTreeMap<u32, BTreeSet<u32>>,
    /// `OVER_SHARE` as last written.
    written: BTreeMap<u32, u32>,
}

impl Quotas {
    pub fn new(shares: Shares) -> Self {
        Self {
            listeners: Quota::new(Resource::Listeners, shares.listeners),
            threads: Quota::new(Resource::Threads, shares.threads),
            tenants: BTreeMap::new(),
            refused: BTreeSet::new(),
            refused_processes: BTreeSet::new(),
            at_thread_share: BTreeSet::new(),
            flagged: BTreeMap::new(),
            written: BTreeMap::new(),
        }
    }

    /// What was refused past the tenants' shares since the start, by
    /// resource; the kernel's refusals at fork included.
    pub fn exceeded(&self, probes: &Probes) -> Result<Vec<(&'static str, u64)>> {
        let at_fork = probes.stat(Stat::TrackedQuota)?;
        Ok(vec![
            (Resource::Listeners.name(), self.listeners.exceeded),
            (Resource::Threads.name(), self.threads.exceeded + at_fork),
        ])
    }

    /// Shares `TRACKED` between the tenants of the `census`'s workloads:
    /// a tenant's processes count first (they are traced: never taken
    /// out), then its threads, of which those past its share are taken
    /// out (its threads are still traced: every lookup is by process id;
    /// the entry only lets the kernel add their children). Flags the
    /// workloads of every tenant at its share, whose forked children the
    /// kernel then refuses (counted there).
    pub fn share_tracked(&mut self, probes: &mut Probes, census: &Census) -> Result<()> {
        let roots: BTreeSet<u32> = census.live.iter().map(|&(_, root)| root).collect();
        self.tenants.retain(|root, _| roots.contains(root));
        // (workloads, processes, threads) of each tenant.
        let mut by_tenant: BTreeMap<Tenant, (BTreeSet<u32>, usize, Vec<u32>)> = BTreeMap::new();
        for (&(id, root), thread) in census
            .live
            .iter()
            .map(|e| (e, false))
            .chain(census.threads.iter().map(|e| (e, true)))
        {
            let Some(tenant) = self.tenant(root, id) else {
                continue;
            };
            let (roots, processes, threads) = by_tenant.entry(tenant).or_default();
            roots.insert(root);
            if thread {
                threads.push(id);
            } else {
                *processes += 1;
            }
        }
        let (mut flag, mut at_share) = (BTreeSet::new(), BTreeSet::new());
        for (tenant, (roots, processes, threads)) in by_tenant {
            let (kept, past) = self.threads.split(processes, threads);
            for &tid in &past {
                probes.untrack(tid)?;
            }
            if !past.is_empty() {
                self.threads.refuse(&tenant, past.len() as u64);
            }
            if processes + kept.len() >= self.threads.share() {
                flag.extend(roots);
                at_share.insert(tenant);
            }
        }
        self.threads.settle(|t| at_share.contains(t));
        self.at_thread_share = at_share;
        self.refused_processes
            .retain(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists());
        self.flag(probes, QUOTA_THREADS, flag)
    }

    /// Whether process `pid`, found by a scan, may be tracked in the
    /// workload rooted at `root`: not while the workload's tenant is at
    /// its share of `TRACKED` (a refusal counted once a process).
    pub fn admits_process(&mut self, root: u32, pid: u32) -> bool {
        let Some(tenant) = self.tenant(root, pid) else {
            return true;
        };
        if !self.at_thread_share.contains(&tenant) && !self.threads.is_over(&tenant) {
            return true;
        }
        if self.refused_processes.len() >= REFUSED_PROCESSES_MAX {
            self.refused_processes.clear();
        }
        if self.refused_processes.insert(pid) {
            self.threads.refuse(&tenant, 1);
        }
        false
    }

    /// Entries of its per-target tables: (table, entries).
    pub fn table_entries(&self) -> [(&'static str, usize); 3] {
        [
            ("quota_tenants", self.tenants.len()),
            ("quota_refused_processes", self.refused_processes.len()),
            ("over_share_workloads", self.written.len()),
        ]
    }

    /// The tenant of the traced workload rooted at `root`, as found at the
    /// last scan.
    pub fn tenant_of(&self, root: u32) -> Option<&Tenant> {
        self.tenants.get(&root)?.as_ref()
    }

    /// The tenant of the workload rooted at `root` (through `pid` of it
    /// when the root has exited).
    fn tenant(&mut self, root: u32, pid: u32) -> Option<Tenant> {
        self.tenants
            .entry(root)
            .or_insert_with(|| Tenant::of_process(root).or_else(|| Tenant::of_process(pid)))
            .clone()
    }

    /// Shares the listeners `held` by the `live` traced processes (pid,
    /// workload) between their tenants: the pairs `followed` already come
    /// first, then the others by namespace and port. Flags the workloads
    /// of every tenant at its share in `OVER_SHARE`. Returns the pairs past
    /// their tenants' shares: not followed.
    pub fn share_listeners(
        &mut self,
        probes: &mut Probes,
        held: &BTreeSet<HeldListener>,
        live: &[(u32, u32)],
        followed: &BTreeSet<(Option<u32>, u16)>,
    ) -> Result<&BTreeSet<Pair>> {
        let root_of: BTreeMap<u32, u32> = live.iter().copied().collect();
        let mut by_tenant: BTreeMap<Tenant, Holding> = BTreeMap::new();
        for l in held {
            let (Some(netns), Some(&root)) = (l.netns, root_of.get(&l.pid)) else {
                continue;
            };
            let Some(tenant) = self.tenant(root, l.pid) else {
                continue;
            };
            let (roots, pairs) = by_tenant.entry(tenant).or_default();
            roots.insert(root);
            // Followed ones sort first (false < true).
            let new = !followed.contains(&(Some(netns), l.port));
            pairs.insert((new, (netns, l.port)));
        }
        let (mut within, mut past) = (BTreeSet::new(), BTreeSet::new());
        let (mut flag, mut over) = (BTreeSet::new(), BTreeSet::new());
        for (tenant, (roots, pairs)) in by_tenant {
            let pairs: Vec<Pair> = pairs.into_iter().map(|(_, p)| p).collect();
            let (kept, refused) = self.listeners.split(0, pairs);
            if kept.len() >= self.listeners.share() {
                flag.extend(roots);
            }
            let new = refused.iter().filter(|p| !self.refused.contains(p)).count();
            if new > 0 {
                self.listeners.refuse(&tenant, new as u64);
            }
            if !refused.is_empty() {
                over.insert(tenant);
            }
            within.extend(kept);
            past.extend(refused);
        }
        // A pair two tenants hold is followed if either keeps it.
        let refused: BTreeSet<Pair> = past.difference(&within).copied().collect();
        self.listeners.settle(|t| over.contains(t));
        self.refused = refused;
        self.flag(probes, QUOTA_LISTENERS, flag)?;
        Ok(&self.refused)
    }

    /// The listeners of `held` within their tenants' shares at the last
    /// [`Quotas::share_listeners`] (and those whose namespace is unknown:
    /// followed in every one, they hold no pair).
    pub fn within_shares(&self, held: BTreeSet<HeldListener>) -> BTreeSet<HeldListener> {
        let refused = &self.refused;
        held.into_iter()
            .filter(|l| l.netns.is_none_or(|n| !refused.contains(&(n, l.port))))
            .collect()
    }

    /// Flags the workloads `now` at their share of resource `bit`, and
    /// only them, in `OVER_SHARE`; writes only the entries that change.
    fn flag(&mut self, probes: &mut Probes, bit: u32, now: BTreeSet<u32>) -> Result<()> {
        self.flagged.insert(bit, now);
        let mut want: BTreeMap<u32, u32> = BTreeMap::new();
        for (&bit, roots) in &self.flagged {
            for &root in roots {
                *want.entry(root).or_default() |= bit;
            }
        }
        for &root in self.written.keys().filter(|r| !want.contains_key(r)) {
            probes.set_over_share(root, 0)?;
        }
        for (&root, &bits) in &want {
            if self.written.get(&root) != Some(&bits) {
                probes.set_over_share(root, bits)?;
            }
        }
        self.written = want;
        Ok(())
    }
}
