//! The traced processes and their workloads, as the kernel's maps hold
//! them: which workloads are traced, which processes are live, and what
//! the kernel announced or kept of processes that exited.

use std::collections::BTreeSet;

use anyhow::Result;

use super::Change;
use crate::{host::targets, probes::Probes, workloads::ProcessSeen};

/// Announced processes kept per turn of the event loop (see
/// [`Workloads::announce`]).
const MAX_ANNOUNCED: usize = 4096;

/// The ids `TRACKED` holds, each with its workload.
#[derive(Default)]
pub(super) struct Census {
    /// Live processes.
    pub live: Vec<(u32, u32)>,
    /// Live threads (not leaders) the kernel added at their fork.
    pub threads: Vec<(u32, u32)>,
}

#[derive(Default)]
pub(super) struct Workloads {
    /// Roots of the workloads traced now.
    roots: BTreeSet<u32>,
    /// The roots traced when the kernel's map was last read for a rescan
    /// ([`Workloads::mark_census`]): only these can be found ended by it.
    at_census: BTreeSet<u32>,
    /// Processes announced by the kernel, to consider.
    announced: Vec<u32>,
    /// Exited processes the kernel kept a workload for at the last
    /// [`Workloads::forget_exited`].
    exited_seen: BTreeSet<u32>,
}

impl Workloads {
    /// How many workloads are traced.
    pub fn count(&self) -> usize {
        self.roots.len()
    }

    /// Exited processes the kernel kept a workload for, at the last
    /// [`Workloads::forget_exited`].
    pub fn exited_seen(&self) -> usize {
        self.exited_seen.len()
    }

    /// Whether `root` is the root of a workload traced now.
    pub fn is_traced(&self, root: u32) -> bool {
        self.roots.contains(&root)
    }

    /// Starts tracing the workload rooted at `root`: the root and its
    /// descendants are tracked (the kernel adds later children).
    pub fn add(&mut self, probes: &mut Probes, root: u32, changes: &mut Vec<Change>) -> Result<()> {
        // Traced already, or a zombie: a late announcement of a root whose
        // threads exited (the kernel untracked it at its group's death)
        // must not start its workload a second time.
        if self.roots.contains(&root) || !targets::is_process(root) {
            return Ok(());
        }
        // Track first, then list the children: a child forked in between is
        // then tracked by the kernel and found by the listing. A full map
        // refuses the root (counted): it is not a workload, and a later scan
        // tries again.
        if !probes.track(root, root)? {
            return Ok(());
        }
        // Alive now: what names it is read before it may exit.
        let seen = ProcessSeen::read(root);
        let members = targets::descendants(root);
        for child in &members {
            probes.track(*child, root)?;
        }
        self.roots.insert(root);
        changes.push(Change::Started {
            root,
            members,
            seen,
        });
        Ok(())
    }

    /// Adds `pid` to the traced workload rooted at `root`.
    pub fn join(probes: &mut Probes, pid: u32, root: u32, changes: &mut Vec<Change>) -> Result<()> {
        // Refused by a full map: counted, and a later scan tries again.
        if probes.track(pid, root)? {
            changes.push(Change::Joined { pid, root });
        }
        Ok(())
    }

    /// Live processes among the tracked ids, each with its workload; ids of
    /// exited processes and threads are dropped from the kernel's map on
    /// the way.
    pub fn live(probes: &mut Probes) -> Result<Vec<(u32, u32)>> {
        Ok(Self::census(probes)?.live)
    }

    /// The tracked ids sorted out: live processes and live threads, each
    /// with its workload; those of exited ones are dropped from the
    /// kernel's map on the way.
    pub fn census(probes: &mut Probes) -> Result<Census> {
        let mut census = Census::default();
        for (id, root) in probes.tracked()? {
            if targets::is_process(id) {
                census.live.push((id, root));
            } else if std::path::Path::new(&format!("/proc/{id}")).exists() {
                census.threads.push((id, root));
            } else {
                probes.untrack(id)?;
            }
        }
        Ok(census)
    }

    /// Notes the workloads traced now, as the kernel's map is read for a
    /// rescan (see [`Workloads::ended`]).
    pub fn mark_census(&mut self) {
        self.at_census.clone_from(&self.roots);
    }

    /// The workloads traced at the last [`Workloads::mark_census`] none of
    /// whose processes was alive in `live` (read then): no longer traced.
    /// A workload started since (by the rescan's drain) is not in `live`
    /// and not ended.
    pub fn ended(&mut self, live: &[(u32, u32)]) -> Vec<u32> {
        let alive: BTreeSet<u32> = live.iter().map(|(_, root)| *root).collect();
        let ended: Vec<u32> = self
            .roots
            .intersection(&self.at_census)
            .filter(|root| !alive.contains(root))
            .copied()
            .collect();
        for root in &ended {
            self.roots.remove(root);
        }
        ended
    }

    /// Drops the kernel's workload of processes that exited before the
    /// previous call: a whole rescan and drain have read their last events
    /// since. Bounds EXITED by the processes that exit in one period.
    pub fn forget_exited(&mut self, probes: &mut Probes) -> Result<()> {
        let now: BTreeSet<u32> = probes.exited()?.into_iter().collect();
        for tgid in now.intersection(&self.exited_seen) {
            probes.forget_exited(*tgid)?;
        }
        self.exited_seen = now.difference(&self.exited_seen).copied().collect();
        Ok(())
    }

    /// Notes a process the kernel announced, to consider at the next turn;
    /// beyond [`MAX_ANNOUNCED`] a turn, the rest wait for the next /proc
    /// scan.
    pub fn announce(&mut self, pid: u32) {
        if self.announced.len() < MAX_ANNOUNCED {
            self.announced.push(pid);
        }
    }

    /// The processes announced since the last call.
    pub fn take_announced(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.announced)
    }

    /// Forgets the announced processes that exited (turned down: not
    /// traced), so that the kernel's map holds live processes only and a
    /// process reusing one of their pids is announced again.
    pub fn forget_announced_exited(probes: &mut Probes) -> Result<()> {
        let gone: Vec<u32> = probes
            .announced()?
            .into_iter()
            .filter(|tgid| !std::path::Path::new(&format!("/proc/{tgid}")).exists())
            .collect();
        Self::forget_announced(probes, gone.into_iter());
        Ok(())
    }

    /// Forgets that the kernel announced `members` of an ended workload,
    /// so that a process reusing one of their pids is announced again.
    pub fn forget_announced(probes: &mut Probes, members: impl Iterator<Item = u32>) {
        for tgid in members {
            if let Err(e) = probes.forget_announced(tgid) {
                log::debug!("forgetting announced {tgid}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A workload started after the rescan read the kernel's map (by the
    /// drain that follows) is absent from the live processes read then: it
    /// is not ended with the workloads that were.
    #[test]
    fn a_workload_started_after_the_census_is_not_ended_by_it() {
        let mut w = Workloads::default();
        w.roots.extend([1, 2]);
        w.mark_census();
        w.roots.insert(3);
        assert_eq!(w.ended(&[(10, 1)]), vec![2]);
        assert_eq!(w.roots, BTreeSet::from([1, 3]));
        // The next rescan reads it.
        w.mark_census();
        assert_eq!(w.ended(&[(10, 1)]), vec![3]);
        assert_eq!(w.count(), 1);
    }
}
