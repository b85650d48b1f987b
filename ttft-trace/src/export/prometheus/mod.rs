//! Prometheus metrics and the /metrics endpoint: the GPU episode and CUDA
//! counter families here, the request, cause and host signal families in
//! the submodules.
//!
//! Base units, `_total` counters, histograms rather than percentile gauges,
//! and low-cardinality labels only (never a pid, request or kernel name).

mod causes;
pub mod connections;
mod requests;
mod signals;
mod stalls;

pub use causes::CauseMetrics;
pub use requests::RequestMetrics;
pub use signals::SignalMetrics;
pub use stalls::StallMetrics;

use std::net::{SocketAddr, TcpListener};

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use thiserror::Error;
use ttft_trace_common::{Direction, GpuCounters, counters::DIRECTIONS};

use crate::episodes::EpisodeRecord;
use crate::probes::libraries::ReadStats;
use crate::workloads::quota::Resource;

#[derive(Debug, Error)]
pub enum MetricsError {
    #[error(
        "cannot listen on {addr}: {source}{hint}",
        hint = if source.kind() == std::io::ErrorKind::AddrInUse {
            " (another process holds this port; pick another with --listen ADDR:PORT)"
        } else { "" }
    )]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("registering metric: {0}")]
    Register(#[from] prometheus::Error),
}

/// Bucket bounds for GPU episode latency, seconds: 100 µs to 10 s (a decode
/// step is milliseconds, a long prefill can be seconds).
const EPISODE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Label names of a per-workload series with one more label.
pub fn with_label<'a>(workload: &[&'a str], extra: &'a str) -> Vec<&'a str> {
    let mut v = workload.to_vec();
    v.push(extra);
    v
}

pub struct Metrics {
    pub registry: Registry,
    launch_to_first_d2h: HistogramVec,
    episodes: IntCounterVec,
    kernel_launches: IntCounterVec,
    graph_launches: IntCounterVec,
    memcpy_bytes: IntCounterVec,
    memcpy_calls: IntCounterVec,
    events_lost: IntCounter,
    segments_unseen: IntCounter,
    thread_state_dropped: IntCounter,
    h2_frames_dropped: IntCounter,
    h2_walk_lost: IntCounter,
    tls_unbound: IntCounter,
    tls_held: IntCounter,
    tls_held_sent: IntCounter,
    table_evictions: IntCounterVec,
    map_full: IntCounterVec,
    traced_processes: IntGauge,
    attached_libraries: IntGaugeVec,
    workloads: IntGauge,
    workload_overflows: IntCounter,
    target_reads_overdue: IntCounterVec,
    libraries_refused: IntCounterVec,
    quota_exceeded: IntCounterVec,
    target_reads_stuck: IntGauge,
    targets_set_aside: IntGauge,
    listeners_followed: IntGauge,
    table_entries: IntGaugeVec,
}

impl Metrics {
    /// `workload_labels`: the label names every per-workload series carries.
    pub fn new(workload_labels: &[&str]) -> Result<Self, MetricsError> {
        let w = workload_labels;
        let registry = Registry::new();
        let launch_to_first_d2h = HistogramVec::new(
            HistogramOpts::new(
                "ttft_trace_launch_to_first_d2h_seconds",
                "GPU episode latency: entry of the first kernel or graph launch to completion \
                 of the first device-to-host copy after it",
            )
            .buckets(EPISODE_BUCKETS.to_vec()),
            w,
        )?;
        let episodes = IntCounterVec::new(
            Opts::new(
                "ttft_trace_gpu_episodes_total",
                "GPU episodes seen, by the result of the call that completed the copy",
            ),
            &with_label(w, "result"),
        )?;
        let kernel_launches = IntCounterVec::new(
            Opts::new(
                "ttft_trace_cuda_kernel_launches_total",
                "Kernel launches (runtime and driver API, each launch counted once)",
            ),
            w,
        )?;
        let graph_launches = IntCounterVec::new(
            Opts::new(
                "ttft_trace_cuda_graph_launches_total",
                "CUDA graph launches",
            ),
            w,
        )?;
        let memcpy_bytes = IntCounterVec::new(
            Opts::new(
                "ttft_trace_cuda_memcpy_bytes_total",
                "Bytes requested by memory copy calls, by direction (h2d, d2h, d2d, h2h, unknown)",
            ),
            &with_label(w, "direction"),
        )?;
        let memcpy_calls = IntCounterVec::new(
            Opts::new(
                "ttft_trace_cuda_memcpy_calls_total",
                "Memory copy calls, by direction",
            ),
            &with_label(w, "direction"),
        )?;
        let events_lost = IntCounter::new(
            "ttft_trace_events_lost_total",
            "Events dropped in the kernel because the ring buffer was full",
        )?;
        let segments_unseen = IntCounter::new(
            "ttft_trace_segments_unseen_total",
            "Followed connections whose first bytes were read with none of their TCP segments \
             seen (their requests get no arrival time from a segment)",
        )?;
        let thread_state_dropped = IntCounter::new(
            "ttft_trace_thread_state_dropped_total",
            "CUDA calls not followed because the per-thread state map was full",
        )?;
        let h2_frames_dropped = IntCounter::new(
            "ttft_trace_http2_frames_dropped_total",
            "HTTP/2 frames walked in the kernel but not reported: their event refused by a \
             full ring buffer",
        )?;
        let h2_walk_lost = IntCounter::new(
            "ttft_trace_http2_walk_lost_total",
            "Times the kernel's walk of an HTTP/2 connection's frames lost its place in one \
             direction (a frame header split across calls, a segment after a gap, too many \
             frames in one call); its frames go unread until a call starts on a frame again",
        )?;
        let tls_unbound = IntCounter::new(
            "ttft_trace_tls_plaintext_unbound_total",
            "SSL_write calls of traced processes that neither sent their records on a followed \
             connection nor held them for a later send (a memory BIO without OpenSSL's \
             libcrypto probed): their plaintext is not read",
        )?;
        let tls_held = IntCounter::new(
            "ttft_trace_tls_plaintext_held_total",
            "SSL_write calls of traced processes whose records went to a memory BIO, held for \
             the TCP send that carries them later (bound by their ciphertext)",
        )?;
        let tls_held_sent = IntCounter::new(
            "ttft_trace_tls_plaintext_held_sent_total",
            "Of ttft_trace_tls_plaintext_held_total, the calls whose first record a send on a \
             followed connection carried; the difference was never bound (sent on a \
             connection not followed, evicted, or split where its start was not found)",
        )?;
        let table_evictions = IntCounterVec::new(
            Opts::new(
                "ttft_trace_table_evictions_total",
                "Entries dropped from a bounded userspace table because it was full \
                 (docs/hostile-input.md: the bounds table)",
            ),
            &["table"],
        )?;
        let map_full = IntCounterVec::new(
            Opts::new(
                "ttft_trace_map_full_total",
                "Inserts into a kernel map refused because it was full (what it would have \
                 followed is not traced)",
            ),
            &["map"],
        )?;
        let traced_processes =
            IntGauge::new("ttft_trace_traced_processes", "Processes currently traced")?;
        let attached_libraries = IntGaugeVec::new(
            Opts::new(
                "ttft_trace_attached_libraries",
                "CUDA libraries with probes attached, by API",
            ),
            &["api"],
        )?;
        let workloads = IntGauge::new(
            "ttft_trace_workloads",
            "Workload label sets in use (live, or gone and within the retirement grace period)",
        )?;
        let workload_overflows = IntCounter::new(
            "ttft_trace_workload_label_overflows_total",
            "Workloads reported under comm=\"_other\" because the label-set cap was reached",
        )?;
        let target_reads_overdue = IntCounterVec::new(
            Opts::new(
                "ttft_trace_target_reads_overdue_total",
                "Reads of a target's files (its /proc maps, the files it maps) given up: \
                 abandoned after making no progress for the deadline (its thread left stuck), \
                 or refused while too many threads were stuck",
            ),
            &["outcome"],
        )?;
        let libraries_refused = IntCounterVec::new(
            Opts::new(
                "ttft_trace_libraries_refused_total",
                "Mapped files not probed for a cap on the ELF work they ask for: too_large \
                 (over 256 MiB of headers and symbol tables, or 4 million symbols) or \
                 too_many_copies (a probed function defined at over 16 addresses); each file \
                 once",
            ),
            &["reason"],
        )?;
        let quota_exceeded = IntCounterVec::new(
            Opts::new(
                "ttft_trace_quota_exceeded_total",
                "What one tenant (a pod, else a cgroup) was refused past its share of a \
                 host-wide resource, it alone degraded: label_sets (workloads put in its own \
                 comm=\"_other\" set), listeners (listening sockets not followed, each once), \
                 threads (threads and child processes not tracked)",
            ),
            &["resource"],
        )?;
        let target_reads_stuck = IntGauge::new(
            "ttft_trace_target_reads_stuck_threads",
            "Threads abandoned in a read of a target's file that has not returned yet",
        )?;
        let targets_set_aside = IntGauge::new(
            "ttft_trace_targets_set_aside",
            "Processes and files set aside (not read, with backoff) after a read of them did \
             not return, now or within the last minute",
        )?;
        let listeners_followed = IntGauge::new(
            "ttft_trace_listeners_followed",
            "(network namespace, port) pairs of listening sockets followed in the kernel \
             (LISTEN_NETNS), at the last scan",
        )?;
        let table_entries = IntGaugeVec::new(
            Opts::new(
                "ttft_trace_table_entries",
                "Entries held now in a table the daemon keeps per target (workload, process, \
                 socket, cgroup, library), at the last scan: each goes when its target goes \
                 (docs/hostile-input.md: the bounds table)",
            ),
            &["table"],
        )?;
        let build_info = IntGaugeVec::new(
            Opts::new("ttft_trace_build_info", "Build information; always 1"),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        for c in [
            Box::new(launch_to_first_d2h.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(episodes.clone()),
            Box::new(kernel_launches.clone()),
            Box::new(graph_launches.clone()),
            Box::new(memcpy_bytes.clone()),
            Box::new(memcpy_calls.clone()),
            Box::new(events_lost.clone()),
            Box::new(segments_unseen.clone()),
            Box::new(thread_state_dropped.clone()),
            Box::new(h2_frames_dropped.clone()),
            Box::new(h2_walk_lost.clone()),
            Box::new(tls_unbound.clone()),
            Box::new(tls_held.clone()),
            Box::new(tls_held_sent.clone()),
            Box::new(table_evictions.clone()),
            Box::new(map_full.clone()),
            Box::new(traced_processes.clone()),
            Box::new(attached_libraries.clone()),
            Box::new(workloads.clone()),
            Box::new(workload_overflows.clone()),
            Box::new(target_reads_overdue.clone()),
            Box::new(libraries_refused.clone()),
            Box::new(quota_exceeded.clone()),
            Box::new(target_reads_stuck.clone()),
            Box::new(targets_set_aside.clone()),
            Box::new(listeners_followed.clone()),
            Box::new(table_entries.clone()),
            Box::new(build_info),
        ] {
            registry.register(c)?;
        }
        Ok(Self {
            registry,
            launch_to_first_d2h,
            episodes,
            kernel_launches,
            graph_launches,
            memcpy_bytes,
            memcpy_calls,
            events_lost,
            segments_unseen,
            thread_state_dropped,
            h2_frames_dropped,
            h2_walk_lost,
            tls_unbound,
            tls_held,
            tls_held_sent,
            table_evictions,
            map_full,
            traced_processes,
            attached_libraries,
            workloads,
            workload_overflows,
            target_reads_overdue,
            libraries_refused,
            quota_exceeded,
            target_reads_stuck,
            targets_set_aside,
            listeners_followed,
            table_entries,
        })
    }

    /// Creates a workload's series at zero, so that rate() works from the
    /// first scrape.
    pub fn init_workload(&self, w: &[&str]) {
        self.launch_to_first_d2h.with_label_values(w);
        self.kernel_launches.with_label_values(w);
        self.graph_launches.with_label_values(w);
        for dir in Direction::ALL {
            self.memcpy_bytes
                .with_label_values(&with_label(w, dir.name()));
            self.memcpy_calls
                .with_label_values(&with_label(w, dir.name()));
        }
        for result in ["ok", "error"] {
            self.episodes.with_label_values(&with_label(w, result));
        }
    }

    /// Removes a retired workload's series.
    pub fn retire_workload(&self, w: &[&str]) {
        let _ = self.launch_to_first_d2h.remove_label_values(w);
        let _ = self.kernel_launches.remove_label_values(w);
        let _ = self.graph_launches.remove_label_values(w);
        for dir in Direction::ALL {
            let _ = self
                .memcpy_bytes
                .remove_label_values(&with_label(w, dir.name()));
            let _ = self
                .memcpy_calls
                .remove_label_values(&with_label(w, dir.name()));
        }
        for result in ["ok", "error"] {
            let _ = self.episodes.remove_label_values(&with_label(w, result));
        }
    }

    /// An episode of workload `w`: counted by result; only successful ones
    /// enter the latency histogram (a failed synchronise measures nothing).
    pub fn observe_episode(&self, ep: &EpisodeRecord, w: &[&str]) {
        let result = if ep.ok() { "ok" } else { "error" };
        self.episodes
            .with_label_values(&with_label(w, result))
            .inc();
        if ep.ok() {
            self.launch_to_first_d2h
                .with_label_values(w)
                .observe(ep.launch_to_first_d2h_ns as f64 / 1e9);
        }
    }

    /// Adds the growth of workload `w`'s kernel counters since the last reading.
    pub fn add_counters(&self, delta: &GpuCounters, w: &[&str]) {
        self.kernel_launches
            .with_label_values(w)
            .inc_by(delta.kernel_launches);
        self.graph_launches
            .with_label_values(w)
            .inc_by(delta.graph_launches);
        for (i, dir) in Direction::ALL.iter().enumerate().take(DIRECTIONS) {
            self.memcpy_bytes
                .with_label_values(&with_label(w, dir.name()))
                .inc_by(delta.memcpy_bytes[i]);
            self.memcpy_calls
                .with_label_values(&with_label(w, dir.name()))
                .inc_by(delta.memcpy_calls[i]);
        }
    }

    /// Label sets in use, and the overflow count so far (a total).
    pub fn set_workloads(&self, sets: usize, overflowed: u64) {
        self.workloads.set(sets as i64);
        self.workload_overflows
            .inc_by(overflowed.saturating_sub(self.workload_overflows.get()));
    }

    /// The listening pairs followed in the kernel now.
    pub fn set_listeners_followed(&self, n: usize) {
        self.listeners_followed.set(n as i64);
    }

    /// Sets the count of what tenants were refused past their share of
    /// `resource` to its total.
    pub fn set_quota_exceeded(&self, resource: &str, total: u64) {
        let c = self.quota_exceeded.with_label_values(&[resource]);
        c.inc_by(total.saturating_sub(c.get()));
    }

    /// Sets the lost-event, unseen-segment and dropped-state counters to
    /// the kernel's totals.
    pub fn set_kernel_stats(&self, lost: u64, segments_unseen: u64, state_dropped: u64) {
        let bump = |c: &IntCounter, total: u64| c.inc_by(total.saturating_sub(c.get()));
        bump(&self.events_lost, lost);
        bump(&self.segments_unseen, segments_unseen);
        bump(&self.thread_state_dropped, state_dropped);
    }

    /// Sets the HTTP/2 walk's counters to the kernel's totals.
    pub fn set_protocol_stats(&self, frames_dropped: u64, walk_lost: u64) {
        bump_to(&self.h2_frames_dropped, frames_dropped);
        bump_to(&self.h2_walk_lost, walk_lost);
    }

    /// Sets the TLS binding's counters to the kernel's totals.
    pub fn set_tls_stats(&self, unbound: u64, held: u64, held_sent: u64) {
        bump_to(&self.tls_unbound, unbound);
        bump_to(&self.tls_held, held);
        bump_to(&self.tls_held_sent, held_sent);
    }

    /// Sets map `map`'s refused-insert counter to the kernel's total.
    pub fn set_map_full(&self, map: &str, total: u64) {
        let c = self.map_full.with_label_values(&[map]);
        c.inc_by(total.saturating_sub(c.get()));
    }

    /// Sets the gauge of the entries table `table` holds now.
    pub fn set_table_entries(&self, table: &str, n: usize) {
        self.table_entries
            .with_label_values(&[table])
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Sets table `table`'s eviction counter to its total so far.
    pub fn set_evictions(&self, table: &str, total: u64) {
        let c = self.table_evictions.with_label_values(&[table]);
        c.inc_by(total.saturating_sub(c.get()));
    }

    /// Sets the overdue reads' counters and gauges to the scanner's.
    pub fn set_target_reads(&self, reads: &ReadStats) {
        for (outcome, total) in [
            ("abandoned", reads.work.abandoned),
            ("refused", reads.work.refused),
        ] {
            let c = self.target_reads_overdue.with_label_values(&[outcome]);
            c.inc_by(total.saturating_sub(c.get()));
        }
        for (reason, total) in [
            ("too_large", reads.too_large),
            ("too_many_copies", reads.too_many_copies),
        ] {
            let c = self.libraries_refused.with_label_values(&[reason]);
            c.inc_by(total.saturating_sub(c.get()));
        }
        self.target_reads_stuck
            .set(i64::try_from(reads.work.stuck_now).unwrap_or(i64::MAX));
        self.targets_set_aside
            .set(i64::try_from(reads.set_aside).unwrap_or(i64::MAX));
        self.set_evictions("set_aside", reads.set_aside_overflowed);
        self.set_quota_exceeded(Resource::StuckReads.name(), reads.stuck_share_refused);
    }

    pub fn set_traced(&self, processes: usize, runtime_libs: usize, driver_libs: usize) {
        self.traced_processes.set(processes as i64);
        self.attached_libraries
            .with_label_values(&["runtime"])
            .set(runtime_libs as i64);
        self.attached_libraries
            .with_label_values(&["driver"])
            .set(driver_libs as i64);
    }

    pub fn events_lost(&self) -> u64 {
        self.events_lost.get()
    }
}

/// The registry in Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    // Encoding into a Vec cannot fail for well-formed metric families.
    if let Err(e) = TextEncoder::new().encode(&registry.gather(), &mut buf) {
        log::warn!("encoding metrics: {e}");
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Binds the listen address now, so that a port in use is an error at start
/// rather than a log line later.
pub fn bind(addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    let listener =
        TcpListener::bind(addr).map_err(|source| MetricsError::Listen { addr, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| MetricsError::Listen { addr, source })?;
    Ok(listener)
}

/// Serves `/metrics` (and a plain `/` pointing at it) until the task is
/// dropped, through [`connections::GuardedListener`] (connections capped
/// and timed out).
pub async fn serve(listener: TcpListener, registry: Registry) -> std::io::Result<()> {
    serve_guarded(
        listener,
        registry,
        connections::MAX_CONNECTIONS,
        connections::CONNECTION_DEADLINE,
    )
    .await
}

/// [`serve`] with the guard's cap and deadline given (tests).
pub async fn serve_guarded(
    listener: TcpListener,
    registry: Registry,
    max: usize,
    deadline: std::time::Duration,
) -> std::io::Result<()> {
    use axum::{Router, http::header, response::IntoResponse, routing::get};
    let registry_for_guard = registry.clone();
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = render(&registry);
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        body,
                    )
                        .into_response()
                }
            }),
        )
        .route("/", get(|| async { "ttft-trace: metrics at /metrics\n" }));
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let guarded = connections::GuardedListener::new(listener, &registry_for_guard, max, deadline)
        .map_err(std::io::Error::other)?;
    axum::serve(guarded, app).await
}

/// Moves counter `c` up to the kernel's running `total`.
fn bump_to(c: &IntCounter, total: u64) {
    c.inc_by(total.saturating_sub(c.get()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_documented_series() {
        let m = Metrics::new(&["comm", "pod"]).expect("metrics");
        let w = ["python3", ""];
        m.init_workload(&w);
        let mut delta = GpuCounters {
            kernel_launches: 5,
            ..GpuCounters::default()
        };
        delta.memcpy_bytes[Direction::DeviceToHost as usize] = 4096;
        m.add_counters(&delta, &w);
        m.set_kernel_stats(3, 2, 0);
        m.set_kernel_stats(3, 2, 0);
        m.set_workloads(1, 2);
        m.set_workloads(1, 2);
        m.set_quota_exceeded("label_sets", 4);
        m.set_quota_exceeded("label_sets", 4);
        let text = render(&m.registry);
        for needle in [
            "ttft_trace_launch_to_first_d2h_seconds_bucket{comm=\"python3\",pod=\"\",le=\"0.0001\"} 0",
            "ttft_trace_cuda_kernel_launches_total{comm=\"python3\",pod=\"\"} 5",
            "ttft_trace_cuda_graph_launches_total{comm=\"python3\",pod=\"\"} 0",
            "ttft_trace_cuda_memcpy_bytes_total{comm=\"python3\",direction=\"d2h\",pod=\"\"} 4096",
            "ttft_trace_cuda_memcpy_bytes_total{comm=\"python3\",direction=\"h2d\",pod=\"\"} 0",
            "ttft_trace_events_lost_total 3",
            "ttft_trace_segments_unseen_total 2",
            "ttft_trace_workload_label_overflows_total 2",
            "ttft_trace_quota_exceeded_total{resource=\"label_sets\"} 4",
            "ttft_trace_build_info{version=",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        m.retire_workload(&w);
        let text = render(&m.registry);
        assert!(!text.contains("python3"), "retired series remain:\n{text}");
    }

    #[test]
    fn port_in_use_is_a_clear_error() {
        let first = bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let addr = first.local_addr().expect("addr");
        let err = bind(addr).expect_err("second bind fails").to_string();
        assert!(err.contains("another process holds this port"), "{err}");
    }
}
