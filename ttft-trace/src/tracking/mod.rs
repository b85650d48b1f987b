//! Tracking: which processes, libraries and ports are traced. It owns the
//! loaded probes and their kernel maps: it tracks workloads' processes,
//! attaches the probes to the CUDA libraries they map, follows their
//! listening ports and reads the kernel's counters. The mode is data:
//! `attach` traces one given tree, `daemon` discovers workloads as they
//! appear ([`discovery`]). What changes is queued as [`Change`]s for the
//! session to hand to routing and the sinks.

mod counters;
mod discovery;
mod segments;
mod wait;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    num::NonZeroU32,
    sync::Arc,
    time::Instant,
};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use ttft_trace_common::{GpuCounters, Stat, signals::SchedTotals};

pub use discovery::Discovery;
pub use wait::WaitFor;

use crate::{
    host::ports,
    host::targets,
    probes::{
        Attached, ProbeError, Probes, Reach,
        cuda::{self, launch_layer},
        libraries::FileId,
        libraries::{self, Library, Scanner},
    },
};
use counters::CounterTracker;

/// A library no scan has found mapped for this long, and not probed, is
/// forgotten (its file closed; see [`Scanner::forget_unused`]).
const UNUSED_LIBRARY: std::time::Duration = std::time::Duration::from_secs(60);

/// What is traced: one process tree, or whatever discovery finds.
pub enum Mode {
    /// The probes are bound to each traced process unless
    /// `host_wide_probes` (see [`Reach`]).
    Attach {
        host_wide_probes: bool,
    },
    Daemon(Discovery),
}

/// What tracking changed, for routing and the sinks.
#[derive(Debug)]
pub enum Change {
    /// A new workload: its root and the members known now.
    Started { root: u32, members: Vec<u32> },
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
}

/// What the kernel counted since the last reading.
pub struct KernelReading {
    /// Growth of each process's CUDA counters.
    pub deltas: BTreeMap<u32, GpuCounters>,
    /// Exited processes whose last counters are now read and dropped.
    pub gone: Vec<u32>,
    pub stats: KernelStats,
}

/// The kernel's host-wide statistics.
#[derive(Debug, Default, Clone)]
pub struct KernelStats {
    /// Scheduler totals of every traced process, exited ones included.
    pub sched: SchedTotals,
    /// The run-queue delay histogram (log2 buckets) and its sum.
    pub runq_buckets: Vec<u64>,
    pub runq_sum_ns: u64,
    pub events_lost: u64,
    /// Followed connections read with none of their segments seen.
    pub segments_unseen: u64,
    pub thread_state_dropped: u64,
    /// Inserts refused by a full kernel map, per map.
    pub map_full: Vec<(&'static str, u64)>,
}

pub struct Tracking {
    probes: Probes,
    scanner: Scanner,
    mode: Mode,
    /// Roots of the workloads traced now.
    roots: BTreeSet<u32>,
    /// (network namespace, port) followed; None: every namespace.
    listen_ports: BTreeSet<(Option<u32>, u16)>,
    /// Ports followed by `--port`: their servers may run anywhere, so
    /// segments are seen host-wide.
    extra_ports: bool,
    listeners: segments::ListenerCgroups,
    counters: CounterTracker,
    /// Last scheduler totals read per process still in the kernel's map,
    /// and the sum of those gone from it, so that the exported counters
    /// never go back and the table stays as small as the kernel's map.
    sched_totals: BTreeMap<u32, SchedTotals>,
    sched_gone: SchedTotals,
    /// Processes announced by the kernel (daemon mode), to consider.
    announced: Vec<u32>,
    /// Files the scanner had inspected at the last [`Tracking::release_memory`].
    files_seen: usize,
    /// When a traced process was last seen mapping each probed file, and
    /// the files named by the user (kept however long no one maps them).
    last_mapped: HashMap<FileId, Instant>,
    named: HashSet<FileId>,
    /// The libraries named by the user, in `attach` mode: bound to each
    /// traced process.
    named_libs: Vec<Arc<Library>>,
    /// Exited processes the kernel kept a workload for at the last
    /// [`Tracking::forget_exited`].
    exited_seen: BTreeSet<u32>,
    /// Traced processes whose launches are left to the driver's probes
    /// ([`launch_layer`]), and with host-wide probes, the runtime files.
    driver_launches: BTreeSet<u32>,
    driver_launch_files: HashSet<FileId>,
    /// The runtime libraries each live traced process maps, at its last
    /// scan: whose evidence speaks for a file's host-wide probes.
    runtime_files: HashMap<u32, Vec<FileId>>,
    changes: Vec<Change>,
}

impl Tracking {
    pub fn new(probes: Probes, mode: Mode) -> Self {
        Self {
            probes,
            scanner: Scanner::default(),
            mode,
            roots: BTreeSet::new(),
            listen_ports: BTreeSet::new(),
            extra_ports: false,
            listeners: segments::ListenerCgroups::default(),
            counters: CounterTracker::default(),
            sched_totals: BTreeMap::new(),
            sched_gone: SchedTotals::default(),
            announced: Vec::new(),
            exited_seen: BTreeSet::new(),
            driver_launches: BTreeSet::new(),
            driver_launch_files: HashSet::new(),
            runtime_files: HashMap::new(),
            files_seen: 0,
            last_mapped: HashMap::new(),
            named: HashSet::new(),
            named_libs: Vec::new(),
            changes: Vec::new(),
        }
    }

    /// The ring buffer the probes write to (taken once).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        Ok(self.probes.take_events()?)
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
        self.roots.len()
    }

    /// Everything the kernel counted since the start.
    pub fn counter_totals(&self) -> &GpuCounters {
        self.counters.total()
    }

    /// Starts tracing the workload rooted at `root`: the root and its
    /// descendants are tracked (the kernel adds later children).
    pub fn add_workload(&mut self, root: u32) -> Result<()> {
        // Track first, then list the children: a child forked in between is
        // then tracked by the kernel and found by the listing. A full map
        // refuses the root (counted): it is not a workload, and a later scan
        // tries again.
        if !self.probes.track(root, root)? {
            return Ok(());
        }
        let members = targets::descendants(root);
        for child in &members {
            self.probes.track(*child, root)?;
        }
        self.roots.insert(root);
        self.changes.push(Change::Started { root, members });
        Ok(())
    }

    /// Which processes the probes put on a library for process `pid` fire
    /// in: `attach` binds them to each traced process, so that the other
    /// processes of the host that map the same file take no trap; `daemon`
    /// finds its workloads by what they call, so its probes fire host-wide
    /// (the kernel's filter drops what is not traced).
    fn reach(&self, pid: u32) -> Reach {
        match NonZeroU32::new(pid) {
            Some(pid) if !self.host_wide() => Reach::Process(pid),
            _ => Reach::Host,
        }
    }

    /// Whether the probes fire host-wide rather than per traced process.
    fn host_wide(&self) -> bool {
        !matches!(
            self.mode,
            Mode::Attach {
                host_wide_probes: false
            }
        )
    }

    /// Attaches the probes to `lib` for `reach` unless they are there.
    fn attach(&mut self, lib: &Library, reach: Reach) -> Result<()> {
        if let Some(a) = self.probes.attach_library(lib, reach)? {
            self.changes.push(Change::Attached(a));
        }
        Ok(())
    }

    /// Attaches the probes to libraries named by `--cuda-lib`: a path that is
    /// no CUDA library is the user's error. In `attach` mode they are bound
    /// to each traced process at its scan, as found libraries are.
    pub fn attach_named(&mut self, paths: &[std::path::PathBuf]) -> Result<()> {
        for path in paths {
            let lib = libraries::inspect(path, path)?.with_context(|| {
                format!(
                    "{} defines none of the CUDA entry points ttft-trace probes \
                     (cudaLaunchKernel, cudaGraphLaunch or cuLaunchKernel)",
                    path.display()
                )
            })?;
            self.named.insert(lib.id.clone());
            match self.mode {
                Mode::Attach { .. } => self.named_libs.push(Arc::new(lib)),
                Mode::Daemon(_) => self.attach(&lib, Reach::Host)?,
            }
        }
        Ok(())
    }

    /// Attaches the probes to a library found in process `pid`'s mappings
    /// (or named). The process may exit meanwhile (its /proc path is then
    /// gone): a warning, and a later scan of another process tries again.
    fn attach_found(&mut self, lib: &Library, pid: u32) {
        self.last_mapped.insert(lib.id.clone(), Instant::now());
        match self.attach(lib, self.reach(pid)) {
            Ok(()) => {}
            Err(e) if matches!(e.downcast_ref(), Some(ProbeError::ProcessGone(_))) => {
                log::debug!("{e}");
            }
            Err(e) => log::warn!("could not attach to {}: {e:#}", lib.path.display()),
        }
    }

    /// Follows connections accepted on the ports the traced processes
    /// listen on now (later `listen()` calls are seen in the kernel) and on
    /// `extra` ports.
    pub fn follow_ports(&mut self, extra: &[u16]) -> Result<()> {
        let live: Vec<u32> = self.live_processes()?.iter().map(|(p, _)| *p).collect();
        self.extra_ports |= !extra.is_empty();
        let held = ports::listening_sockets(&live);
        self.find_listener_cgroups(&held);
        // Before the ports: a connection accepted in between has its
        // segments seen.
        self.scope_segments(&live)?;
        let mut found: BTreeSet<(Option<u32>, u16)> =
            held.iter().map(|l| (l.netns, l.port)).collect();
        found.extend(extra.iter().map(|&port| (None, port)));
        let mut new = Vec::new();
        for (netns, port) in found {
            // A port refused (its map full) is tried again at the next scan.
            if !self.listen_ports.contains(&(netns, port))
                && self.probes.add_listen_port(netns, port)?
            {
                self.listen_ports.insert((netns, port));
                new.push(port.to_string());
            }
        }
        if !new.is_empty() {
            log::info!("following requests on port(s) {}", new.join(", "));
        }
        Ok(())
    }

    /// Live processes among the tracked ids, each with its workload; ids of
    /// exited processes and of threads are dropped from the kernel's map on
    /// the way.
    pub fn live_processes(&mut self) -> Result<Vec<(u32, u32)>> {
        let mut live = Vec::new();
        for (id, root) in self.probes.tracked()? {
            if targets::is_process(id) {
                live.push((id, root));
            } else if !std::path::Path::new(&format!("/proc/{id}")).exists() {
                self.probes.untrack(id)?;
            }
        }
        Ok(live)
    }

    /// Hands the heap freed after inspecting new files, or after a
    /// workload ended (`workload_ended`: its connections, requests and
    /// label sets), back to the system. Reading an ELF file's symbol tables
    /// (tens of MiB for a Python or PyTorch library) leaves the allocator's
    /// arenas that large for good otherwise: the daemon's RSS stayed at its
    /// high-water mark, and did not show what it holds.
    pub fn release_memory(&mut self, workload_ended: bool) {
        let seen = self.scanner.files_seen();
        if seen != self.files_seen || workload_ended {
            self.files_seen = seen;
            // SAFETY: malloc_trim(3) has no preconditions; 0 keeps no pad.
            unsafe { libc::malloc_trim(0) };
        }
    }

    /// Scans every traced process and attaches libraries not seen before.
    pub fn rescan(&mut self) -> Result<Rescan> {
        let live = self.live_processes()?;
        self.runtime_files
            .retain(|pid, _| live.iter().any(|(p, _)| p == pid));
        for (pid, _) in &live {
            self.probe_process(*pid);
        }
        let pids: Vec<u32> = live.iter().map(|(pid, _)| *pid).collect();
        self.scope_segments(&pids)?;
        self.detach_exited(&live);
        self.detach_unmapped();
        let probed: HashSet<FileId> = self.probes.attached_files().cloned().collect();
        let named = &self.named;
        let forgotten = self.scanner.forget_unused(UNUSED_LIBRARY, |id| {
            probed.contains(id) || named.contains(id)
        });
        if forgotten > 0 {
            log::debug!("forgot {forgotten} libraries no process maps (their files closed)");
        }
        let (mut runtime_libs, mut driver_libs) = (0, 0);
        for a in self.probes.attached() {
            runtime_libs += usize::from(a.apis.contains(&&cuda::RUNTIME));
            driver_libs += usize::from(a.apis.contains(&&cuda::DRIVER));
        }
        Ok(Rescan {
            live,
            runtime_libs,
            driver_libs,
        })
    }

    /// Attaches the probes to the libraries traced process `pid` maps (and,
    /// in `attach` mode, to the named ones) where they are not yet.
    fn probe_process(&mut self, pid: u32) {
        let Ok(scan) = self.scanner.scan(pid) else {
            return;
        };
        let named = self.named_libs.clone();
        let runtimes = scan.libraries.iter().chain(&named);
        let runtimes = runtimes.filter(|l| l.is(&cuda::RUNTIME));
        self.runtime_files
            .insert(pid, runtimes.map(|l| l.id.clone()).collect());
        for lib in scan.libraries.iter().chain(&named) {
            self.attach_found(lib, pid);
        }
    }

    /// Detaches the probes bound to traced processes that exited.
    fn detach_exited(&mut self, live: &[(u32, u32)]) {
        let alive: HashSet<u32> = live.iter().map(|(pid, _)| *pid).collect();
        for a in self.probes.detach_processes(|pid| alive.contains(&pid)) {
            self.changes.push(Change::Detached(a));
        }
    }

    /// In daemon mode, detaches the probes of files no traced process has
    /// mapped for the `detach_unmapped` period (every live process was
    /// scanned just before; one whose scan failed keeps nothing alive, but
    /// the period is far longer than a scan). The files named by the user
    /// stay probed.
    fn detach_unmapped(&mut self) {
        let Mode::Daemon(discovery) = &self.mode else {
            return;
        };
        let period = discovery.detach_unmapped;
        let unmapped: Vec<FileId> = self
            .probes
            .attached_files()
            .filter(|id| !self.named.contains(*id))
            .filter(|id| {
                self.last_mapped
                    .get(*id)
                    .is_none_or(|t| t.elapsed() >= period)
            })
            .cloned()
            .collect();
        for id in unmapped {
            self.last_mapped.remove(&id);
            self.driver_launch_files.remove(&id);
            if let Some(a) = self.probes.detach_library(&id) {
                self.changes.push(Change::Detached(a));
            }
        }
    }

    /// Reads the kernel's counters and statistics; forgets processes that
    /// are gone once their last reading is taken.
    pub fn read_kernel(&mut self, live: &[(u32, u32)]) -> Result<KernelReading> {
        let reading = self.probes.counters()?;
        let deltas = self.counters.update(&reading);
        let mut gone = Vec::new();
        for tgid in reading.keys() {
            if !live.iter().any(|(p, _)| p == tgid) && !targets::is_process(*tgid) {
                self.probes.drop_counters(*tgid)?;
                self.counters.forget(*tgid);
                self.driver_launches.remove(tgid);
                gone.push(*tgid);
            }
        }
        self.choose_launch_layer(&reading);
        let now = self.probes.sched_totals()?;
        self.sched_totals.extend(now.iter().map(|(t, v)| (*t, *v)));
        // An exited process's last reading, or one the kernel's LRU map
        // dropped, joins the sum of those gone; the exited one's entry is
        // dropped from the map too (it would only wait for the LRU).
        let done: Vec<u32> = self
            .sched_totals
            .keys()
            .filter(|t| {
                !now.contains_key(t)
                    || (!live.iter().any(|(p, _)| p == *t) && !targets::is_process(**t))
            })
            .copied()
            .collect();
        for tgid in done {
            if let Some(t) = self.sched_totals.remove(&tgid) {
                self.sched_gone.add(&t);
            }
            if now.contains_key(&tgid) {
                self.probes.drop_sched_totals(tgid)?;
            }
        }
        let mut sched = self.sched_gone;
        for t in self.sched_totals.values() {
            sched.add(t);
        }
        let (runq_buckets, runq_sum_ns) = self.probes.runq_histogram()?;
        let segments_unseen = self.probes.stat(Stat::SegmentsUnseen)?;
        let listener_unseen = self.probes.stat(Stat::ListenerUnseen)?;
        let pids: Vec<u32> = live.iter().map(|(p, _)| *p).collect();
        self.check_listeners(listener_unseen, &pids)?;
        Ok(KernelReading {
            deltas,
            gone,
            stats: KernelStats {
                sched,
                runq_buckets,
                runq_sum_ns,
                events_lost: self.probes.stat(Stat::RingbufLost)?,
                segments_unseen,
                thread_state_dropped: self.probes.stat(Stat::ThreadStateFull)?,
                map_full: self.probes.map_full()?,
            },
        })
    }

    /// Leaves the launches of the processes whose runtime showed that they
    /// all reach the driver's probes to those alone ([`launch_layer`]):
    /// per process where the probes are bound to each, per file where they
    /// are host-wide.
    fn choose_launch_layer(&mut self, reading: &BTreeMap<u32, GpuCounters>) {
        if self.host_wide() {
            self.choose_launch_layer_per_file(reading);
            return;
        }
        for tgid in launch_layer::ready(reading, &self.driver_launches) {
            let Reach::Process(pid) = self.reach(tgid) else {
                continue;
            };
            self.driver_launches.insert(tgid);
            let dropped = self.probes.detach_programs(
                Reach::Process(pid),
                None,
                launch_layer::is_runtime_launch,
            );
            if dropped > 0 {
                let c = &reading[&tgid];
                log::info!(
                    "launches of pid {tgid} are traced at the driver from now: all {} of its \
                     runtime's launches reached it ({dropped} runtime launch probes detached)",
                    c.runtime_launches
                );
            }
        }
    }

    /// Host-wide probes: a runtime file's launch probes go once the traced
    /// processes that map it show, together, that its launches reach the
    /// driver's probes ([`launch_layer::file_ready`]).
    fn choose_launch_layer_per_file(&mut self, reading: &BTreeMap<u32, GpuCounters>) {
        let files: HashSet<&FileId> = self.runtime_files.values().flatten().collect();
        let mut ready = Vec::new();
        for file in files {
            if self.driver_launch_files.contains(file) {
                continue;
            }
            let users: Vec<&GpuCounters> = self
                .runtime_files
                .iter()
                .filter(|(_, files)| files.contains(file))
                .filter_map(|(pid, _)| reading.get(pid))
                .collect();
            if launch_layer::file_ready(&users) {
                ready.push((file.clone(), users.len()));
            }
        }
        for (file, users) in ready {
            let dropped = self.probes.detach_programs(
                Reach::Host,
                Some(&file),
                launch_layer::is_runtime_launch,
            );
            if dropped > 0 {
                let path = self
                    .probes
                    .attached_path(&file)
                    .map(|p| p.display().to_string());
                log::info!(
                    "launches through {} are traced at the driver from now: the {users} traced \
                     process(es) that map it showed all their runtime launches reach it \
                     ({dropped} runtime launch probes detached host-wide)",
                    path.as_deref().unwrap_or("a runtime")
                );
            }
            self.driver_launch_files.insert(file);
        }
    }

    /// The workloads none of whose processes is alive: no longer traced.
    pub fn ended(&mut self, live: &[(u32, u32)]) -> Vec<u32> {
        let alive: BTreeSet<u32> = live.iter().map(|(_, root)| *root).collect();
        let ended: Vec<u32> = self.roots.difference(&alive).copied().collect();
        for root in &ended {
            self.roots.remove(root);
        }
        ended
    }

    /// Drops the kernel's workload of processes that exited before the
    /// previous call: a whole rescan and drain have read their last events
    /// since. Bounds EXITED by the processes that exit in one period.
    pub fn forget_exited(&mut self) -> Result<()> {
        let now: BTreeSet<u32> = self.probes.exited()?.into_iter().collect();
        for tgid in now.intersection(&self.exited_seen) {
            self.probes.forget_exited(*tgid)?;
        }
        self.exited_seen = now.difference(&self.exited_seen).copied().collect();
        Ok(())
    }

    /// Forgets the announced processes that exited (turned down: not
    /// traced), so that the kernel's map holds live processes only and a
    /// process reusing one of their pids is announced again.
    pub fn forget_announced_exited(&mut self) -> Result<()> {
        if !matches!(self.mode, Mode::Daemon(_)) {
            return Ok(());
        }
        let gone: Vec<u32> = self
            .probes
            .announced()?
            .into_iter()
            .filter(|tgid| !std::path::Path::new(&format!("/proc/{tgid}")).exists())
            .collect();
        self.forget_announced(gone.into_iter());
        Ok(())
    }

    /// Forgets that the kernel announced `members` of an ended workload,
    /// so that a process reusing one of their pids is announced again.
    pub fn forget_announced(&mut self, members: impl Iterator<Item = u32>) {
        for tgid in members {
            if let Err(e) = self.probes.forget_announced(tgid) {
                log::debug!("forgetting announced {tgid}: {e}");
            }
        }
    }
}
