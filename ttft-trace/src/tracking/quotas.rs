//! The host-wide kernel maps shared by quota between workloads (a pod,
//! else a cgroup: a [`Tenant`]): the followed listening sockets
//! (`LISTEN_NETNS`). At each scan every tenant's use is counted from what
//! its processes hold; what is past its share is refused (not added, or
//! taken out of the map), and its workloads are flagged in `OVER_SHARE` so
//! that the kernel refuses their further `listen()` pairs until the next
//! scan. See [`crate::workloads::quota`].

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use ttft_trace_common::QUOTA_LISTENERS;

use crate::{
    config::Quotas as Shares,
    host::ports::HeldListener,
    probes::Probes,
    workloads::quota::{Quota, Resource, Tenant},
};

/// A (network namespace, port) pair of `LISTEN_NETNS`.
type Pair = (u32, u16);

/// What one tenant holds: its workloads (roots), and its pairs, each
/// marked new (not followed yet) or not.
type Holding = (BTreeSet<u32>, BTreeSet<(bool, Pair)>);

pub(super) struct Quotas {
    listeners: Quota<Tenant>,
    /// The tenant of each traced workload (by its root), as found when
    /// first needed; forgotten with the workload.
    tenants: BTreeMap<u32, Option<Tenant>>,
    /// Listening pairs refused at the last scan: each is counted once,
    /// at the scan that first refuses it.
    refused: BTreeSet<Pair>,
    /// Workloads flagged over their share of listeners, as last written
    /// to `OVER_SHARE`.
    flagged: BTreeSet<u32>,
}

impl Quotas {
    pub fn new(shares: Shares) -> Self {
        Self {
            listeners: Quota::new(Resource::Listeners, shares.listeners),
            tenants: BTreeMap::new(),
            refused: BTreeSet::new(),
            flagged: BTreeSet::new(),
        }
    }

    /// Listeners refused past their tenants' shares since the start.
    pub fn exceeded(&self) -> Vec<(&'static str, u64)> {
        vec![(Resource::Listeners.name(), self.listeners.exceeded)]
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
        self.tenants
            .retain(|root, _| root_of.values().any(|r| r == root));
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
            let (kept, refused) = self.listeners.split(pairs);
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
        self.flag(probes, flag)?;
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

    /// Writes the workloads at their share of listeners to `OVER_SHARE`:
    /// those flagged before and no longer are cleared.
    fn flag(&mut self, probes: &mut Probes, now: BTreeSet<u32>) -> Result<()> {
        for &root in self.flagged.difference(&now) {
            probes.set_over_share(root, 0)?;
        }
        for &root in now.difference(&self.flagged) {
            probes.set_over_share(root, QUOTA_LISTENERS)?;
        }
        self.flagged = now;
        Ok(())
    }
}
