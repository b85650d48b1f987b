//! `ttft-trace daemon`: every inference workload on the host. Processes
//! that map a CUDA library are found by a /proc scan (at start, then every
//! `rescan`), and at once when an untraced process calls into a library
//! that already carries the probes (the kernel announces it: a restarted
//! server). Filters decide; the workload's root is found; the loaded
//! programs start following it, with no reload.

use std::{collections::HashSet, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Result;

use super::{Session, Stop, TraceConfig};
use crate::{
    ports,
    probes::libraries::CudaLibrary,
    targets,
    workloads::{
        Filters,
        discover::{self, workload_root},
    },
};

pub struct DaemonOptions {
    pub filters: Filters,
    /// How often /proc is scanned for new CUDA processes.
    pub rescan: Duration,
    /// Libraries to probe from the start (e.g. not mapped by anyone yet).
    pub cuda_libs: Vec<PathBuf>,
    pub trace: TraceConfig,
}

/// The daemon's discovery state.
pub(super) struct Discovery {
    filters: Filters,
    /// The daemon and its ancestors.
    excluded: HashSet<u32>,
}

pub async fn daemon(opts: DaemonOptions) -> Result<Stop> {
    let (mut s, listener) = Session::start(&opts.trace, true)?;
    s.discovery = Some(Discovery {
        filters: opts.filters.clone(),
        excluded: discover::self_and_ancestors(),
    });
    s.attach_named(&opts.cuda_libs)?;
    s.discover()?;
    s.follow_ports(&opts.trace.ports)?;
    log::info!(
        "daemon: {} workload(s) at start; scanning /proc every {:?}",
        s.workloads.by_root.len(),
        opts.rescan
    );
    s.run_to_end(listener, &opts.trace, Some(opts.rescan), "daemon")
        .await
}

impl Session {
    /// One pass over /proc: every untraced process that passes the comm and
    /// cgroup filters (cheap: two small files) and maps a CUDA library (a
    /// read of its /proc/PID/maps) is considered. Nothing is remembered of
    /// a process turned down: a shell may exec the server later.
    pub(super) fn discover(&mut self) -> Result<()> {
        let tracked: HashSet<u32> = self
            .probes
            .tracked()?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        for pid in discover::processes() {
            if pid <= 1 || tracked.contains(&pid) || self.skipped(pid) || self.rejected(pid) {
                continue;
            }
            let Ok(scan) = self.scanner.scan(pid) else {
                continue;
            };
            if !scan.libraries.is_empty() {
                self.consider(pid, scan.libraries)?;
            }
        }
        // Servers often listen only after loading their model: the kernel
        // follows a port from the listen() call on, this names it.
        self.follow_ports(&[])
    }

    /// The processes the kernel announced since the last call.
    pub(super) fn consider_announced(&mut self) -> Result<()> {
        for pid in std::mem::take(&mut self.announced) {
            if self.probes.tracked_workload(pid)?.is_some()
                || self.skipped(pid)
                || self.rejected(pid)
            {
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

    /// The daemon itself and its ancestors.
    fn skipped(&self, pid: u32) -> bool {
        self.discovery
            .as_ref()
            .is_none_or(|d| d.excluded.contains(&pid))
    }

    /// Whether the comm or cgroup filter turns `pid` down now.
    fn rejected(&self, pid: u32) -> bool {
        let Some(why) = self
            .discovery
            .as_ref()
            .and_then(|d| d.filters.reject_process(pid))
        else {
            return false;
        };
        log::trace!("not tracing pid {pid}: {why}");
        true
    }

    /// Decides on `pid`, which passed the filters and maps `libs`: the workload it
    /// belongs to (an existing one, or a new one rooted at its topmost
    /// serving ancestor), then probes and tracking.
    fn consider(&mut self, pid: u32, libs: Vec<Arc<CudaLibrary>>) -> Result<()> {
        let Some(d) = self.discovery.as_ref() else {
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
            && self.workloads.by_root.contains_key(&existing)
        {
            self.probes.track(pid, existing)?;
            self.workloads.learn(pid, existing);
            for lib in &libs {
                self.attach_found(lib);
            }
            return Ok(());
        }
        if !listens_as_asked {
            log::debug!("not tracing pid {root} yet: it listens on none of the ports");
            return Ok(());
        }
        for lib in &libs {
            self.attach_found(lib);
        }
        self.add_workload(root)?;
        self.follow_ports(&[])
    }
}
