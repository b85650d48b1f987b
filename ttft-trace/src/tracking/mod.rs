//! Tracking: which processes, libraries and ports are traced. It owns the
//! loaded probes and their kernel maps, and composes four parts, each over
//! the probes: the workloads and their processes ([`processes`]), the
//! libraries they map and the probes on them ([`libraries`], with the
//! launch layer's state in [`launch_layer`]), the ports followed and where
//! segments are seen ([`ports`]), and the readings of the kernel's
//! counters ([`counters`]). The mode is data: `attach` traces one given
//! tree, `daemon` discovers workloads as they appear ([`discovery`]). What
//! changes is queued as [`Change`]s for the session to hand to routing and
//! the sinks.

mod counters;
mod discovery;
mod launch_layer;
mod libraries;
mod ports;
mod processes;
mod quotas;
mod wait;

use std::{collections::HashSet, sync::Arc, time::Instant};

use anyhow::{Result, bail};
use aya::maps::{MapData, RingBuf};
use ttft_trace_common::{GpuCounters, Stat};

pub use counters::{KernelReading, KernelStats};
pub use discovery::Discovery;
pub use wait::WaitFor;

use crate::{
    host::targets,
    probes::{
        Attached, Probes,
        libraries::{Library, ReadStats},
    },
    workloads::ProcessSeen,
};
use counters::KernelCounters;
use libraries::Libraries;
use ports::Ports;
use processes::Workloads;
use quotas::Quotas;

/// What is traced: one process tree, or whatever discovery finds.
pub enum Mode {
    /// The probes are bound to each traced process unless
    /// `host_wide_probes` (see [`crate::probes::Reach`]).
    Attach {
        host_wide_probes: bool,
    },
    Daemon(Discovery),
}

/// What tracking changed, for routing and the sinks.
#[derive(Debug)]
pub enum Change {
    /// A new workload: its root and the members known now.
    Started {
        root: u32,
        members: Vec<u32>,
        /// The root as read when it was found.
        seen: ProcessSeen,
    },
    /// A process joined a workload already traced.
    Joined { pid: u32, root: u32 },
    /// Probes were attached to a library.
    Attached(Attached),
    /// A library's probes were detached: no traced process mapped it for
    /// the daemon's `detach_unmapped` period.
    Detached(Attached),
}

/// The live traced processes, each with its workload, and the libraries
/// probed, after a rescan.
pub struct Rescan {
    pub live: Vec<(u32, u32)>,
    pub runtime_libs: usize,
    pub driver_libs: usize,
    /// What the library scanner gave up reading so far.
    pub reads: ReadStats,
}

pub struct Tracking {
    probes: Probes,
    mode: Mode,
    workloads: Workloads,
    libraries: Libraries,
    ports: Ports,
    quotas: Quotas,
    counters: KernelCounters,
    changes: Vec<Change>,
}

impl Tracking {
    pub fn new(probes: Probes, mode: Mode, shares: crate::config::Quotas) -> Self {
        // Daemon: workloads are found by what they call, so the probes
        // fire host-wide (see `Libraries::reach`).
        let host_wide = !matches!(
            mode,
            Mode::Attach {
                host_wide_probes: false
            }
        );
        Self {
            probes,
            mode,
            workloads: Workloads::default(),
            libraries: Libraries::new(host_wide),
            ports: Ports::default(),
            quotas: Quotas::new(shares),
            counters: KernelCounters::default(),
            changes: Vec::new(),
        }
    }

    /// The ring buffer the probes write to (taken once).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        Ok(self.probes.take_events()?)
    }

    /// The tenant (pod, else cgroup) of the traced workload rooted at
    /// `root`, as found at the last scan.
    pub fn tenant_of(&self, root: u32) -> Option<&crate::workloads::quota::Tenant> {
        self.quotas.tenant_of(root)
    }

    /// The workload the kernel keeps for `tgid`, exited or not.
    pub fn workload_of(&self, tgid: u32) -> Option<u32> {
        self.probes.workload_of(tgid).ok().flatten()
    }

    /// What changed since the last call.
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// Whether tracing ends with the last workload (`attach`).
    pub fn ends_with_last_workload(&self) -> bool {
        matches!(self.mode, Mode::Attach { .. })
    }

    pub fn workloads(&self) -> usize {
        self.workloads.count()
    }

    /// The entries each per-target table of tracking holds now: (table,
    /// entries), for `ttft_trace_table_entries{table}`.
    pub fn table_entries(&self) -> Vec<(&'static str, usize)> {
        let mut t = vec![
            ("traced_workloads", self.workloads.count()),
            ("exited_processes", self.workloads.exited_seen()),
            ("segment_cgroups", self.probes.segment_cgroups()),
        ];
        t.extend(self.quotas.table_entries());
        t.extend(self.ports.table_entries());
        t.extend(self.libraries.table_entries());
        t
    }

    /// What the library scanner gave up reading so far.
    pub fn read_stats(&self) -> ReadStats {
        self.libraries.read_stats()
    }

    /// Everything the kernel counted since the start.
    pub fn counter_totals(&self) -> &GpuCounters {
        self.counters.gpu_totals()
    }

    /// The /proc scan period in daemon mode (`None`: no periodic scan).
    pub fn discovery_period(&self) -> Option<std::time::Duration> {
        match &self.mode {
            Mode::Daemon(d) => d.period,
            Mode::Attach { .. } => None,
        }
    }

    /// Starts tracing the workload rooted at `root`: the root and its
    /// descendants are tracked (the kernel adds later children).
    pub fn add_workload(&mut self, root: u32) -> Result<()> {
        self.workloads
            .add(&mut self.probes, root, &mut self.changes)
    }

    /// Attaches the probes to libraries named by `--cuda-lib`: a path that is
    /// no CUDA library is the user's error. In `attach` mode they are bound
    /// to each traced process at its scan, as found libraries are.
    pub fn attach_named(&mut self, paths: &[std::path::PathBuf]) -> Result<()> {
        let at_once = matches!(self.mode, Mode::Daemon(_));
        self.libraries
            .attach_named(&mut self.probes, paths, at_once, &mut self.changes)
    }

    /// Follows connections accepted on the ports the traced processes
    /// listen on now (later `listen()` calls are seen in the kernel) and on
    /// `extra` ports.
    pub fn follow_ports(&mut self, extra: &[u16]) -> Result<()> {
        let live = self.live_processes()?;
        self.ports
            .follow(&mut self.probes, &live, extra, &mut self.quotas)
    }

    /// Live processes among the tracked ids, each with its workload; ids of
    /// exited processes and of threads are dropped from the kernel's map on
    /// the way.
    pub fn live_processes(&mut self) -> Result<Vec<(u32, u32)>> {
        Workloads::live(&mut self.probes)
    }

    /// Hands the heap freed after inspecting new files, or after a
    /// workload ended, back to the system (see
    /// `Libraries::release_memory`).
    pub fn release_memory(&mut self, workload_ended: bool) {
        self.libraries.release_memory(workload_ended);
    }

    /// Scans every traced process and attaches libraries not seen before;
    /// detaches the probes no traced process needs any more.
    pub fn rescan(&mut self) -> Result<Rescan> {
        self.workloads.mark_census();
        let census = Workloads::census(&mut self.probes)?;
        self.quotas.share_tracked(&mut self.probes, &census)?;
        let live = census.live;
        self.libraries
            .probe_live(&mut self.probes, &live, &mut self.changes);
        let pids: Vec<u32> = live.iter().map(|(pid, _)| *pid).collect();
        self.ports.scope_segments(&mut self.probes, &pids)?;
        let unmapped = match &self.mode {
            Mode::Daemon(d) => Some(d.detach_unmapped),
            Mode::Attach { .. } => None,
        };
        self.libraries
            .detach_gone(&mut self.probes, &live, unmapped, &mut self.changes);
        let (runtime_libs, driver_libs) = Libraries::probed_cuda(&self.probes);
        Ok(Rescan {
            live,
            runtime_libs,
            driver_libs,
            reads: self.read_stats(),
        })
    }

    /// Reads the kernel's counters and statistics; forgets processes that
    /// are gone once their last reading is taken.
    pub fn read_kernel(&mut self, live: &[(u32, u32)]) -> Result<KernelReading> {
        let probes = &mut self.probes;
        let gpu = self.counters.read_gpu(probes, live)?;
        self.libraries
            .choose_launch_layer(probes, &gpu.reading, &gpu.gone);
        let sched = self.counters.read_sched(probes, live)?;
        let (runq_buckets, runq_sum_ns) = probes.runq_histogram()?;
        let segments_unseen = probes.stat(Stat::SegmentsUnseen)?;
        let listener_unseen = probes.stat(Stat::ListenerUnseen)?;
        let pids: Vec<u32> = live.iter().map(|(p, _)| *p).collect();
        self.ports
            .check_listeners(probes, listener_unseen, &pids, &self.quotas)?;
        Ok(KernelReading {
            deltas: gpu.deltas,
            gone: gpu.gone,
            stats: KernelStats {
                sched,
                runq_buckets,
                runq_sum_ns,
                events_lost: probes.stat(Stat::RingbufLost)?,
                segments_unseen,
                thread_state_dropped: probes.stat(Stat::ThreadStateFull)?,
                h2_frames_dropped: probes.stat(Stat::H2FramesDropped)?,
                h2_walk_lost: probes.stat(Stat::H2WalkLost)?,
                tls_unbound: probes.stat(Stat::TlsUnbound)?,
                tls_held: probes.stat(Stat::TlsHeld)?,
                tls_held_sent: probes.stat(Stat::TlsHeldSent)?,
                map_full: probes.map_full()?,
                quota_exceeded: self.quotas.exceeded(probes)?,
                listeners_followed: self.ports.followed(),
            },
        })
    }

    /// The workloads none of whose processes is alive: no longer traced.
    pub fn ended(&mut self, live: &[(u32, u32)]) -> Vec<u32> {
        self.workloads.ended(live)
    }

    /// Drops the kernel's workload of processes that exited before the
    /// previous call (see `Workloads::forget_exited`).
    pub fn forget_exited(&mut self) -> Result<()> {
        self.workloads.forget_exited(&mut self.probes)
    }

    /// Forgets the announced processes that exited (turned down: not
    /// traced), so that the kernel's map holds live processes only and a
    /// process reusing one of their pids is announced again.
    pub fn forget_announced_exited(&mut self) -> Result<()> {
        if !matches!(self.mode, Mode::Daemon(_)) {
            return Ok(());
        }
        Workloads::forget_announced_exited(&mut self.probes)
    }

    /// Forgets that the kernel announced `members` of an ended workload,
    /// so that a process reusing one of their pids is announced again.
    pub fn forget_announced(&mut self, members: impl Iterator<Item = u32>) {
        Workloads::forget_announced(&mut self.probes, members);
    }

    /// Notes a process the kernel announced, to consider at the next
    /// [`Tracking::consider_announced`]: in `daemon` mode an untraced
    /// process calling into a probed library, in `attach` mode a child (or
    /// thread) of a traced process.
    pub fn announce(&mut self, pid: u32) {
        self.workloads.announce(pid);
    }

    /// Daemon mode: one pass over /proc ([`Discovery::candidates`]); each
    /// process found is considered.
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
        for (pid, libs) in d.candidates(&tracked, &mut self.libraries) {
            self.consider(pid, libs)?;
        }
        // Servers often listen only after loading their model: the kernel
        // follows a port from the listen() call on, this names it.
        self.follow_ports(&[])
    }

    /// The processes the kernel announced since the last call.
    pub fn consider_announced(&mut self) -> Result<()> {
        for pid in self.workloads.take_announced() {
            match &self.mode {
                // A new thread shares its process's probes.
                Mode::Attach { .. } if targets::is_process(pid) => {
                    self.libraries
                        .probe_process(&mut self.probes, pid, &mut self.changes);
                }
                Mode::Attach { .. } => {}
                Mode::Daemon(d) => {
                    if self.probes.tracked_workload(pid)?.is_some() || d.turns_down(pid) {
                        continue;
                    }
                    let Ok(scan) = self.libraries.scan(pid) else {
                        continue;
                    };
                    log::debug!(
                        "pid {pid} announced by the kernel (a CUDA call through a probed library)"
                    );
                    self.consider(pid, scan.libraries)?;
                }
            }
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
        let root = d.root_of(pid, &mut self.libraries);
        let listens_as_asked = d.listens_as_asked(root);
        let (probes, changes) = (&mut self.probes, &mut self.changes);
        let existing = probes
            .tracked_workload(root)?
            .filter(|&w| self.workloads.is_traced(w));
        // Its workload's tenant at its share of TRACKED: not tracked
        // (counted once), tried again at each scan.
        if !self.quotas.admits_process(existing.unwrap_or(root), pid) {
            return Ok(());
        }
        if let Some(existing) = existing {
            Workloads::join(probes, pid, existing, changes)?;
            for lib in &libs {
                self.libraries.attach_found(probes, lib, pid, changes);
            }
            return Ok(());
        }
        if !listens_as_asked {
            log::debug!("not tracing pid {root} yet: it listens on none of the ports");
            return Ok(());
        }
        for lib in &libs {
            self.libraries.attach_found(probes, lib, pid, changes);
        }
        self.add_workload(root)?;
        self.follow_ports(&[])
    }

    /// Returns at once when a CUDA library is probed already. Otherwise
    /// blocks (asynchronously) until one appears in the tree, the target
    /// exits, or the timeout passes; without `--wait`, explains what was
    /// searched.
    pub async fn wait_for_library(&mut self, cfg: &WaitFor) -> Result<()> {
        if self.probes.attached().next().is_some() {
            return Ok(());
        }
        if !cfg.wait {
            let live = self.live_processes()?;
            let (searched, denied) = self.libraries.searched(&live);
            return Err(wait::nothing_found(cfg, live.len(), &searched, &denied));
        }
        log::info!("waiting for pid {} to load a CUDA library", cfg.pid);
        let deadline = cfg.timeout.map(|t| Instant::now() + t);
        loop {
            tokio::time::sleep(wait::WAIT_POLL).await;
            if self.live_processes()?.is_empty() {
                bail!("pid {} exited before loading a CUDA library", cfg.pid);
            }
            self.rescan()?;
            if self.probes.attached().next().is_some() {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                bail!(
                    "no CUDA library appeared in pid {} within the --wait-timeout",
                    cfg.pid
                );
            }
        }
    }
}
