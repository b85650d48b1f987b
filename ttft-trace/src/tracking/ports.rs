//! The listening ports followed, and where the segment program goes: the
//! cgroups of the traced processes and of their listening sockets (see
//! [`crate::probes::SegmentReach`]).
//!
//! A connection accepted on a listener belongs to the listener's cgroup,
//! which is the server's own unless another process made the socket
//! (systemd socket activation) or the server moved after it listened. The
//! listeners' cgroups are asked of the kernel (sock_diag) when a traced
//! process holds a listener not asked about before, and again when the
//! kernel's self-check counts connections read on a listener none of whose
//! handshakes the program saw (`Stat::ListenerUnseen`); host-wide only
//! where a listener is in the root cgroup, or the self-check keeps counting
//! with every listener's cgroup covered.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use anyhow::Result;

use super::quotas::Quotas;
use crate::{
    host::cgroups,
    host::ports::{self, HeldListener},
    host::sock_diag,
    host::targets,
    probes::{Probes, SegmentReach, attachable},
};

/// Most listening sockets whose cgroups are kept: a traced process opens
/// as many as it likes; past this, segments are seen host-wide.
const LISTENERS_MAX: usize = 1024;

/// The ports followed, and the listeners' cgroups.
#[derive(Default)]
pub(super) struct Ports {
    /// (network namespace, port) followed; None: every namespace.
    listen_ports: BTreeSet<(Option<u32>, u16)>,
    /// Ports followed by `--port`: their servers may run anywhere, so
    /// segments are seen host-wide.
    extra_ports: bool,
    listeners: ListenerCgroups,
    /// `LISTEN_NETNS` pairs no traced process held at the last scan: removed
    /// when still unheld at the next (a `listen()` the kernel saw between a
    /// scan's read of /proc and its read of the map is not removed).
    unheld: BTreeSet<(u32, u16)>,
    /// `LISTEN_NETNS` pairs left at the last scan.
    followed: usize,
}

/// The cgroups of the traced processes' listening sockets.
#[derive(Default)]
struct ListenerCgroups {
    /// By socket inode: its cgroup path (None: the kernel named none) and
    /// port. Only sockets the traced processes hold at the last lookup.
    by_inode: BTreeMap<u64, (Option<String>, u16)>,
    /// More listeners than [`LISTENERS_MAX`] are held (at the last lookup).
    overflowed: bool,
    /// The self-check's count at the last lookup, and when a cgroup was
    /// last added by one.
    unseen_looked: u64,
    unseen_pinned: u64,
}

impl Ports {
    /// Entries of its per-target tables: (table, entries).
    pub fn table_entries(&self) -> [(&'static str, usize); 3] {
        [
            ("listen_ports", self.listen_ports.len()),
            ("listener_cgroups", self.listeners.by_inode.len()),
            ("listen_pairs_unheld", self.unheld.len()),
        ]
    }

    /// Follows connections accepted on the ports the `live` traced
    /// processes (pid, workload) listen on now (later `listen()` calls are
    /// seen in the kernel), within their workloads' `quotas`, and on
    /// `extra` ports.
    pub fn follow(
        &mut self,
        probes: &mut Probes,
        live: &[(u32, u32)],
        extra: &[u16],
        quotas: &mut Quotas,
    ) -> Result<()> {
        self.extra_ports |= !extra.is_empty();
        let pids: Vec<u32> = live.iter().map(|(pid, _)| *pid).collect();
        let all = ports::listening_sockets(&pids);
        let refused = quotas
            .share_listeners(probes, &all, live, &self.listen_ports)?
            .clone();
        let held = quotas.within_shares(all);
        // First, so that what a workload holds past its share makes room
        // for the others' ports added below.
        self.forget_closed(probes, &held, &refused)?;
        self.find_listener_cgroups(probes, &held);
        // Before the ports: a connection accepted in between has its
        // segments seen.
        self.scope_segments(probes, &pids)?;
        let mut found: BTreeSet<(Option<u32>, u16)> =
            held.iter().map(|l| (l.netns, l.port)).collect();
        found.extend(extra.iter().map(|&port| (None, port)));
        let mut new = Vec::new();
        for (netns, port) in found {
            // A port refused (its map full) is tried again at the next scan.
            if !self.listen_ports.contains(&(netns, port)) && probes.add_listen_port(netns, port)? {
                self.listen_ports.insert((netns, port));
                new.push(port.to_string());
            }
        }
        if !new.is_empty() {
            log::info!("following requests on port(s) {}", new.join(", "));
        }
        Ok(())
    }

    /// Removes the `LISTEN_NETNS` pairs that no traced process has held for
    /// two scans (the listener closed, its process or namespace is gone),
    /// so that ports coming and going never fill the map, and those
    /// `refused` past their workload's share.
    fn forget_closed(
        &mut self,
        probes: &mut Probes,
        held: &BTreeSet<HeldListener>,
        refused: &BTreeSet<(u32, u16)>,
    ) -> Result<()> {
        let held: BTreeSet<(u32, u16)> = held
            .iter()
            .filter_map(|l| Some((l.netns?, l.port)))
            .collect();
        let in_kernel: BTreeSet<(u32, u16)> = probes.listen_netns_pairs()?.into_iter().collect();
        let closed = closed_listeners(&in_kernel, &held, &self.unheld, refused);
        for &(netns, port) in &closed.gone {
            probes.remove_listen_pair(netns, port, closed.ports_kept.contains(&port))?;
            self.listen_ports.remove(&(Some(netns), port));
        }
        if !closed.gone.is_empty() {
            log::debug!(
                "{} listening port(s) closed or past their workload's share: no longer followed",
                closed.gone.len()
            );
        }
        self.unheld = closed.unheld;
        self.followed = in_kernel.len() - closed.gone.len();
        Ok(())
    }

    /// `LISTEN_NETNS` pairs left at the last scan (those the kernel added
    /// since are counted at the next).
    pub fn followed(&self) -> usize {
        self.followed
    }

    /// Puts the segment program on the cgroups the `live` traced processes
    /// and their listeners are in.
    pub fn scope_segments(&mut self, probes: &mut Probes, live: &[u32]) -> Result<()> {
        let reach = if self.extra_ports {
            SegmentReach::Host("ports given with --port may be served from any cgroup".into())
        } else if self.listeners.overflowed {
            // Scoped again once they close.
            SegmentReach::HostWhile(format!(
                "the traced processes hold more than {LISTENERS_MAX} listening sockets"
            ))
        } else {
            // A process gone meanwhile is left out, not taken for one
            // without a cgroup.
            let processes = segment_reach(live.iter().filter_map(|&pid| {
                let path = cgroups::cgroup_v2_path(pid);
                (path.is_some() || targets::is_process(pid)).then_some((pid, path))
            }));
            with_listeners(processes, self.listeners.by_inode.values())
        };
        Ok(probes.scope_segments(&reach)?)
    }

    /// Asks the kernel for the cgroups of the listeners in `held` not
    /// asked about before, and forgets those no longer held; true when a
    /// cgroup was added.
    fn find_listener_cgroups(&mut self, probes: &Probes, held: &BTreeSet<HeldListener>) -> bool {
        let inodes: BTreeSet<u64> = held.iter().map(|l| l.inode).collect();
        // Recomputed at each lookup: fewer listeners scope segments again.
        self.listeners.overflowed = inodes.len() > LISTENERS_MAX;
        let known = &mut self.listeners.by_inode;
        known.retain(|inode, _| inodes.contains(inode));
        let new: Vec<&HeldListener> = held
            .iter()
            .filter(|l| !known.contains_key(&l.inode))
            .collect();
        if new.is_empty() || !probes.segments_scoped() {
            return false;
        }
        // Sockets, not holders: a server's workers share its listeners.
        if self.listeners.overflowed {
            return true;
        }
        // One dump per network namespace, through a process in it.
        let mut by_netns: BTreeMap<Option<u32>, u32> = BTreeMap::new();
        for l in &new {
            by_netns.entry(l.netns).or_insert(l.pid);
        }
        // Each new listener is asked about once: one the dumps do not name
        // (a dump refused or cut short) is left to the self-check.
        let mut cgroup_ids: HashMap<u64, u64> = HashMap::new();
        for pid in by_netns.into_values() {
            match sock_diag::listeners(pid) {
                Ok(found) => {
                    cgroup_ids.extend(found.iter().map(|d| (u64::from(d.inode), d.cgroup_id)))
                }
                Err(e) => log::debug!("segments: the listeners of pid {pid}'s namespace: {e}"),
            }
        }
        let mut added = false;
        for l in new {
            let id = cgroup_ids.get(&l.inode).copied().unwrap_or(0);
            // Id 0: the kernel named no cgroup.
            let path = match (id != 0).then(|| probes.cgroup_path(id)).flatten() {
                Some(Ok(path)) => Some(path),
                Some(Err(e)) => {
                    log::debug!("segments: cgroup {id} of port {}: {e}", l.port);
                    None
                }
                None => None,
            };
            let known = &self.listeners.by_inode;
            added |= path
                .as_ref()
                .is_some_and(|p| !known.values().any(|(k, _)| k.as_ref() == Some(p)));
            self.listeners.by_inode.insert(l.inode, (path, l.port));
        }
        added
    }

    /// The self-check, at each reading of the kernel's counters: `unseen`
    /// connections so far were read on listeners whose handshakes the
    /// program never saw. Looks the listeners up again; host-wide when
    /// that adds no cgroup and more than one was counted since the last
    /// one added.
    pub fn check_listeners(
        &mut self,
        probes: &mut Probes,
        unseen: u64,
        live: &[u32],
        quotas: &Quotas,
    ) -> Result<()> {
        if unseen <= self.listeners.unseen_looked || !probes.segments_scoped() {
            return Ok(());
        }
        self.listeners.unseen_looked = unseen;
        // A socket keeps its cgroup: only listeners made since the last
        // lookup (a listen() after the tracer started) are asked about.
        let before: BTreeSet<String> = self.listener_paths();
        let held = quotas.within_shares(ports::listening_sockets(live));
        self.find_listener_cgroups(probes, &held);
        if self.listener_paths().difference(&before).next().is_some() {
            log::info!(
                "segments: {unseen} connections were read on listeners outside the cgroups \
                 followed; adding the listeners' cgroups"
            );
            self.listeners.unseen_pinned = unseen;
            return self.scope_segments(probes, live);
        }
        Ok(probes.check_segment_scope(unseen - self.listeners.unseen_pinned)?)
    }

    fn listener_paths(&self) -> BTreeSet<String> {
        self.listeners
            .by_inode
            .values()
            .filter_map(|(p, _)| p.clone())
            .collect()
    }
}

/// Where the segments of the processes `(pid, cgroup v2 path)` are seen:
/// their cgroups, or host-wide where one has no path the program can be put
/// on (the root cgroup, above all: then it would run for every process).
fn segment_reach(processes: impl Iterator<Item = (u32, Option<String>)>) -> SegmentReach {
    let mut paths = BTreeSet::new();
    for (pid, path) in processes {
        match path {
            Some(path) if attachable(&path) => {
                paths.insert(path);
            }
            Some(path) => {
                return SegmentReach::Host(format!("traced process {pid} is in cgroup {path}"));
            }
            None => {
                return SegmentReach::Host(format!(
                    "traced process {pid} has no cgroup v2 path (or it exited)"
                ));
            }
        }
    }
    SegmentReach::Cgroups(paths)
}

/// `processes` with the cgroups of listeners `(path, port)` added; host-wide
/// where a listener's cgroup is one the program cannot be put on (a socket
/// made by a process in the root cgroup). A listener whose cgroup the
/// kernel did not name is left to the self-check.
fn with_listeners<'a>(
    processes: SegmentReach,
    listeners: impl Iterator<Item = &'a (Option<String>, u16)>,
) -> SegmentReach {
    let SegmentReach::Cgroups(mut paths) = processes else {
        return processes;
    };
    for (path, port) in listeners {
        let Some(path) = path else { continue };
        if !attachable(path) {
            return SegmentReach::Host(format!(
                "the listening socket of port {port} is in cgroup {path} (made by a process \
                 outside the workload's cgroup, as with socket activation)"
            ));
        }
        paths.insert(path.clone());
    }
    SegmentReach::Cgroups(paths)
}

/// What one scan finds of the `LISTEN_NETNS` pairs: those to remove, the
/// ports some remaining pair still follows, and those unheld this time.
#[derive(Debug, PartialEq, Eq)]
struct ClosedListeners {
    /// Unheld at this scan and the one before, or refused by the quota.
    gone: BTreeSet<(u32, u16)>,
    /// Ports of the pairs that stay: their `LISTEN_PORTS` mark stays.
    ports_kept: BTreeSet<u16>,
    /// Unheld for the first time: removed at the next scan if still so.
    unheld: BTreeSet<(u32, u16)>,
}

/// Pure: the kernel's pairs `in_kernel`, the pairs a traced process `held`
/// at this scan within its share, those `unheld_before` at the last one,
/// and those `refused` past their workload's share (gone at once).
fn closed_listeners(
    in_kernel: &BTreeSet<(u32, u16)>,
    held: &BTreeSet<(u32, u16)>,
    unheld_before: &BTreeSet<(u32, u16)>,
    refused: &BTreeSet<(u32, u16)>,
) -> ClosedListeners {
    let unheld_now: BTreeSet<(u32, u16)> = in_kernel.difference(held).copied().collect();
    let gone: BTreeSet<(u32, u16)> = unheld_now
        .iter()
        .filter(|p| unheld_before.contains(p) || refused.contains(p))
        .copied()
        .collect();
    ClosedListeners {
        ports_kept: in_kernel.difference(&gone).map(|&(_, port)| port).collect(),
        unheld: unheld_now.difference(&gone).copied().collect(),
        gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(u32, u16)]) -> BTreeSet<(u32, u16)> {
        list.iter().copied().collect()
    }

    #[test]
    fn a_listener_unheld_at_two_scans_goes_and_one_unheld_once_stays() {
        let in_kernel = pairs(&[(1, 80), (2, 80), (1, 81), (3, 82)]);
        let held = pairs(&[(1, 80)]);
        // (2, 80) and (1, 81) were unheld at the last scan too; (3, 82) is
        // new in the map (a listen() after the /proc read), so it stays.
        let before = pairs(&[(2, 80), (1, 81), (9, 9)]);
        let closed = closed_listeners(&in_kernel, &held, &before, &BTreeSet::new());
        assert_eq!(closed.gone, pairs(&[(2, 80), (1, 81)]));
        assert_eq!(closed.unheld, pairs(&[(3, 82)]));
        // Port 80 is still followed in namespace 1: its mark stays; 81 goes.
        assert_eq!(closed.ports_kept, [80, 82].into_iter().collect());
        // Refused past its workload's share: gone at the first scan.
        let closed = closed_listeners(&in_kernel, &held, &before, &pairs(&[(3, 82)]));
        assert_eq!(closed.gone, pairs(&[(2, 80), (1, 81), (3, 82)]));
        assert!(closed.unheld.is_empty());
        assert_eq!(closed.ports_kept, [80].into_iter().collect());
    }

    #[test]
    fn thousands_of_ports_closed_leave_the_map_empty_after_two_scans() {
        let opened: BTreeSet<(u32, u16)> = (0..4000u16).map(|port| (7, 10_000 + port)).collect();
        let nothing = BTreeSet::new();
        let first = closed_listeners(&opened, &nothing, &nothing, &nothing);
        assert!(first.gone.is_empty());
        let second = closed_listeners(&opened, &nothing, &first.unheld, &nothing);
        assert_eq!(second.gone, opened);
        assert!(second.unheld.is_empty() && second.ports_kept.is_empty());
    }

    fn cgroups(paths: &[&str]) -> SegmentReach {
        SegmentReach::Cgroups(paths.iter().map(|p| p.to_string()).collect())
    }

    #[test]
    fn segments_follow_the_cgroups_unless_one_is_the_root() {
        let one = |path: &str| (1, Some(path.to_string()));
        assert_eq!(
            segment_reach([one("/a.service"), one("/k/pod1")].into_iter()),
            cgroups(&["/a.service", "/k/pod1"])
        );
        for host in [
            vec![one("/a.service"), one("/")],
            vec![(2, None)],
            vec![one("/../outside")],
        ] {
            assert!(
                matches!(
                    segment_reach(host.clone().into_iter()),
                    SegmentReach::Host(_)
                ),
                "{host:?}"
            );
        }
    }

    #[test]
    fn listeners_add_their_cgroups() {
        let l = |p: Option<&str>, port| (p.map(str::to_string), port);
        // Socket activation: the listener in the socket unit's cgroup.
        assert_eq!(
            with_listeners(
                cgroups(&["/app.service"]),
                [l(Some("/app.socket"), 80), l(Some("/app.service"), 81)].iter()
            ),
            cgroups(&["/app.service", "/app.socket"])
        );
        // Not named: left as it is (the self-check watches).
        assert_eq!(
            with_listeners(cgroups(&["/a"]), [l(None, 80)].iter()),
            cgroups(&["/a"])
        );
        // Made in the root cgroup: host-wide, saying which port.
        let SegmentReach::Host(why) = with_listeners(cgroups(&["/a"]), [l(Some("/"), 80)].iter())
        else {
            panic!("a listener in the root cgroup stays scoped");
        };
        assert!(why.contains("port 80"), "{why}");
        // Host-wide already: stays.
        let host = SegmentReach::Host("--port".into());
        assert_eq!(
            with_listeners(host.clone(), [l(Some("/b"), 80)].iter()),
            host
        );
    }
}
