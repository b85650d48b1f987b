//! Export: one fan-out of sinks for what was routed and judged. Each judged
//! episode or request goes to every sink once: the Prometheus series of its
//! workload ([`series`]), the JSONL log ([`jsonl`]) and the terminal
//! summary ([`terminal`]). Workloads' label sets start and retire here.
//! The sinks are shown the judged records and the [`view`]s the session
//! builds (a workload's labels, a library's probes, the kernel's
//! readings), nothing of routing, tracking or the probes.

pub mod jsonl;
pub mod otlp;
pub mod prometheus;
mod series;
pub mod summary;
mod terminal;
pub mod view;

use std::{collections::VecDeque, path::Path};

use ttft_trace_common::GpuCounters;

pub use series::{LabelConfig, Series};
pub use view::{KernelView, LibraryView, WorkloadView};

use crate::{
    episodes::EpisodeRecord,
    judging::JudgedRequest,
    requests::CorrelatorStats,
    workloads::{ClaimVerdict, ProcessSeen, WorkloadLabels},
};
use jsonl::{Jsonl, RunTotals};
use otlp::{Otlp, OtlpConfig};
use terminal::Terminal;

/// Ended workloads whose request statistics are kept for the totals line;
/// older ones are dropped (a daemon sees servers restart for months).
const MAX_ENDED_STATS: usize = 1024;

pub struct Sinks {
    pub series: Series,
    jsonl: Jsonl,
    /// Traces to an OTLP collector, when configured.
    otlp: Option<Otlp>,
    terminal: Terminal,
    /// Request statistics of workloads that ended, for the totals line.
    ended_stats: VecDeque<(u32, CorrelatorStats)>,
    ended_stats_dropped: u64,
    /// What the correlators of ended workloads dropped, per table.
    ended_drops: [u64; DROP_TABLES],
}

/// The correlators' tables that count what they dropped.
const DROP_TABLES: usize = 8;

/// What a request correlator drops to stay bounded, as the `table` label
/// of `ttft_trace_table_evictions_total` names it.
fn correlator_drops(s: &CorrelatorStats) -> [(&'static str, u64); DROP_TABLES] {
    [
        ("connections_refused", s.connections_refused),
        ("kernel_connections", s.connections_lost_in_kernel),
        ("connections_idle", s.connections_evicted),
        ("held_gpu_episodes", s.episodes_dropped),
        ("finished_requests", s.requests_dropped),
        ("chunk_acks", s.chunk_acks_evicted),
        ("http2_streams", s.http2_streams_dropped),
        ("retry_candidates", s.retry_candidates_dropped),
    ]
}

/// How tracing ended, for the last summary and the totals line.
pub struct Ending<'a> {
    pub title: &'a str,
    pub stop: &'a str,
    pub elapsed_s: f64,
    pub counters: &'a GpuCounters,
    /// Request statistics of the workloads still live.
    pub live_stats: Vec<(u32, CorrelatorStats)>,
    pub unrouted_events: u64,
    pub decode_errors: u64,
}

impl Sinks {
    /// The series; no JSONL file until [`Sinks::open_jsonl`].
    pub fn new(labels: &LabelConfig) -> anyhow::Result<Self> {
        let series = Series::new(labels)?;
        let jsonl = Jsonl::new(series.registry())?;
        Ok(Self {
            series,
            jsonl,
            otlp: None,
            terminal: Terminal::default(),
            ended_stats: VecDeque::new(),
            ended_stats_dropped: 0,
            ended_drops: [0; DROP_TABLES],
        })
    }

    /// Opens the JSONL file (once the probes are loaded, so that a run
    /// that cannot trace does not create it).
    pub fn open_jsonl(&mut self, path: &Path) -> anyhow::Result<()> {
        self.jsonl.open(path)
    }

    /// Starts exporting requests as traces over OTLP.
    pub fn start_otlp(&mut self, cfg: &OtlpConfig) -> anyhow::Result<()> {
        self.otlp = Some(Otlp::start(cfg, self.series.registry())?);
        Ok(())
    }

    /// SIGHUP: the JSONL file is reopened (log rotation).
    pub fn reopen_jsonl(&mut self) {
        self.jsonl.reopen();
    }

    /// Names a new workload, creates its series and writes its JSONL
    /// line (with what it claims of its pod).
    pub fn workload_started(&mut self, root: u32, seen: &ProcessSeen) -> WorkloadLabels {
        let naming = self.series.admit(root, seen);
        let labels = &naming.labels;
        log::info!(
            "tracing workload pid {root} ({}){}",
            labels.comm,
            describe_place(labels)
        );
        if naming.verdict == Some(ClaimVerdict::Differs) {
            log::warn!(
                "workload pid {root} claims pod {}/{}, which the host's record of its pod UID \
                 {} contradicts: the claim is not used",
                naming.claim.namespace.as_deref().unwrap_or("?"),
                naming.claim.pod.as_deref().unwrap_or("?"),
                naming.pod_uid.as_deref().unwrap_or("?"),
            );
        }
        self.jsonl.workload(root, &naming);
        naming.labels
    }

    /// A workload whose processes have all exited: its series start the
    /// retirement grace period, its request statistics (`stats`) wait for
    /// the totals.
    pub fn workload_ended(&mut self, w: WorkloadView, stats: CorrelatorStats, now_ns: u64) {
        log::info!("workload pid {} ({}) has exited", w.root, w.labels.comm);
        self.series.release(w.labels, now_ns);
        // A workload that served nothing has nothing for the totals line:
        // pod churn (jobs, probes, crash loops) would otherwise push the
        // servers' statistics out of the table.
        if stats.is_quiet() && stats.connections == 0 {
            return;
        }
        if self.ended_stats.len() >= MAX_ENDED_STATS {
            self.ended_stats.pop_front();
            self.ended_stats_dropped += 1;
            self.series
                .evictions("ended_workload_stats", self.ended_stats_dropped);
        }
        for (sum, (_, n)) in self.ended_drops.iter_mut().zip(correlator_drops(&stats)) {
            *sum += n;
        }
        self.ended_stats.push_back((w.root, stats));
    }

    pub fn episode(&mut self, w: WorkloadView, rec: &EpisodeRecord) {
        self.series.episode(&w.label_values(), rec);
        self.terminal.episode(rec);
        self.jsonl.episode(rec);
    }

    pub fn request(&mut self, w: WorkloadView, j: &JudgedRequest) {
        self.series.request(&w.label_values(), j);
        self.terminal.request(j);
        self.jsonl.request(w, j);
        if let Some(o) = &mut self.otlp {
            o.request(w.labels, w.root, j);
        }
    }

    pub fn library_attached(&mut self, a: &LibraryView) {
        log::info!(
            "attached {} probes to {} ({}) in {:.1} ms",
            a.symbols,
            a.path.display(),
            a.apis.join("+"),
            a.attach_ms
        );
        for (sym, err) in a.failed {
            log::warn!("could not probe {sym} in {}: {err}", a.path.display());
        }
        self.jsonl.attached(a);
    }

    pub fn library_detached(&mut self, a: &LibraryView) {
        log::info!(
            "detached the {} probes of {}: no traced process maps it any more",
            a.symbols,
            a.path.display()
        );
        self.jsonl.detached(a);
    }

    /// Retires the label sets idle for the grace period, and the OTLP
    /// metrics' attribute sets of them.
    pub fn retire(&mut self, now_ns: u64) {
        let retired = self.series.retire(now_ns);
        if let Some(o) = &mut self.otlp {
            let (refused, kept) = o.attribute_sets(&retired);
            let name = crate::workloads::quota::Resource::OtlpAttributeSets.name();
            self.series.quota_exceeded(name, refused);
            self.series.entries(name, kept);
        }
    }

    /// Ended workloads whose request statistics wait for the totals line.
    pub fn ended_stats(&self) -> usize {
        self.ended_stats.len()
    }

    /// Exports what the correlators dropped so far: those of ended
    /// workloads and of the `live` ones.
    pub fn correlator_drops(&self, live: impl Iterator<Item = CorrelatorStats>) {
        let mut totals = self.ended_drops;
        for stats in live {
            for (sum, (_, n)) in totals.iter_mut().zip(correlator_drops(&stats)) {
                *sum += n;
            }
        }
        let tables = correlator_drops(&CorrelatorStats::default()).map(|(table, _)| table);
        for (table, total) in tables.into_iter().zip(totals) {
            self.series.evictions(table, total);
        }
    }

    pub fn kernel(&self, k: &KernelView) {
        self.series.kernel(k);
    }

    /// The summary lines of the interval that ends now; the JSONL buffer
    /// goes to the file.
    pub fn interval(&mut self, elapsed_s: f64, counters: &GpuCounters) {
        let lost = self.series.events_lost();
        self.terminal.interval(elapsed_s, counters, lost);
        self.jsonl.flush();
    }

    /// The final summary and the totals line.
    pub fn finish(&mut self, end: Ending) {
        let lost = self.series.events_lost();
        self.terminal
            .finish(end.title, end.elapsed_s, end.counters, lost);
        if end.decode_errors > 0 {
            log::warn!(
                "{} ring-buffer records could not be decoded",
                end.decode_errors
            );
        }
        let mut stats: Vec<_> = std::mem::take(&mut self.ended_stats).into();
        stats.extend(end.live_stats);
        let (episodes_ok, episodes_failed) = self.terminal.episodes();
        self.jsonl.totals(&RunTotals {
            stop: end.stop,
            counters: end.counters,
            episodes_ok,
            episodes_failed,
            events_lost: lost,
            requests: self.terminal.requests_total,
            request_stats: &stats,
            unrouted_events: end.unrouted_events,
        });
        self.jsonl.flush();
        if let Some(o) = &mut self.otlp {
            o.shutdown();
        }
        if self.jsonl.errors() > 0 {
            log::warn!(
                "{} writes to the JSONL file failed; those lines are missing",
                self.jsonl.errors()
            );
        }
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
