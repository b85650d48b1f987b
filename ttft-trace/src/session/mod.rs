//! `ttft-trace attach`: find the target's CUDA libraries, attach, and run the
//! event loop (ring buffer, periodic rescans and counter reads, summaries,
//! /metrics) until the duration ends, a signal arrives or the target exits.

mod counters;
mod evidence;
mod summary;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::{BufWriter, Write},
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{MapData, RingBuf};
use serde_json::json;
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::SignalKind,
};
use ttft_trace_common::{
    Direction, Stat,
    signals::{SchedTotals, TCP_RETRANSMIT},
};

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
        libraries::{self, Scanner},
        symbols::Api,
    },
    record::LatencyRecorder,
    requests::{Correlator, CorrelatorConfig, RequestMetrics, RequestRecord, RequestRecorders},
    signals::{SignalMetrics, SignalStore},
    targets,
};
use counters::CounterTracker;

/// How often the process tree is rescanned for new CUDA libraries and the
/// kernel's counters are read.
const RESCAN: Duration = Duration::from_millis(250);
/// Copies of at least this many bytes are kept as swap-like traffic.
const LARGE_COPY_BYTES: u64 = 1 << 20;

/// How often the ring buffer is drained when the kernel has not woken us
/// (it does so only when the buffer fills past a threshold).
const DRAIN: Duration = Duration::from_millis(50);
/// How often `--wait` looks for a CUDA library to appear.
const WAIT_POLL: Duration = Duration::from_millis(10);

pub struct AttachConfig {
    pub pid: u32,
    pub wait: bool,
    pub wait_timeout: Option<Duration>,
    pub cuda_libs: Vec<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub duration: Option<Duration>,
    pub interval: Duration,
    pub jsonl: Option<PathBuf>,
    pub ringbuf_bytes: u32,
    /// Server ports to follow besides those the traced tree listens on.
    pub ports: Vec<u16>,
    /// Scheduler intervals at least this long are kept for attribution.
    pub sched_min_ns: u64,
    /// Thresholds of the cause attribution.
    pub causes: CauseConfig,
    /// NVML sampling; None: off.
    pub nvml: Option<NvmlConfig>,
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
    requests: Correlator,
    request_metrics: RequestMetrics,
    request_figures: RequestRecorders,
    requests_total: u64,
    listen_ports: BTreeSet<u16>,
    signals: SignalStore,
    signal_metrics: SignalMetrics,
    /// Last scheduler totals read per process (exited ones included), so
    /// that the exported counters never go back.
    sched_totals: BTreeMap<u32, SchedTotals>,
    causes: CauseConfig,
    cause_metrics: CauseMetrics,
    cause_summary: CauseSummary,
    traced_since_ns: u64,
}

/// A request's JSONL line: the record, its attribution (`slow`, `causes`),
/// and for slow requests the evidence read (GPU readings included).
#[derive(serde::Serialize)]
struct RequestLine<'a> {
    #[serde(flatten)]
    record: &'a RequestRecord,
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

pub async fn attach(cfg: AttachConfig) -> Result<Stop> {
    if !targets::is_process(cfg.pid) {
        bail!(
            "no process with pid {} (or it is a thread, or a zombie)",
            cfg.pid
        );
    }
    let title = format!(
        "pid {} ({})",
        cfg.pid,
        targets::comm(cfg.pid).unwrap_or_default()
    );
    let metrics = Metrics::new()?;
    let listener = cfg.listen.map(metrics::bind).transpose()?;
    let probes = Probes::load(&LoadConfig {
        ringbuf_bytes: cfg.ringbuf_bytes,
        sched_min_ns: cfg.sched_min_ns,
        large_copy_bytes: LARGE_COPY_BYTES,
    })?;
    let jsonl = match &cfg.jsonl {
        Some(p) => Some(BufWriter::new(
            File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let request_metrics = RequestMetrics::new(&metrics.registry)?;
    let signal_metrics = SignalMetrics::new(&metrics.registry)?;
    let cause_metrics = CauseMetrics::new(&metrics.registry)?;
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
        requests: Correlator::new(CorrelatorConfig::default()),
        request_metrics,
        request_figures: RequestRecorders::new(),
        requests_total: 0,
        listen_ports: BTreeSet::new(),
        signals: SignalStore::default(),
        signal_metrics,
        sched_totals: BTreeMap::new(),
        causes: cfg.causes.clone(),
        cause_metrics,
        cause_summary: CauseSummary::new(5),
        traced_since_ns: monotonic_ns(),
    };
    if let Some(nvml_cfg) = &cfg.nvml {
        match nvml::start(nvml_cfg, &s.metrics.registry)? {
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
                s.gpu = Some(sampler);
            }
            nvml::Started::Unavailable(reason) => {
                log::info!("{reason}; GPU readings are off, everything else works");
            }
        }
    }
    // Track first, then scan: a child forked in between is then tracked by
    // the kernel and found by the scan.
    s.probes.track(cfg.pid)?;
    for child in targets::descendants(cfg.pid) {
        s.probes.track(child)?;
    }
    for path in &cfg.cuda_libs {
        let lib = libraries::inspect(path, path)?.with_context(|| {
            format!(
                "{} defines none of the CUDA entry points ttft-trace probes \
                 (cudaLaunchKernel, cudaGraphLaunch or cuLaunchKernel)",
                path.display()
            )
        })?;
        if let Some(a) = s.probes.attach_library(&lib)? {
            s.report_attach(&a);
        }
    }
    s.attach_new_libraries()?;
    // Ports first: with --wait, the first request may be what makes the
    // server load its CUDA library (a lazily started engine process).
    s.follow_ports(&cfg.ports)?;
    if s.probes.attached().next().is_none() {
        s.wait_for_library(&cfg).await?;
    }
    let server = listener.map(|l| {
        log::info!(
            "serving Prometheus metrics on http://{}/metrics",
            l.local_addr()
                .map_or_else(|_| "?".into(), |a| a.to_string())
        );
        tokio::spawn(metrics::serve(l, s.metrics.registry.clone()))
    });

    let events = s.probes.take_events()?;
    let stop = s.run(events, &cfg).await?;
    if let Some(server) = server {
        server.abort();
    }
    let elapsed = s.elapsed_since_start();
    let lost = s.metrics.events_lost();
    let flushed = s.requests.flush();
    s.finish_requests(flushed, monotonic_ns());
    println!(
        "{}",
        summary::final_block(
            &title,
            elapsed,
            &s.latency.total(),
            s.failed_total,
            s.counters.total(),
            lost
        )
    );
    if s.requests_total > 0 {
        println!("requests:            {}", s.requests_total);
        for line in s.request_figures.total_lines(summary::percentiles) {
            println!("  {line}");
        }
        for line in s.cause_summary.total_lines() {
            println!("{line}");
        }
    }
    if s.decode_errors > 0 {
        log::warn!(
            "{} ring-buffer records could not be decoded",
            s.decode_errors
        );
    }
    s.write_totals(stop, lost);
    if let Some(w) = s.jsonl.as_mut() {
        w.flush().context("writing the JSONL file")?;
    }
    // Detaching waits for an RCU grace period per uprobe in the kernel
    // (about 0.1 s each here, serialised), so it comes after the summary.
    drop(s);
    Ok(stop)
}

impl Session {
    fn elapsed_since_start(&self) -> f64 {
        START.get_or_init(Instant::now).elapsed().as_secs_f64()
    }

    /// Follows connections accepted on the ports the traced processes
    /// listen on now (later `listen()` calls are seen in the kernel) and on
    /// `extra` ports.
    fn follow_ports(&mut self, extra: &[u16]) -> Result<()> {
        let mut found = ports::listening_ports(&self.live_processes()?);
        found.extend(extra);
        for port in found {
            if self.listen_ports.insert(port) {
                self.probes.add_listen_port(port)?;
            }
        }
        if !self.listen_ports.is_empty() {
            let list: Vec<String> = self.listen_ports.iter().map(u16::to_string).collect();
            log::info!("following requests on port(s) {}", list.join(", "));
        }
        Ok(())
    }

    /// Attributes, logs, records and exports finished requests (the
    /// correlator holds each until the client acknowledged its first token,
    /// so the retransmits before that have arrived).
    fn finish_requests(&mut self, finished: Vec<RequestRecord>, now_ns: u64) {
        for record in finished {
            self.requests_total += 1;
            self.request_metrics.observe(&record);
            self.request_figures.record(&record);
            let evidence = evidence::gather(
                &record,
                &self.signals,
                self.gpu.as_ref(),
                self.traced_since_ns,
            );
            let attribution = attribute(&evidence, &self.causes);
            self.cause_metrics.observe(&attribution);
            self.cause_summary.record(&attribution, || {
                format!(
                    "{}:{} #{}",
                    record.client_addr, record.client_port, record.request_index
                )
            });
            let Some(w) = self.jsonl.as_mut() else {
                continue;
            };
            let end = record.t_done_ns.unwrap_or(now_ns);
            let tcp_retransmits = u64::from_str_radix(record.conn.trim_start_matches("0x"), 16)
                .map_or(0, |sk| {
                    self.signals
                        .tcp_events_in(sk, record.t_arrive_ns, end)
                        .filter(|e| e.what == TCP_RETRANSMIT)
                        .count()
                });
            let line = RequestLine {
                record: &record,
                attribution: &attribution,
                tcp_retransmits,
                gpu: evidence.gpu.as_ref(),
                evidence: attribution.slow.then_some(&evidence),
            };
            if let Err(e) = write_line(w, &line) {
                log::warn!("writing JSONL failed, no more lines will be written: {e}");
                self.jsonl = None;
            }
        }
    }

    /// Blocks (asynchronously) until a CUDA library appears in the tree, the
    /// target exits, or the timeout passes; without `--wait`, explains what
    /// was searched.
    async fn wait_for_library(&mut self, cfg: &AttachConfig) -> Result<()> {
        if !cfg.wait {
            let mut searched = BTreeSet::new();
            let mut processes = 0;
            for pid in self.live_processes()? {
                processes += 1;
                if let Ok(scan) = self.scanner.scan(pid) {
                    searched.extend(scan.searched);
                }
            }
            let list: Vec<String> = searched
                .iter()
                .map(|p| format!("  {}", p.display()))
                .collect();
            bail!(
                "pid {} ({} process(es) with descendants) maps no library that defines the CUDA \
                 runtime or driver entry points (cudaLaunchKernel, cudaGraphLaunch, \
                 cuLaunchKernel) in .dynsym or .symtab; searched {} mapped ELF file(s):\n{}\n\
                 Use --wait to wait for one to be loaded, or --cuda-lib PATH to name one.",
                cfg.pid,
                processes,
                searched.len(),
                list.join("\n")
            );
        }
        log::info!("waiting for pid {} to load a CUDA library", cfg.pid);
        let deadline = cfg.wait_timeout.map(|t| Instant::now() + t);
        loop {
            tokio::time::sleep(WAIT_POLL).await;
            if self.live_processes()?.is_empty() {
                bail!("pid {} exited before loading a CUDA library", cfg.pid);
            }
            self.attach_new_libraries()?;
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

    /// Live processes among the tracked ids; ids of exited processes and of
    /// threads are dropped from the kernel's map on the way.
    fn live_processes(&mut self) -> Result<Vec<u32>> {
        let mut live = Vec::new();
        for id in self.probes.tracked()? {
            if targets::is_process(id) {
                live.push(id);
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
                if let Some(a) = self.probes.attach_library(&lib)? {
                    self.report_attach(&a);
                }
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
            "requests": self.requests_total, "request_stats": self.requests.stats(),
        });
        let _ = writeln!(w, "{line}");
    }

    fn handle(&mut self, bytes: &[u8]) {
        match decode(bytes) {
            Ok(Event::Conn(ev)) => self.requests.on_conn(&ev),
            Ok(Event::Sock(ev)) => self.requests.on_sock(&ev),
            Ok(Event::Segment(ev)) => self.requests.on_segment(&ev),
            Ok(Event::Sched(ev)) => self.signals.on_sched(&ev),
            Ok(Event::Tcp(ev)) => {
                self.signal_metrics.tcp_event(ev.what);
                self.signals.on_tcp(&ev);
            }
            Ok(Event::Copy(ev)) => self.signals.on_copy(&ev),
            Ok(Event::Episode(ev)) => {
                self.requests.on_episode(&ev);
                self.signals
                    .on_episode(ev.tgid, ev.tid, ev.t_first_launch_ns);
                let mut rec = EpisodeRecord::new(&ev);
                if let Some(gpu) = &self.gpu {
                    rec.gpu = gpu.window(
                        gpu.gpu_of_pid(ev.tgid),
                        ev.t_first_launch_ns,
                        ev.t_copy_done_ns,
                    );
                }
                self.metrics.observe_episode(&rec);
                if rec.ok() {
                    self.latency.record(rec.launch_to_first_d2h_ns);
                } else {
                    self.failed_total += 1;
                    self.failed_window += 1;
                }
                if let Some(w) = self.jsonl.as_mut()
                    && let Err(e) = write_line(w, &rec)
                {
                    log::warn!("writing JSONL failed, no more lines will be written: {e}");
                    self.jsonl = None;
                }
            }
            Err(e) => {
                self.decode_errors += 1;
                log::debug!("undecodable record: {e}");
            }
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
        let finished = self.requests.drain_finished(now);
        self.finish_requests(finished, now);
    }

    /// Reads the kernel's counters and statistics into the metrics; forgets
    /// processes that are gone once their last reading is taken.
    fn read_counters(&mut self, live: &[u32]) -> Result<()> {
        let reading = self.probes.counters()?;
        let delta = self.counters.update(&reading);
        self.metrics.add_counters(&delta);
        for tgid in reading.keys() {
            if !live.contains(tgid) && !targets::is_process(*tgid) {
                self.probes.drop_counters(*tgid)?;
                self.counters.forget(*tgid);
                self.signals.forget_process(*tgid);
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
        self.signals.prune(monotonic_ns());
        let lost = self.probes.stat(Stat::RingbufLost)?;
        let dropped = self.probes.stat(Stat::ThreadStateFull)?;
        self.metrics.set_kernel_stats(lost, dropped);
        Ok(())
    }

    async fn run(&mut self, ring: RingBuf<MapData>, cfg: &AttachConfig) -> Result<Stop> {
        START.get_or_init(Instant::now);
        // SAFETY: the RingBuf owns its map fd, which stays open and unchanged
        // for as long as the AsyncFd owns the RingBuf.
        let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| anyhow::anyhow!("polling the ring buffer: {}", e.into_parts().1))?;
        let mut rescan = tokio::time::interval(RESCAN);
        let mut drain = tokio::time::interval(DRAIN);
        let mut report = tokio::time::interval(cfg.interval);
        report.tick().await;
        let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
        let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
        let deadline = cfg.duration.map(|d| tokio::time::Instant::now() + d);
        let stop = loop {
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("polling the ring buffer")?;
                    self.drain(guard.get_inner_mut());
                    guard.clear_ready();
                }
                _ = drain.tick() => self.drain(ring.get_mut()),
                _ = rescan.tick() => {
                    let live = self.attach_new_libraries()?;
                    self.read_counters(&live)?;
                    if live.is_empty() {
                        break Stop::TargetExited;
                    }
                }
                _ = report.tick() => {
                    let window = self.latency.take_window();
                    println!("{}", summary::interval_line(
                        self.elapsed_since_start(), &window, self.failed_window,
                        self.counters.total(), self.metrics.events_lost()));
                    self.failed_window = 0;
                    for line in self.request_figures.window_lines(summary::percentiles) {
                        if !line.contains(" n=0 ") {
                            println!("           {line}");
                        }
                    }
                    for line in self.cause_summary.window_lines() {
                        println!("           {line}");
                    }
                    if let Some(w) = self.jsonl.as_mut() { let _ = w.flush(); }
                }
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
