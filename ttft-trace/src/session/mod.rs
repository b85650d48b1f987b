//! The tracing session shared by `attach` (one process tree) and `daemon`
//! (every inference workload on the host): load the probes once, route each
//! event to its workload's pipeline, run the event loop (ring buffer,
//! periodic rescans and counter reads, summaries, /metrics) until the
//! duration ends, a signal arrives or, for `attach`, the target exits.

mod attach;
mod counters;
mod daemon;
mod evidence;
mod summary;
mod workload;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::{BufWriter, Write},
    net::{SocketAddr, TcpListener},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use serde_json::json;
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::SignalKind,
};
use ttft_trace_common::{
    CONN_OPEN, Direction, Stat,
    signals::{SchedTotals, TCP_RETRANSMIT},
};

pub use attach::{AttachConfig, attach};
pub use daemon::{DaemonOptions, daemon};

use crate::{
    causes::{Attribution, CauseConfig, CauseMetrics, CauseSummary, Evidence, attribute},
    clock::monotonic_ns,
    decode::{Event, decode},
    episodes::EpisodeRecord,
    metrics::{self, Metrics},
    nvml::{self, NvmlConfig, Sampler, WindowReadings},
    ports,
    probes::{
        Attached, LoadConfig, Probes,
        libraries::{self, CudaLibrary, Scanner},
        symbols::Api,
    },
    record::LatencyRecorder,
    requests::{self, CorrelatorStats, RequestMetrics, RequestRecord, RequestRecorders},
    signals::SignalMetrics,
    targets,
    workloads::{LabelSets, WorkloadLabels},
};
use counters::CounterTracker;
use workload::{Workload, Workloads};

/// How often the traced processes are rescanned for new CUDA libraries and
/// the kernel's counters are read.
const RESCAN: Duration = Duration::from_millis(250);
/// Copies of at least this many bytes are kept as swap-like traffic.
const LARGE_COPY_BYTES: u64 = 1 << 20;

/// How often the ring buffer is drained when the kernel has not woken us
/// (it does so only when the buffer fills past a threshold).
const DRAIN: Duration = Duration::from_millis(50);

/// What both modes share.
pub struct TraceConfig {
    pub listen: Option<SocketAddr>,
    pub duration: Option<Duration>,
    pub interval: Duration,
    pub jsonl: Option<PathBuf>,
    pub ringbuf_bytes: u32,
    /// Server ports to follow besides those the traced processes listen on.
    pub ports: Vec<u16>,
    /// Scheduler intervals at least this long are kept for attribution.
    pub sched_min_ns: u64,
    /// Thresholds of the cause attribution.
    pub causes: CauseConfig,
    /// NVML sampling; None: off.
    pub nvml: Option<NvmlConfig>,
    pub labels: LabelConfig,
}

/// How workloads are named in the metrics.
#[derive(Debug, Clone)]
pub struct LabelConfig {
    /// Add a `pid` label (the workload root's).
    pub with_pid: bool,
    /// Most label sets; later workloads share the overflow set.
    pub max_sets: usize,
    /// Series of a workload gone this long are removed.
    pub retire_after: Duration,
}

impl Default for LabelConfig {
    fn default() -> Self {
        Self {
            with_pid: false,
            max_sets: 100,
            retire_after: Duration::from_secs(300),
        }
    }
}

/// Why tracing stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Duration,
    Signal,
    TargetExited,
}

struct Session {
    probes: Probes,
    scanner: Scanner,
    metrics: Metrics,
    latency: LatencyRecorder,
    counters: CounterTracker,
    jsonl: Option<BufWriter<File>>,
    failed_total: u64,
    failed_window: u64,
    decode_errors: u64,
    /// GPU readings; None without NVML.
    gpu: Option<Sampler>,
    workloads: Workloads,
    label_sets: LabelSets,
    with_pid: bool,
    /// Request statistics of workloads that ended, for the totals line.
    ended_stats: Vec<(u32, CorrelatorStats)>,
    request_metrics: RequestMetrics,
    request_figures: RequestRecorders,
    requests_total: u64,
    listen_ports: BTreeSet<u16>,
    signal_metrics: SignalMetrics,
    /// Last scheduler totals read per process (exited ones included), so
    /// that the exported counters never go back.
    sched_totals: BTreeMap<u32, SchedTotals>,
    causes: CauseConfig,
    cause_metrics: CauseMetrics,
    cause_summary: CauseSummary,
    /// Processes announced by the kernel (daemon mode), to consider.
    announced: Vec<u32>,
    /// Daemon mode only.
    discovery: Option<daemon::Discovery>,
    traced_since_ns: u64,
}

/// A request's JSONL line: the record, its workload, its attribution
/// (`slow`, `causes`), and for slow requests the evidence read (GPU
/// readings included).
#[derive(serde::Serialize)]
struct RequestLine<'a> {
    #[serde(flatten)]
    record: &'a RequestRecord,
    workload: &'a WorkloadLabels,
    /// The workload's root process.
    workload_pid: u32,
    #[serde(flatten)]
    attribution: &'a Attribution,
    /// TCP retransmits on the request's connection between its arrival and
    /// its last send (all requests, slow or not).
    tcp_retransmits: usize,
    /// NVML readings over [arrival, first token] of the GPU that served it.
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<&'a WindowReadings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    evidence: Option<&'a Evidence>,
}

impl Session {
    /// Binds /metrics (first, so a port in use fails before anything is
    /// loaded), loads the probes, opens the JSONL file, starts NVML.
    fn start(cfg: &TraceConfig, discover: bool) -> Result<(Self, Option<TcpListener>)> {
        let label_names = WorkloadLabels::names(cfg.labels.with_pid);
        let metrics = Metrics::new(&label_names)?;
        let listener = cfg.listen.map(metrics::bind).transpose()?;
        let probes = Probes::load(&LoadConfig {
            ringbuf_bytes: cfg.ringbuf_bytes,
            sched_min_ns: cfg.sched_min_ns,
            large_copy_bytes: LARGE_COPY_BYTES,
            discover,
        })?;
        let jsonl = match &cfg.jsonl {
            Some(p) => Some(BufWriter::new(
                File::create(p).with_context(|| format!("creating {}", p.display()))?,
            )),
            None => None,
        };
        let request_metrics = RequestMetrics::new(&metrics.registry, &label_names)?;
        let signal_metrics = SignalMetrics::new(&metrics.registry)?;
        let cause_metrics = CauseMetrics::new(&metrics.registry, &label_names)?;
        let mut s = Session {
            probes,
            scanner: Scanner::default(),
            metrics,
            latency: LatencyRecorder::new(),
            counters: CounterTracker::default(),
            jsonl,
            failed_total: 0,
            failed_window: 0,
            decode_errors: 0,
            gpu: None,
            workloads: Workloads::default(),
            label_sets: LabelSets::new(
                cfg.labels.max_sets,
                u64::try_from(cfg.labels.retire_after.as_nanos()).unwrap_or(u64::MAX),
                cfg.labels.with_pid,
            ),
            with_pid: cfg.labels.with_pid,
            ended_stats: Vec::new(),
            request_metrics,
            request_figures: RequestRecorders::new(),
            requests_total: 0,
            listen_ports: BTreeSet::new(),
            signal_metrics,
            sched_totals: BTreeMap::new(),
            causes: cfg.causes.clone(),
            cause_metrics,
            cause_summary: CauseSummary::new(5),
            announced: Vec::new(),
            discovery: None,
            traced_since_ns: monotonic_ns(),
        };
        if let Some(nvml_cfg) = &cfg.nvml {
            s.start_nvml(nvml_cfg)?;
        }
        Ok((s, listener))
    }

    fn start_nvml(&mut self, cfg: &NvmlConfig) -> Result<()> {
        match nvml::start(cfg, &self.metrics.registry)? {
            nvml::Started::Sampler(sampler) => {
                let gpus: Vec<String> = sampler
                    .gpus()
                    .iter()
                    .map(|g| format!("{} {} ({})", g.index, g.name, g.uuid))
                    .collect();
                log::info!(
                    "NVML: sampling every {:?}: {}",
                    sampler.period(),
                    gpus.join(", ")
                );
                self.gpu = Some(sampler);
            }
            nvml::Started::Unavailable(reason) => {
                log::info!("{reason}; GPU readings are off, everything else works");
            }
        }
        Ok(())
    }

    /// Starts tracing the workload rooted at `root`: the root and its
    /// descendants are tracked (the kernel adds later children).
    fn add_workload(&mut self, root: u32) -> Result<()> {
        // Track first, then list the children: a child forked in between is
        // then tracked by the kernel and found by the listing.
        self.probes.track(root, root)?;
        let members = targets::descendants(root);
        for child in &members {
            self.probes.track(*child, root)?;
        }
        let labels = self
            .label_sets
            .admit(WorkloadLabels::of_process(root, self.with_pid));
        let w = Workload::new(root, labels);
        let values = w.label_values();
        self.metrics.init_workload(&values);
        self.request_metrics.init_workload(&values);
        self.cause_metrics.init_workload(&values);
        log::info!(
            "tracing workload pid {root} ({}){}",
            w.labels.comm,
            describe_place(&w.labels)
        );
        self.workloads.insert(w);
        for child in members {
            self.workloads.learn(child, root);
        }
        Ok(())
    }

    /// Attaches the probes to `lib` unless its file already has them.
    fn attach(&mut self, lib: &CudaLibrary) -> Result<()> {
        if let Some(a) = self.probes.attach_library(lib)? {
            self.report_attach(&a);
        }
        Ok(())
    }

    /// Attaches the probes to libraries named by `--cuda-lib`: a path that is
    /// no CUDA library is the user's error.
    fn attach_named(&mut self, paths: &[PathBuf]) -> Result<()> {
        for path in paths {
            let lib = libraries::inspect(path, path)?.with_context(|| {
                format!(
                    "{} defines none of the CUDA entry points ttft-trace probes \
                     (cudaLaunchKernel, cudaGraphLaunch or cuLaunchKernel)",
                    path.display()
                )
            })?;
            self.attach(&lib)?;
        }
        Ok(())
    }

    /// Attaches the probes to a library found in a process's mappings. The
    /// process may exit meanwhile (its /proc path is then gone): a warning,
    /// and a later scan of another process tries again.
    fn attach_found(&mut self, lib: &CudaLibrary) {
        if let Err(e) = self.attach(lib) {
            log::warn!("could not attach to {}: {e:#}", lib.path.display());
        }
    }

    /// Follows connections accepted on the ports the traced processes
    /// listen on now (later `listen()` calls are seen in the kernel) and on
    /// `extra` ports.
    fn follow_ports(&mut self, extra: &[u16]) -> Result<()> {
        let mut found = ports::listening_ports(&self.live_processes()?);
        found.extend(extra);
        let mut new = Vec::new();
        for port in found {
            if self.listen_ports.insert(port) {
                self.probes.add_listen_port(port)?;
                new.push(port.to_string());
            }
        }
        if !new.is_empty() {
            log::info!("following requests on port(s) {}", new.join(", "));
        }
        Ok(())
    }

    /// Attributes, logs, records and exports finished requests of workload
    /// `root` (the correlator holds each until the client acknowledged its
    /// first token, so the retransmits before that have arrived).
    fn finish_requests(&mut self, root: u32, finished: Vec<RequestRecord>, now_ns: u64) {
        for record in finished {
            let Some(w) = self.workloads.by_root.get(&root) else {
                continue;
            };
            let values = w.label_values();
            self.requests_total += 1;
            self.request_metrics.observe(&record, &values);
            self.request_figures.record(&record);
            let evidence =
                evidence::gather(&record, &w.signals, self.gpu.as_ref(), self.traced_since_ns);
            let attribution = attribute(&evidence, &self.causes);
            self.cause_metrics.observe(&attribution, &values);
            self.cause_summary.record(&attribution, || {
                format!(
                    "{}:{} #{}",
                    record.client_addr, record.client_port, record.request_index
                )
            });
            let Some(out) = self.jsonl.as_mut() else {
                continue;
            };
            let end = record.t_done_ns.unwrap_or(now_ns);
            let tcp_retransmits = w
                .signals
                .tcp_events_in(record.sk, record.t_arrive_ns, end)
                .filter(|e| e.what == TCP_RETRANSMIT)
                .count();
            let line = RequestLine {
                record: &record,
                workload: &w.labels,
                workload_pid: root,
                attribution: &attribution,
                tcp_retransmits,
                gpu: evidence.gpu.as_ref(),
                evidence: attribution.slow.then_some(&evidence),
            };
            if let Err(e) = write_line(out, &line) {
                log::warn!("writing JSONL failed, no more lines will be written: {e}");
                self.jsonl = None;
            }
        }
    }

    /// Live processes among the tracked ids, each learnt as a member of its
    /// workload; ids of exited processes and of threads are dropped from the
    /// kernel's map on the way.
    fn live_processes(&mut self) -> Result<Vec<u32>> {
        let mut live = Vec::new();
        for (id, root) in self.probes.tracked()? {
            if targets::is_process(id) {
                live.push(id);
                self.workloads.learn(id, root);
            } else if !std::path::Path::new(&format!("/proc/{id}")).exists() {
                self.probes.untrack(id)?;
            }
        }
        Ok(live)
    }

    /// Scans every traced process and attaches libraries not seen before.
    /// Returns the live processes.
    fn attach_new_libraries(&mut self) -> Result<Vec<u32>> {
        let live = self.live_processes()?;
        for pid in &live {
            let Ok(scan) = self.scanner.scan(*pid) else {
                continue;
            };
            for lib in scan.libraries {
                self.attach_found(&lib);
            }
        }
        let (mut rt, mut drv) = (0, 0);
        for a in self.probes.attached() {
            rt += usize::from(a.apis.contains(&Api::Runtime));
            drv += usize::from(a.apis.contains(&Api::Driver));
        }
        self.metrics.set_traced(live.len(), rt, drv);
        Ok(live)
    }

    /// Ends the workloads none of whose processes is alive: their requests
    /// in flight are finished and released, their labels start the
    /// retirement grace period. Returns how many remain.
    fn end_workloads(&mut self, live: &[u32]) -> usize {
        let alive: BTreeSet<u32> = live
            .iter()
            .filter_map(|p| self.workloads.root_of(*p))
            .collect();
        let ended: Vec<u32> = self
            .workloads
            .by_root
            .keys()
            .filter(|r| !alive.contains(r))
            .copied()
            .collect();
        let now = monotonic_ns();
        for root in ended {
            self.end_workload(root, now);
        }
        self.workloads.by_root.len()
    }

    fn end_workload(&mut self, root: u32, now: u64) {
        let Some(w) = self.workloads.by_root.get_mut(&root) else {
            return;
        };
        let flushed = w.correlator.flush();
        self.finish_requests(root, flushed, now);
        let members: Vec<u32> = self.workloads.members(root).collect();
        for tgid in members {
            if let Err(e) = self.probes.forget_announced(tgid) {
                log::debug!("forgetting announced {tgid}: {e}");
            }
        }
        if let Some(w) = self.workloads.remove(root) {
            log::info!("workload pid {root} ({}) has exited", w.labels.comm);
            self.ended_stats.push((root, w.correlator.stats()));
            self.label_sets.release(&w.labels, now);
        }
    }

    /// Removes the series of label sets whose workloads are gone past the
    /// grace period.
    fn retire_labels(&mut self) {
        for labels in self.label_sets.retire(monotonic_ns()) {
            let values = labels.values();
            let v: Vec<&str> = values.iter().map(String::as_str).collect();
            self.metrics.retire_workload(&v);
            self.request_metrics.retire_workload(&v);
            self.cause_metrics.retire_workload(&v);
            log::info!("retired the series of workload {}", labels.comm);
        }
        self.metrics
            .set_workloads(self.label_sets.len(), self.label_sets.overflowed);
    }

    fn report_attach(&mut self, a: &Attached) {
        let apis: Vec<&str> = a.apis.iter().map(|x| x.name()).collect();
        log::info!(
            "attached {} probes to {} ({})",
            a.symbols,
            a.path.display(),
            apis.join("+")
        );
        for (sym, err) in &a.failed {
            log::warn!("could not probe {sym} in {}: {err}", a.path.display());
        }
        if let Some(w) = self.jsonl.as_mut() {
            let line = json!({
                "type": "attach", "t_ns": monotonic_ns(), "library": a.path,
                "apis": apis, "symbols": a.symbols, "failed": a.failed.len(),
            });
            let _ = writeln!(w, "{line}");
        }
    }

    /// The last JSONL line: what the kernel counted over the whole run.
    fn write_totals(&mut self, stop: Stop, lost: u64) {
        let t = *self.counters.total();
        let mut stats: Vec<serde_json::Value> = self
            .ended_stats
            .iter()
            .map(|(root, s)| json!({"workload_pid": root, "stats": s}))
            .collect();
        stats.extend(
            self.workloads
                .by_root
                .values()
                .map(|w| json!({"workload_pid": w.root, "stats": w.correlator.stats()})),
        );
        let Some(w) = self.jsonl.as_mut() else { return };
        let mut bytes = serde_json::Map::new();
        let mut calls = serde_json::Map::new();
        for dir in Direction::ALL {
            bytes.insert(dir.name().into(), t.memcpy_bytes[dir as usize].into());
            calls.insert(dir.name().into(), t.memcpy_calls[dir as usize].into());
        }
        let line = json!({
            "type": "totals", "t_ns": monotonic_ns(), "stop": format!("{stop:?}"),
            "episodes_ok": self.latency.total().count, "episodes_failed": self.failed_total,
            "kernel_launches": t.kernel_launches, "graph_launches": t.graph_launches,
            "memcpy_bytes": bytes, "memcpy_calls": calls, "events_lost": lost,
            "requests": self.requests_total, "request_stats": stats,
            "unrouted_events": self.workloads.unrouted,
        });
        let _ = writeln!(w, "{line}");
    }

    fn handle(&mut self, bytes: &[u8]) {
        let probes = &self.probes;
        let lookup = |tgid| probes.workload_of(tgid).ok().flatten();
        match decode(bytes) {
            Ok(Event::Conn(ev)) if ev.op == CONN_OPEN => self.workloads.hold_open(&ev),
            Ok(Event::Conn(ev)) => {
                // Followed past its close, until the kernel is done with it.
                if let Some(w) = self.workloads.of_socket(ev.sk, requests::ends_socket(&ev)) {
                    w.correlator.on_conn(&ev);
                }
            }
            Ok(Event::Sock(ev)) => {
                let Some(root) = self.workloads.of_process(ev.tgid, lookup).map(|w| w.root) else {
                    return;
                };
                let held = self.workloads.bind_socket(ev.sk, root);
                if let Some(w) = self.workloads.of_socket(ev.sk, false) {
                    if let Some(held) = held {
                        if let Some(open) = held.open {
                            w.correlator.on_conn(&open);
                        }
                        for seg in &held.segments {
                            w.correlator.on_segment(seg);
                        }
                    }
                    w.correlator.on_sock(&ev);
                }
            }
            Ok(Event::Segment(ev)) => {
                if let Some(w) = self.workloads.route_segment(&ev) {
                    w.correlator.on_segment(&ev);
                }
            }
            Ok(Event::Sched(ev)) => {
                if let Some(w) = self.workloads.of_process(ev.tgid, lookup) {
                    w.signals.on_sched(&ev);
                }
            }
            Ok(Event::Tcp(ev)) => {
                self.signal_metrics.tcp_event(ev.what);
                if let Some(w) = self.workloads.of_socket(ev.sk, false) {
                    w.signals.on_tcp(&ev);
                }
            }
            Ok(Event::Copy(ev)) => {
                if let Some(w) = self.workloads.of_process(ev.tgid, lookup) {
                    w.signals.on_copy(&ev);
                }
            }
            Ok(Event::Discover(ev)) => self.announced.push(ev.tgid),
            Ok(Event::Episode(ev)) => self.on_episode(&ev),
            Err(e) => {
                self.decode_errors += 1;
                log::debug!("undecodable record: {e}");
            }
        }
    }

    fn on_episode(&mut self, ev: &ttft_trace_common::EpisodeEvent) {
        let probes = &self.probes;
        let lookup = |tgid| probes.workload_of(tgid).ok().flatten();
        let Some(w) = self.workloads.of_process(ev.tgid, lookup) else {
            return;
        };
        w.correlator.on_episode(ev);
        w.signals.on_episode(ev.tgid, ev.tid, ev.t_first_launch_ns);
        let mut rec = EpisodeRecord::new(ev);
        if let Some(gpu) = &self.gpu {
            rec.gpu = gpu.window(
                gpu.gpu_of_pid(ev.tgid),
                ev.t_first_launch_ns,
                ev.t_copy_done_ns,
            );
        }
        self.metrics.observe_episode(&rec, &w.label_values());
        if rec.ok() {
            self.latency.record(rec.launch_to_first_d2h_ns);
        } else {
            self.failed_total += 1;
            self.failed_window += 1;
        }
        if let Some(out) = self.jsonl.as_mut()
            && let Err(e) = write_line(out, &rec)
        {
            log::warn!("writing JSONL failed, no more lines will be written: {e}");
            self.jsonl = None;
        }
    }

    fn drain(&mut self, ring: &mut RingBuf<MapData>) {
        while let Some(item) = ring.next() {
            let bytes: &[u8] = &item;
            // Copy out so the ring slot is released before processing.
            let owned = bytes.to_vec();
            drop(item);
            self.handle(&owned);
        }
        let now = monotonic_ns();
        let roots: Vec<u32> = self.workloads.by_root.keys().copied().collect();
        for root in roots {
            if let Some(w) = self.workloads.by_root.get_mut(&root) {
                let finished = w.correlator.drain_finished(now);
                self.finish_requests(root, finished, now);
            }
        }
    }

    /// Reads the kernel's counters and statistics into the metrics; forgets
    /// processes that are gone once their last reading is taken.
    fn read_counters(&mut self, live: &[u32]) -> Result<()> {
        let reading = self.probes.counters()?;
        for (tgid, delta) in self.counters.update(&reading) {
            let workload = self
                .workloads
                .root_of(tgid)
                .and_then(|r| self.workloads.by_root.get(&r));
            match workload {
                Some(w) => self.metrics.add_counters(&delta, &w.label_values()),
                None => self.workloads.unrouted += 1,
            }
        }
        for tgid in reading.keys() {
            if !live.contains(tgid) && !targets::is_process(*tgid) {
                self.probes.drop_counters(*tgid)?;
                self.counters.forget(*tgid);
                if let Some(w) = self
                    .workloads
                    .root_of(*tgid)
                    .and_then(|r| self.workloads.by_root.get_mut(&r))
                {
                    w.signals.forget_process(*tgid);
                }
                if !self.workloads.by_root.contains_key(tgid) {
                    self.workloads.forget_process(*tgid);
                }
            }
        }
        for (tgid, t) in self.probes.sched_totals()? {
            self.sched_totals.insert(tgid, t);
        }
        let mut all = SchedTotals::default();
        for t in self.sched_totals.values() {
            all.add(t);
        }
        self.signal_metrics.set_sched_totals(&all);
        let (buckets, sum) = self.probes.runq_histogram()?;
        self.signal_metrics.runq.set(buckets, sum);
        let now = monotonic_ns();
        for w in self.workloads.by_root.values_mut() {
            w.signals.prune(now);
        }
        let lost = self.probes.stat(Stat::RingbufLost)?;
        let dropped = self.probes.stat(Stat::ThreadStateFull)?;
        self.metrics.set_kernel_stats(lost, dropped);
        Ok(())
    }

    fn print_interval(&mut self) {
        let window = self.latency.take_window();
        println!(
            "{}",
            summary::interval_line(
                self.elapsed_since_start(),
                &window,
                self.failed_window,
                self.counters.total(),
                self.metrics.events_lost()
            )
        );
        self.failed_window = 0;
        for line in self.request_figures.window_lines(summary::percentiles) {
            if !line.contains(" n=0 ") {
                println!("           {line}");
            }
        }
        for line in self.cause_summary.window_lines() {
            println!("           {line}");
        }
        if let Some(w) = self.jsonl.as_mut() {
            let _ = w.flush();
        }
    }

    fn elapsed_since_start(&self) -> f64 {
        START.get_or_init(Instant::now).elapsed().as_secs_f64()
    }

    /// The event loop. `discovery`: the daemon's /proc scan period.
    async fn run(
        &mut self,
        ring: RingBuf<MapData>,
        cfg: &TraceConfig,
        discovery: Option<Duration>,
    ) -> Result<Stop> {
        START.get_or_init(Instant::now);
        // SAFETY: the RingBuf owns its map fd, which stays open and unchanged
        // for as long as the AsyncFd owns the RingBuf.
        let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| anyhow::anyhow!("polling the ring buffer: {}", e.into_parts().1))?;
        let mut rescan = tokio::time::interval(RESCAN);
        let mut drain = tokio::time::interval(DRAIN);
        let mut report = tokio::time::interval(cfg.interval);
        report.tick().await;
        let mut discover = tokio::time::interval(discovery.unwrap_or(Duration::from_secs(3600)));
        discover.tick().await;
        let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
        let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
        let deadline = cfg.duration.map(|d| tokio::time::Instant::now() + d);
        let stop = loop {
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("polling the ring buffer")?;
                    self.drain(guard.get_inner_mut());
                    guard.clear_ready();
                    if discovery.is_some() {
                        self.consider_announced()?;
                    }
                }
                _ = drain.tick() => {
                    self.drain(ring.get_mut());
                    if discovery.is_some() {
                        self.consider_announced()?;
                    }
                }
                _ = rescan.tick() => {
                    let live = self.attach_new_libraries()?;
                    self.read_counters(&live)?;
                    // What the exited processes sent before exiting belongs
                    // to their workloads: read it before ending them.
                    self.drain(ring.get_mut());
                    let remaining = self.end_workloads(&live);
                    self.retire_labels();
                    if discovery.is_none() && remaining == 0 {
                        break Stop::TargetExited;
                    }
                }
                _ = discover.tick(), if discovery.is_some() => self.discover()?,
                _ = report.tick() => self.print_interval(),
                _ = sigterm.recv() => break Stop::Signal,
                _ = sigint.recv() => break Stop::Signal,
                _ = sleep_until(deadline) => break Stop::Duration,
            }
        };
        // Whatever the kernel sent before the stop still counts.
        self.drain(ring.get_mut());
        let live = self.live_processes()?;
        self.read_counters(&live)?;
        if stop == Stop::TargetExited {
            log::info!("the traced processes have exited");
        }
        Ok(stop)
    }

    /// Serves /metrics, runs the loop, then prints the final summary and
    /// writes the totals. Detaching the probes (when the session drops)
    /// waits for an RCU grace period per uprobe in the kernel (about 0.1 s
    /// each here, serialised), so it comes after the summary.
    async fn run_to_end(
        mut self,
        listener: Option<TcpListener>,
        cfg: &TraceConfig,
        discovery: Option<Duration>,
        title: &str,
    ) -> Result<Stop> {
        let server = listener.map(|l| {
            log::info!(
                "serving Prometheus metrics on http://{}/metrics",
                l.local_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string())
            );
            tokio::spawn(metrics::serve(l, self.metrics.registry.clone()))
        });
        let events = self.probes.take_events()?;
        let stop = self.run(events, cfg, discovery).await?;
        if let Some(server) = server {
            server.abort();
        }
        let elapsed = self.elapsed_since_start();
        let lost = self.metrics.events_lost();
        let roots: Vec<u32> = self.workloads.by_root.keys().copied().collect();
        for root in roots {
            if let Some(w) = self.workloads.by_root.get_mut(&root) {
                let flushed = w.correlator.flush();
                self.finish_requests(root, flushed, monotonic_ns());
            }
        }
        println!(
            "{}",
            summary::final_block(
                title,
                elapsed,
                &self.latency.total(),
                self.failed_total,
                self.counters.total(),
                lost
            )
        );
        if self.requests_total > 0 {
            println!("requests:            {}", self.requests_total);
            for line in self.request_figures.total_lines(summary::percentiles) {
                println!("  {line}");
            }
            for line in self.cause_summary.total_lines() {
                println!("{line}");
            }
        }
        if self.decode_errors > 0 {
            log::warn!(
                "{} ring-buffer records could not be decoded",
                self.decode_errors
            );
        }
        self.write_totals(stop, lost);
        if let Some(w) = self.jsonl.as_mut() {
            w.flush().context("writing the JSONL file")?;
        }
        drop(self);
        Ok(stop)
    }
}

/// " in container X, pod ns/name" for a log line, or "".
fn describe_place(l: &WorkloadLabels) -> String {
    let mut s = String::new();
    if !l.container.is_empty() {
        s.push_str(&format!(" in container {}", l.container));
    }
    if !l.pod.is_empty() {
        s.push_str(&format!(", pod {}/{}", l.namespace, l.pod));
    }
    s
}

fn write_line(w: &mut impl Write, value: &impl serde::Serialize) -> std::io::Result<()> {
    serde_json::to_writer(&mut *w, value)?;
    w.write_all(b"\n")
}

static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
