//! The tracing session shared by `attach` (one process tree) and `daemon`
//! (every inference workload on the host). It holds the four stages and
//! runs the event loop; every event passes them once, in this order:
//!
//! ring buffer -> [`Router`] (to its workload's correlator and signals)
//! -> [`Judge`] (evidence, causes, GPU readings) -> [`Sinks`] (Prometheus
//! series, JSONL, terminal).
//!
//! [`Tracking`] decides what is traced (processes, libraries, ports) and
//! reads the kernel's counters; its changes start and end workloads in
//! routing and the sinks.

use std::{
    net::TcpListener,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::SignalKind,
};

use crate::{
    config::TraceConfig,
    export::{Ending, Sinks, prometheus},
    host::clock::monotonic_ns,
    judging::{Judge, WorkloadSignals},
    probes,
    routing::{Routed, Router, Workload},
    schedstat::SchedSampler,
    tracking::{Change, Tracking},
};

/// How often the traced processes are rescanned for new CUDA libraries and
/// the kernel's counters are read.
const RESCAN: Duration = Duration::from_millis(250);
/// Copies of at least this many bytes are kept as swap-like traffic.
const LARGE_COPY_BYTES: u64 = 1 << 20;
/// How often the ring buffer is drained when the kernel has not woken us
/// (it does so only when the buffer fills past a threshold).
const DRAIN: Duration = Duration::from_millis(50);
/// Most records routed per turn of the loop (a few milliseconds of work),
/// so that a flood of events never keeps signals and timers waiting.
const DRAIN_BATCH: usize = 16384;
/// Turns of draining after the stop: what the kernel sent before it, not
/// a flood that goes on after.
const FINAL_DRAIN_TURNS: usize = 16;

/// Why tracing stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Duration,
    Signal,
    TargetExited,
}

mod start;
mod views;

pub use start::{attach, daemon};
use views::{kernel_view, library_view, workload_view};

struct Session {
    tracking: Tracking,
    router: Router,
    judge: Judge,
    sinks: Sinks,
    started: Instant,
    /// Taken by the loop; installed before the probes load, so that a
    /// signal right after attaching ends the session, not the process.
    signals: Option<Signals>,
    /// A record copied out of the ring buffer: reused, not one allocation
    /// per event.
    record: Vec<u8>,
    /// `--sched sampled`: the traced threads' `/proc` counters.
    sched_sampler: Option<Sampling>,
}

/// `--sched sampled`: the sampler, how often it reads, and when it last did.
struct Sampling {
    sampler: SchedSampler,
    period: Duration,
    last: tokio::time::Instant,
}

/// The signals the loop answers: SIGTERM and SIGINT stop, SIGHUP reopens
/// the JSONL file.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::signal;
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }
}

impl Session {
    /// Hands what tracking changed to routing and the sinks.
    fn apply_changes(&mut self) {
        for change in self.tracking.take_changes() {
            match change {
                Change::Started {
                    root,
                    members,
                    seen,
                } => {
                    let labels = self.sinks.workload_started(root, &seen);
                    let w = Workload::new(root, labels, &self.router.correlator);
                    self.router.workloads.insert(w);
                    for pid in members {
                        self.router.workloads.learn(pid, root);
                    }
                }
                Change::Joined { pid, root } => self.router.workloads.learn(pid, root),
                Change::Attached(a) => self.sinks.library_attached(&library_view(&a)),
                Change::Detached(a) => self.sinks.library_detached(&library_view(&a)),
            }
        }
    }

    /// Reads the sampled threads' counters (`--sched sampled`) and routes
    /// the spells they tell: always when `force`, else when a period has
    /// passed since the last reading. Every drain asks first, so that the
    /// spells are read before the requests it finishes are judged, and a
    /// drain that is due anyway spares the timer a wakeup of its own (30-50
    /// µs on a VM; rare while the ring buffer drains on its 50 ms timer).
    fn sample_sched(&mut self, force: bool) {
        let Some(s) = &mut self.sched_sampler else {
            return;
        };
        let now = tokio::time::Instant::now();
        if !force && now < s.last + s.period {
            return;
        }
        s.last = now;
        let (router, tracking) = (&mut self.router, &self.tracking);
        s.sampler.sample(monotonic_ns(), |ev| {
            router.route_sched(ev, |tgid| tracking.workload_of(tgid));
        });
    }

    /// When the sampler is next due (far away without one).
    fn next_sample(&self) -> tokio::time::Instant {
        match &self.sched_sampler {
            Some(s) => s.last + s.period,
            None => tokio::time::Instant::now() + Duration::from_secs(3600),
        }
    }

    /// Judges what routing queued and hands it to the sinks.
    fn dispatch(&mut self) {
        let now = monotonic_ns();
        for routed in self.router.take() {
            match routed {
                Routed::Episode { root, event } => {
                    if let Some(w) = self.router.workloads.by_root.get(&root) {
                        let rec = self.judge.episode(&event);
                        self.sinks.episode(workload_view(w), &rec);
                    }
                }
                Routed::Request { root, record } => {
                    if let Some(w) = self.router.workloads.by_root.get(&root) {
                        let signals = WorkloadSignals::of(w);
                        let judged = self.judge.request(*record, &signals, now);
                        self.sinks.request(workload_view(w), &judged);
                    }
                }
                Routed::Announced(pid) => self.tracking.announce(pid),
                Routed::Tcp { what } => self.sinks.series.tcp_event(what),
            }
        }
    }

    /// Routes up to [`DRAIN_BATCH`] records of the ring buffer, then the
    /// requests finished by now, through the judge to the sinks; then
    /// considers the processes the kernel announced (daemon mode). Returns
    /// whether the ring buffer was emptied.
    fn drain(&mut self, ring: &mut RingBuf<MapData>) -> Result<bool> {
        self.sample_sched(false);
        let mut emptied = false;
        for _ in 0..DRAIN_BATCH {
            let Some(item) = ring.next() else {
                emptied = true;
                break;
            };
            // Copy out so the ring slot is released before processing.
            self.record.clear();
            self.record.extend_from_slice(&item);
            drop(item);
            let tracking = &self.tracking;
            self.router
                .route(&self.record, |tgid| tracking.workload_of(tgid));
        }
        self.router.finish_requests(monotonic_ns());
        self.dispatch();
        self.tracking.consider_announced()?;
        self.apply_changes();
        Ok(emptied)
    }

    /// New libraries, the kernel's counters, ended workloads and retired
    /// label sets. Returns how many workloads remain.
    fn rescan(&mut self, ring: &mut RingBuf<MapData>) -> Result<usize> {
        let scan = self.tracking.rescan()?;
        self.apply_changes();
        if let Some(Sampling { sampler, .. }) = &mut self.sched_sampler {
            let tracking = &self.tracking;
            let live = scan.live.iter();
            sampler.track(
                live.map(|&(pid, root)| (pid, tracking.tenant_of(root))),
                monotonic_ns(),
            );
            let series = &self.sinks.series;
            series.evictions("sampled_threads", sampler.dropped);
            let quota = &sampler.quota;
            series.quota_exceeded(quota.resource().name(), quota.exceeded);
        }
        let ws = &mut self.router.workloads;
        for (pid, root) in &scan.live {
            ws.learn(*pid, *root);
        }
        ws.prune(&scan.live.iter().map(|(pid, _)| *pid).collect());
        let series = &self.sinks.series;
        series.evictions("pending_connection_opens", ws.pending_opens_dropped);
        series.evictions("bound_sockets", ws.bound_sockets_dropped);
        series.evictions("prefill_windows", self.judge.prefill_windows_evicted());
        series.evictions("stall_windows", self.judge.stall_windows_dropped);
        self.sinks
            .correlator_drops(self.router.stats().map(|(_, s)| s));
        self.sinks
            .series
            .traced(scan.live.len(), scan.runtime_libs, scan.driver_libs);
        self.sinks.series.target_reads(&scan.reads);
        self.read_kernel(&scan.live)?;
        // What the exited processes sent before exiting belongs to their
        // workloads: read it before ending them.
        self.drain(ring)?;
        let now = monotonic_ns();
        let ended = self.tracking.ended(&scan.live);
        for root in &ended {
            self.end_workload(*root, now);
        }
        self.tracking.forget_exited()?;
        self.tracking.forget_announced_exited()?;
        self.tracking.release_memory(!ended.is_empty());
        self.sinks.retire(now);
        self.table_entries();
        Ok(self.tracking.workloads())
    }

    /// Every per-target table's entries into `ttft_trace_table_entries`.
    fn table_entries(&self) {
        let series = &self.sinks.series;
        let tables = self
            .tracking
            .table_entries()
            .into_iter()
            .chain(self.router.workloads.table_entries());
        for (table, n) in tables {
            series.entries(table, n);
        }
        series.entries("prefill_workloads", self.judge.prefill_workloads());
        series.entries("ended_workload_stats", self.sinks.ended_stats());
        if let Some(Sampling { sampler, .. }) = &self.sched_sampler {
            series.entries("sampled_threads", sampler.threads());
        }
    }

    /// The kernel's counters into each workload's series.
    fn read_kernel(&mut self, live: &[(u32, u32)]) -> Result<()> {
        let mut reading = self.tracking.read_kernel(live)?;
        if let Some(Sampling { sampler, .. }) = &self.sched_sampler {
            // No scheduler program ran: the sums are the sampler's.
            let stats = &mut reading.stats;
            stats.sched.add(&sampler.totals());
            let (buckets, sum) = sampler.histogram();
            for (into, n) in stats.runq_buckets.iter_mut().zip(buckets) {
                *into += n;
            }
            stats.runq_sum_ns = stats.runq_sum_ns.wrapping_add(sum);
        }
        let ws = &mut self.router.workloads;
        for (tgid, delta) in &reading.deltas {
            match ws.root_of(*tgid).and_then(|r| ws.by_root.get(&r)) {
                Some(w) => self.sinks.series.counters(&w.label_values(), delta),
                None => ws.unrouted += 1,
            }
        }
        for tgid in reading.gone {
            ws.forget_process(tgid);
        }
        self.router.prune(monotonic_ns());
        self.sinks.kernel(&kernel_view(&reading.stats));
        Ok(())
    }

    /// A workload none of whose processes is alive: its requests in flight
    /// are finished and released, its labels start the retirement grace
    /// period.
    fn end_workload(&mut self, root: u32, now: u64) {
        self.router.flush(root);
        self.dispatch();
        let members: Vec<u32> = self.router.workloads.members(root).collect();
        self.tracking.forget_announced(members.into_iter());
        self.judge.forget_workload(root);
        if let Some(w) = self.router.workloads.remove(root) {
            self.sinks
                .workload_ended(workload_view(&w), w.correlator.stats(), now);
        }
    }

    /// The event loop.
    async fn run(&mut self, ring: RingBuf<MapData>, cfg: &TraceConfig) -> Result<Stop> {
        // SAFETY: the RingBuf owns its map fd, which stays open and unchanged
        // for as long as the AsyncFd owns the RingBuf.
        let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| anyhow::anyhow!("polling the ring buffer: {}", e.into_parts().1))?;
        self.started = Instant::now();
        let mut rescan = tokio::time::interval(RESCAN);
        let mut drain = tokio::time::interval(DRAIN);
        let mut report = tokio::time::interval(cfg.interval);
        report.tick().await;
        let discovery = self.tracking.discovery_period();
        let mut discover = tokio::time::interval(discovery.unwrap_or(Duration::from_secs(3600)));
        discover.tick().await;
        let sampling = self.sched_sampler.is_some();
        let mut signals = match self.signals.take() {
            Some(s) => s,
            None => Signals::install()?,
        };
        let deadline = cfg.duration.map(|d| tokio::time::Instant::now() + d);
        let stop = loop {
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("polling the ring buffer")?;
                    // Still ready when records remain: the next turn goes
                    // on with them, after whatever else is due.
                    if self.drain(guard.get_inner_mut())? {
                        guard.clear_ready();
                    }
                }
                _ = drain.tick() => {
                    self.drain(ring.get_mut())?;
                }
                _ = rescan.tick() => {
                    let remaining = self.rescan(ring.get_mut())?;
                    if self.tracking.ends_with_last_workload() && remaining == 0 {
                        break Stop::TargetExited;
                    }
                }
                // Only when nothing else woke the loop for a period.
                _ = tokio::time::sleep_until(self.next_sample()), if sampling => {
                    self.sample_sched(true);
                }
                _ = discover.tick(), if discovery.is_some() => {
                    self.tracking.discover()?;
                    self.apply_changes();
                }
                _ = report.tick() => self.sinks.interval(
                    self.started.elapsed().as_secs_f64(),
                    self.tracking.counter_totals(),
                ),
                _ = signals.hup.recv() => self.sinks.reopen_jsonl(),
                _ = signals.term.recv() => break Stop::Signal,
                _ = signals.int.recv() => break Stop::Signal,
                _ = sleep_until(deadline) => break Stop::Duration,
            }
        };
        log::info!("stopping ({stop:?}): reading what the kernel sent before");
        self.sample_sched(true);
        // Whatever the kernel sent before the stop still counts.
        for _ in 0..FINAL_DRAIN_TURNS {
            if self.drain(ring.get_mut())? {
                break;
            }
        }
        let live = self.tracking.live_processes()?;
        self.read_kernel(&live)?;
        if stop == Stop::TargetExited {
            log::info!("the traced processes have exited");
        }
        Ok(stop)
    }

    /// Serves /metrics, runs the loop, then prints the final summary and
    /// writes the totals. Detaching the uprobes waits for a grace period
    /// per perf event in the kernel (about 0.1 s each here, serialised): a
    /// child process holds them past our exit and the kernel detaches in
    /// its exit instead (see `probes::detach_in_background`).
    async fn run_to_end(
        mut self,
        listener: Option<TcpListener>,
        cfg: &TraceConfig,
        title: &str,
    ) -> Result<Stop> {
        let server = listener.map(|l| {
            log::info!(
                "serving Prometheus metrics on http://{}/metrics",
                l.local_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string())
            );
            tokio::spawn(prometheus::serve(l, self.sinks.series.registry().clone()))
        });
        let events = self.tracking.take_events()?;
        let stop = self.run(events, cfg).await?;
        if let Some(server) = server {
            server.abort();
        }
        let roots: Vec<u32> = self.router.workloads.by_root.keys().copied().collect();
        for root in roots {
            self.router.flush(root);
        }
        self.dispatch();
        let stop_name = format!("{stop:?}");
        self.sinks.finish(Ending {
            title,
            stop: &stop_name,
            elapsed_s: self.started.elapsed().as_secs_f64(),
            counters: self.tracking.counter_totals(),
            live_stats: self.router.stats().collect(),
            unrouted_events: self.router.workloads.unrouted,
            decode_errors: self.router.decode_errors,
        });
        match probes::detach_in_background() {
            Ok(Some((pid, events))) => log::info!(
                "detaching {events} probe perf events in the background (process {pid}, \
                 ttft-detach; the kernel takes about 0.1 s each)"
            ),
            Ok(None) => {}
            Err(e) => log::warn!("detaching in the foreground ({e})"),
        }
        let stuck = self.tracking.read_stats().work.stuck_now;
        if stuck > 0 {
            // A FUSE request its server has read is waited for without
            // regard to signals, and a process ends only with its last
            // thread: say why this one may outlive its work.
            log::warn!(
                "done; {stuck} read(s) of a target's files are still stuck in the kernel \
                 (a FUSE or network file system that does not answer): this process ends \
                 when they return"
            );
        }
        drop(self);
        Ok(stop)
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
