//! Discovery, the daemon's mode of tracking: every inference workload on the
//! host. Processes that map a CUDA library are found by a /proc scan (at
//! start, then every rescan period unless it is 0), and at once when an untraced process
//! calls into a library that already carries the probes (the kernel
//! announces it: a restarted server). Filters decide; the workload's root is
//! found; the loaded programs start following it, with no reload.

use std::{collections::HashSet, sync::Arc, time::Duration};

use super::libraries::Libraries;
use crate::{
    host::ports,
    host::targets,
    probes::libraries::Library,
    workloads::{
        Filters,
        discover::{self, workload_root},
    },
};

/// The daemon's discovery state.
pub struct Discovery {
    filters: Filters,
    /// How often /proc is scanned; `None`: only at start.
    pub period: Option<Duration>,
    /// Probes of a library no traced process has mapped this long are
    /// detached.
    pub detach_unmapped: Duration,
    /// The daemon and its ancestors.
    excluded: HashSet<u32>,
}

impl Discovery {
    pub fn new(filters: Filters, period: Option<Duration>, detach_unmapped: Duration) -> Self {
        Self {
            filters,
            period,
            detach_unmapped,
            excluded: discover::self_and_ancestors(),
        }
    }

    /// Whether `pid` is one the daemon never traces (itself, its
    /// ancestors), or one the comm or cgroup filter turns down now.
    pub(super) fn turns_down(&self, pid: u32) -> bool {
        if self.excluded.contains(&pid) {
            return true;
        }
        match self.filters.reject_process(pid) {
            Some(why) => {
                log::trace!("not tracing pid {pid}: {why}");
                true
            }
            None => false,
        }
    }

    /// One pass over /proc: every untraced process that passes the comm and
    /// cgroup filters (cheap: two small files) and maps a CUDA library (a
    /// read of its /proc/PID/maps), with those libraries. Nothing is
    /// remembered of a process turned down: a shell may exec the server
    /// later.
    pub(super) fn candidates(
        &self,
        tracked: &HashSet<u32>,
        libraries: &mut Libraries,
    ) -> Vec<(u32, Vec<Arc<Library>>)> {
        let mut found = Vec::new();
        for pid in discover::processes() {
            if pid <= 1 || tracked.contains(&pid) || self.turns_down(pid) {
                continue;
            }
            let Ok(scan) = libraries.scan(pid) else {
                continue;
            };
            if !scan.libraries.is_empty() {
                found.push((pid, scan.libraries));
            }
        }
        found
    }

    /// The root of the workload `pid` belongs to: its topmost serving
    /// ancestor (one that maps a CUDA library or listens).
    pub(super) fn root_of(&self, pid: u32, libraries: &mut Libraries) -> u32 {
        workload_root(pid, &self.excluded, |p| {
            libraries.scan(p).is_ok_and(|s| !s.libraries.is_empty())
                || !ports::listening_ports(&[p]).is_empty()
        })
    }

    /// Whether the workload rooted at `root` listens on a port the filter
    /// asks for (any, where it names none). Not remembered when refused:
    /// a server often listens only after loading its model.
    pub(super) fn listens_as_asked(&self, root: u32) -> bool {
        self.filters.ports.is_empty() || {
            let mut members = vec![root];
            members.extend(targets::descendants(root));
            self.filters
                .accepts_ports(&ports::listening_ports(&members))
        }
    }
}
