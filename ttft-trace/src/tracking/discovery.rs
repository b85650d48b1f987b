//! Discovery, the daemon's mode of tracking: every inference workload on the
//! host. Processes that map a CUDA library are found by a /proc scan (at
//! start, then every rescan period), and at once when an untraced process
//! calls into a library that already carries the probes (the kernel
//! announces it: a restarted server). Filters decide; the workload's root is
//! found; the loaded programs start following it, with no reload.

use std::{collections::HashSet, sync::Arc, time::Duration};

use anyhow::Result;

use super::{Change, Mode, Tracking};

/// Announced processes kept per turn of the event loop (see
/// [`Tracking::announce`]).
const MAX_ANNOUNCED: usize = 4096;
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
    /// How often /proc is scanned.
    pub period: Duration,
    /// Probes of a library no traced process has mapped this long are
    /// detached.
    pub detach_unmapped: Duration,
    /// The daemon and its ancestors.
    excluded: HashSet<u32>,
}

impl Discovery {
    pub fn new(filters: Filters, period: Duration, detach_unmapped: Duration) -> Self {
        Self {
            filters,
            period,
            detach_unmapped,
            excluded: discover::self_and_ancestors(),
        }
    }

    /// Whether `pid` is one the daemon never traces (itself, its
    /// ancestors), or one the comm or cgroup filter turns down now.
    fn turns_down(&self, pid: u32) -> bool {
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
}

impl Tracking {
    /// The /proc scan period in daemon mode.
    pub fn discovery_period(&self) -> Option<Duration> {
        match &self.mode {
            Mode::Daemon(d) => Some(d.period),
            Mode::Attach { .. } => None,
        }
    }

    /// Notes a process the kernel announced, to consider at the next
    /// [`Tracking::consider_announced`]: in `daemon` mode an untraced
    /// process calling into a probed library, in `attach` mode a child (or
    /// thread) of a traced process. Beyond [`MAX_ANNOUNCED`] a turn, the
    /// rest wait for the next /proc scan.
    pub fn announce(&mut self, pid: u32) {
        if self.announced.len() < MAX_ANNOUNCED {
            self.announced.push(pid);
        }
    }

    /// One pass over /proc: every untraced process that passes the comm and
    /// cgroup filters (cheap: two small files) and maps a CUDA library (a
    /// read of its /proc/PID/maps) is considered. Nothing is remembered of
    /// a process turned down: a shell may exec the server later.
    pub fn discover(&mut self) -> Result<()> {
        let Mode::Daemon(d) = &self.mode else {
            return Ok(());
        };
        let tracked: HashSet<u32> = self
            .probes
            .tracked()?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let mut found = Vec::new();
        for pid in discover::processes() {
            if pid <= 1 || tracked.contains(&pid) || d.turns_down(pid) {
                continue;
            }
            let Ok(scan) = self.scanner.scan(pid) else {
                continue;
            };
            if !scan.libraries.is_empty() {
                found.push((pid, scan.libraries));
            }
        }
        for (pid, libs) in found {
            self.consider(pid, libs)?;
        }
        // Servers often listen only after loading their model: the kernel
        // follows a port from the listen() call on, this names it.
        self.follow_ports(&[])
    }

    /// The processes the kernel announced since the last call.
    pub fn consider_announced(&mut self) -> Result<()> {
        if matches!(self.mode, Mode::Attach { .. }) {
            for pid in std::mem::take(&mut self.announced) {
                // A new thread shares its process's probes.
                if targets::is_process(pid) {
                    self.probe_process(pid);
                }
            }
            return Ok(());
        }
        for pid in std::mem::take(&mut self.announced) {
            let Mode::Daemon(d) = &self.mode else {
                return Ok(());
            };
            if self.probes.tracked_workload(pid)?.is_some() || d.turns_down(pid) {
                continue;
            }
            let Ok(scan) = self.scanner.scan(pid) else {
                continue;
            };
            log::debug!("pid {pid} announced by the kernel (a CUDA call through a probed library)");
            self.consider(pid, scan.libraries)?;
        }
        Ok(())
    }

    /// Decides on `pid`, which passed the filters and maps `libs`: the
    /// workload it belongs to (an existing one, or a new one rooted at its
    /// topmost serving ancestor), then probes and tracking.
    fn consider(&mut self, pid: u32, libs: Vec<Arc<Library>>) -> Result<()> {
        let Mode::Daemon(d) = &self.mode else {
            return Ok(());
        };
        let scanner = &mut self.scanner;
        let root = workload_root(pid, &d.excluded, |p| {
            scanner.scan(p).is_ok_and(|s| !s.libraries.is_empty())
                || !ports::listening_ports(&[p]).is_empty()
        });
        // Not remembered when refused: a server often listens only after
        // loading its model.
        let listens_as_asked = d.filters.ports.is_empty() || {
            let mut members = vec![root];
            members.extend(targets::descendants(root));
            d.filters.accepts_ports(&ports::listening_ports(&members))
        };
        if let Some(existing) = self.probes.tracked_workload(root)?
            && self.roots.contains(&existing)
        {
            // Refused by a full map: counted, and a later scan tries again.
            if self.probes.track(pid, existing)? {
                self.changes.push(Change::Joined {
                    pid,
                    root: existing,
                });
            }
            for lib in &libs {
                self.attach_found(lib, pid);
            }
            return Ok(());
        }
        if !listens_as_asked {
            log::debug!("not tracing pid {root} yet: it listens on none of the ports");
            return Ok(());
        }
        for lib in &libs {
            self.attach_found(lib, pid);
        }
        self.add_workload(root)?;
        self.follow_ports(&[])
    }
}
