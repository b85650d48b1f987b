//! The JSONL log: one line per probed library, GPU episode and request, and
//! a totals line at the end. One writer, one error policy: a failed write
//! is logged once and counted (`ttft_trace_jsonl_write_errors_total`), and
//! tracing goes on. The file is opened for append (a restarted daemon adds
//! to it), created mode 0640 (request lines name clients), and reopened on
//! SIGHUP so that logrotate can move it away.

use std::{
    fs::{File, OpenOptions},
    io::{BufWriter, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use prometheus::{IntCounter, Registry};
use serde::Serialize;
use serde_json::json;
use ttft_trace_common::{Direction, GpuCounters};

use crate::{
    causes::{Attribution, Evidence},
    episodes::EpisodeRecord,
    host::clock::monotonic_ns,
    judging::JudgedRequest,
    nvml::WindowReadings,
    probes::Attached,
    requests::{CorrelatorStats, RequestRecord},
    routing::Workload,
};

/// A request's line: the record, its workload, its attribution (`slow`,
/// `causes`), and for slow requests the evidence read (GPU readings
/// included).
#[derive(Serialize)]
struct RequestLine<'a> {
    #[serde(flatten)]
    record: &'a RequestRecord,
    workload: &'a crate::workloads::WorkloadLabels,
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

/// What the last line sums up.
pub struct Totals<'a> {
    /// Why tracing stopped.
    pub stop: &'a str,
    pub counters: &'a GpuCounters,
    pub episodes_ok: u64,
    pub episodes_failed: u64,
    pub events_lost: u64,
    pub requests: u64,
    pub request_stats: &'a [(u32, CorrelatorStats)],
    pub unrouted_events: u64,
}

pub struct Jsonl {
    out: Option<BufWriter<File>>,
    path: Option<PathBuf>,
    errors: IntCounter,
}

impl Jsonl {
    /// No file yet; registers the error counter.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let errors = IntCounter::new(
            "ttft_trace_jsonl_write_errors_total",
            "Writes to the JSONL file that failed (the line is lost; tracing goes on)",
        )?;
        registry.register(Box::new(errors.clone()))?;
        Ok(Self {
            out: None,
            path: None,
            errors,
        })
    }

    /// Opens the file for append (created 0640); lines are written from
    /// now on.
    pub fn open(&mut self, path: &Path) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        self.out = Some(BufWriter::new(file));
        self.path = Some(path.to_path_buf());
        Ok(())
    }

    /// Flushes and reopens the file by its path (after logrotate moved
    /// it). A failure is logged; lines then go to the old file.
    pub fn reopen(&mut self) {
        let Some(path) = self.path.clone() else {
            return;
        };
        self.flush();
        match self.open(&path) {
            Ok(()) => log::info!("reopened {}", path.display()),
            Err(e) => log::warn!("reopening the JSONL file: {e:#}"),
        }
    }

    fn write(&mut self, value: &impl Serialize) {
        let Some(out) = self.out.as_mut() else { return };
        let written = serde_json::to_writer(&mut *out, value)
            .map_err(std::io::Error::from)
            .and_then(|()| out.write_all(b"\n"));
        if let Err(e) = written {
            self.failed(&e);
        }
    }

    fn failed(&self, e: &std::io::Error) {
        if self.errors.get() == 0 {
            log::warn!("writing the JSONL file failed (later failures are only counted): {e}");
        }
        self.errors.inc();
    }

    pub fn episode(&mut self, rec: &EpisodeRecord) {
        self.write(rec);
    }

    pub fn request(&mut self, w: &Workload, j: &JudgedRequest) {
        self.write(&RequestLine {
            record: &j.record,
            workload: &w.labels,
            workload_pid: w.root,
            attribution: &j.attribution,
            tcp_retransmits: j.tcp_retransmits,
            gpu: j.evidence.gpu.as_ref(),
            evidence: j.attribution.slow.then_some(&j.evidence),
        });
    }

    pub fn attached(&mut self, a: &Attached) {
        let apis: Vec<&str> = a.apis.iter().map(|x| x.name()).collect();
        self.write(&json!({
            "type": "attach", "t_ns": monotonic_ns(), "library": a.path,
            "apis": apis, "symbols": a.symbols, "failed": a.failed.len(), "attach_ms": a.attach_ms,
        }));
    }

    pub fn detached(&mut self, a: &Attached) {
        self.write(&json!({
            "type": "detach", "t_ns": monotonic_ns(), "library": a.path, "symbols": a.symbols,
        }));
    }

    /// The last line: what the kernel counted over the whole run.
    pub fn totals(&mut self, t: &Totals) {
        let mut bytes = serde_json::Map::new();
        let mut calls = serde_json::Map::new();
        for dir in Direction::ALL {
            bytes.insert(
                dir.name().into(),
                t.counters.memcpy_bytes[dir as usize].into(),
            );
            calls.insert(
                dir.name().into(),
                t.counters.memcpy_calls[dir as usize].into(),
            );
        }
        let stats: Vec<serde_json::Value> = t
            .request_stats
            .iter()
            .map(|(root, s)| json!({"workload_pid": root, "stats": s}))
            .collect();
        self.write(&json!({
            "type": "totals", "t_ns": monotonic_ns(), "stop": t.stop,
            "episodes_ok": t.episodes_ok, "episodes_failed": t.episodes_failed,
            "kernel_launches": t.counters.kernel_launches,
            "graph_launches": t.counters.graph_launches,
            "memcpy_bytes": bytes, "memcpy_calls": calls, "events_lost": t.events_lost,
            "requests": t.requests, "request_stats": stats,
            "unrouted_events": t.unrouted_events,
        }));
    }

    /// Pushes buffered lines to the file.
    pub fn flush(&mut self) {
        if let Some(Err(e)) = self.out.as_mut().map(Write::flush) {
            self.failed(&e);
        }
    }

    /// Failed writes so far.
    pub fn errors(&self) -> u64 {
        self.errors.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_is_counted_and_tracing_goes_on() {
        let registry = Registry::new();
        let mut j = Jsonl::new(&registry).expect("counter");
        j.write(&json!({"type": "x"}));
        assert_eq!(j.errors(), 0, "no file: nothing to fail");
        // /dev/full fails every write with ENOSPC.
        j.open(Path::new("/dev/full")).expect("opens");
        for _ in 0..3 {
            // Larger than the buffer, so that each line reaches the file.
            j.write(&json!({"pad": "x".repeat(16 << 10)}));
        }
        j.flush();
        assert!(j.errors() >= 3, "each failure counted: {}", j.errors());
        let text = crate::export::prometheus::render(&registry);
        assert!(
            text.contains(&format!(
                "ttft_trace_jsonl_write_errors_total {}",
                j.errors()
            )),
            "{text}"
        );
    }

    #[test]
    fn appended_created_0640_and_reopened_after_a_move() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ttft-jsonl-rotate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("requests.jsonl");
        std::fs::write(&path, "{\"earlier\":1}\n").expect("an earlier run's file");
        let registry = Registry::new();
        let mut j = Jsonl::new(&registry).expect("counter");
        j.open(&path).expect("open");
        j.write(&json!({"n": 1}));
        // logrotate moves the file away, then signals.
        let rotated = dir.join("requests.jsonl.1");
        std::fs::rename(&path, &rotated).expect("rotate");
        j.reopen();
        j.write(&json!({"n": 2}));
        j.flush();
        let old = std::fs::read_to_string(&rotated).expect("rotated");
        assert_eq!(
            old, "{\"earlier\":1}\n{\"n\":1}\n",
            "appended, not truncated"
        );
        assert_eq!(std::fs::read_to_string(&path).expect("new"), "{\"n\":2}\n");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o640 & !umask(),
            "created 0640 (less the umask)"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// This process's umask, as /proc tells it (setting it to read it
    /// would race with the other tests' files).
    fn umask() -> u32 {
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("Umask:"))
            .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
            .expect("Umask line")
    }

    #[test]
    fn lines_reach_the_file() {
        let path = std::env::temp_dir().join(format!("ttft-jsonl-{}.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let registry = Registry::new();
        let mut j = Jsonl::new(&registry).expect("counter");
        j.open(&path).expect("create");
        j.write(&json!({"type": "a"}));
        j.write(&json!({"type": "b"}));
        j.flush();
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text, "{\"type\":\"a\"}\n{\"type\":\"b\"}\n");
        assert_eq!(j.errors(), 0);
        let _ = std::fs::remove_file(&path);
    }
}
