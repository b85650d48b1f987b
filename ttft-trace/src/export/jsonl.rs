//! The JSONL log: one line per probed library, GPU episode and request, and
//! a totals line at the end. One writer, one error policy: a failed write
//! is logged once and counted (`ttft_trace_jsonl_write_errors_total`), and
//! tracing goes on. The file is opened for append (a restarted daemon adds
//! to it), created mode 0640 (request lines name clients), and reopened on
//! SIGHUP so that logrotate can move it away; never through a symlink in
//! any component of its path (`host::own_files`).

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
};

use prometheus::{IntCounter, Registry};
use serde::Serialize;
use ttft_trace_common::{Direction, GpuCounters};

use super::view::{LibraryView, WorkloadView};
use crate::{
    episodes::EpisodeRecord,
    host::{clock::monotonic_ns, own_files::open_append_no_symlinks},
    jsonl_schema::{
        Attach, Detach, RequestLine, Totals, Workload, WorkloadLine, WorkloadStats, kind,
    },
    judging::JudgedRequest,
    requests::CorrelatorStats,
    workloads::Naming,
};

/// What the last line sums up.
pub struct RunTotals<'a> {
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
        // No symlink followed in any component: see host::own_files.
        let file = open_append_no_symlinks(path, 0o640)
            .with_context(|| format!("opening the JSONL file {}", path.display()))?;
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

    pub fn request(&mut self, w: WorkloadView, j: &JudgedRequest) {
        self.write(&RequestLine {
            record: &j.record,
            workload: w.labels,
            workload_pid: w.root,
            attribution: &j.attribution,
            tcp_retransmits: j.tcp_retransmits,
            gpu: j.evidence.gpu.as_ref(),
            evidence: j.attribution.slow.then_some(&j.evidence),
            stalls: &j.stalls,
        });
    }

    /// A workload followed from now on, rooted at `root`.
    pub fn workload(&mut self, root: u32, naming: &Naming) {
        self.write(&workload_line(root, naming, monotonic_ns()));
    }

    pub fn attached(&mut self, a: &LibraryView) {
        self.write(&attach_line(a, monotonic_ns()));
    }

    pub fn detached(&mut self, a: &LibraryView) {
        self.write(&detach_line(a, monotonic_ns()));
    }

    /// The last line: what the kernel counted over the whole run.
    pub fn totals(&mut self, t: &RunTotals) {
        match totals_line(t, monotonic_ns()) {
            Ok(line) => self.write(&line),
            Err(e) => self.failed(&e.into()),
        }
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

/// The line of the workload rooted at `root`, named by `naming`, at `t_ns`.
fn workload_line(root: u32, naming: &Naming, t_ns: u64) -> WorkloadLine {
    let l = &naming.labels;
    WorkloadLine {
        kind: kind::WORKLOAD.into(),
        t_ns,
        workload_pid: root,
        workload: Workload {
            comm: l.comm.clone(),
            container: l.container.clone(),
            pod: l.pod.clone(),
            namespace: l.namespace.clone(),
        },
        pod_uid: naming.pod_uid.clone(),
        claimed_pod: naming.claim.pod.clone(),
        claimed_namespace: naming.claim.namespace.clone(),
        claim_verdict: naming.verdict.map(|v| v.as_str().into()),
    }
}

/// The line of a library whose probes were attached at `t_ns`.
fn attach_line(a: &LibraryView, t_ns: u64) -> Attach {
    Attach {
        apis: a.apis.iter().map(|api| api.to_string()).collect(),
        attach_ms: a.attach_ms,
        failed: a.failed.len(),
        library: a.path.to_path_buf(),
        symbols: a.symbols,
        t_ns,
        kind: kind::ATTACH.into(),
    }
}

fn detach_line(a: &LibraryView, t_ns: u64) -> Detach {
    Detach {
        library: a.path.to_path_buf(),
        symbols: a.symbols,
        t_ns,
        kind: kind::DETACH.into(),
    }
}

/// The totals line of `t`, stamped `t_ns`.
fn totals_line(t: &RunTotals, t_ns: u64) -> serde_json::Result<Totals> {
    let by_direction = |per: &[u64]| {
        Direction::ALL
            .iter()
            .map(|&dir| (dir.name().to_string(), per[dir as usize]))
            .collect()
    };
    let request_stats = t
        .request_stats
        .iter()
        .map(|(root, s)| {
            // By field name, as the line has always carried them.
            let stats = serde_json::from_value(serde_json::to_value(s)?)?;
            Ok(WorkloadStats {
                stats,
                workload_pid: *root,
            })
        })
        .collect::<serde_json::Result<_>>()?;
    Ok(Totals {
        episodes_failed: t.episodes_failed,
        episodes_ok: t.episodes_ok,
        events_lost: t.events_lost,
        graph_launches: t.counters.graph_launches,
        kernel_launches: t.counters.kernel_launches,
        memcpy_bytes: by_direction(&t.counters.memcpy_bytes),
        memcpy_calls: by_direction(&t.counters.memcpy_calls),
        request_stats,
        requests: t.requests,
        stop: t.stop.into(),
        t_ns,
        kind: kind::TOTALS.into(),
        unrouted_events: t.unrouted_events,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

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

    // The lines as the JSONL reference describes them and as they have
    // always been written (the attach, detach and totals lines from a
    // sorted JSON map before the schema's types): names, order, format.
    const GOLDEN_REQUEST: &str = concat!(
        r#"{"type":"request","pid":1,"tid":1,"conn":"0xabc","client_addr":"127.0.0.1","#,
        r#""client_port":1,"server_addr":"127.0.0.1","server_port":2,"request_index":0,"#,
        r#""t_arrive_ns":1000000000000,"t_request_segment_ns":999999999999,"t_first_byte_ns":1000009000000,"#,
        r#""t_first_token_ns":1000010000000,"t_done_ns":1000030000000,"ttft_ns":10000000,"#,
        r#""t_first_token_acked_ns":null,"t_first_token_unacked_ns":null,"client_ttft_estimate_ns":null,"#,
        r#""srtt_ns":null,"queue_ns":5000000,"gpu_ns":4000000,"egress_ns":1000000,"#,
        r#""gpu_pid":1,"gpu_tid":2,"gpu_t_first_launch_ns":1000005000000,"gpu_t_copy_done_ns":1000009000000,"#,
        r#""gpu_steps_waited":1,"gpu_idle_before_start_ns":0,"itl_ns":[1000000,2000000,"#,
        r#"3000000],"t_first_chunk_acked_ns":null,"chunk_ack_gaps_ns":[],"chunk_ack_gap_by_close":null,"#,
        r#""chunks":4,"tpot_ns":5000000,"e2e_ns":30000000,"bytes_in":100,"#,
        r#""bytes_out":200,"http_status":200,"content_type":null,"framing":null,"http2_stream_id":null,"#,
        r#""http2_error_code":null,"http2_ended_by":null,"grpc_status":null,"grpc_message":null,"tls":null,"retry_of":null,"user_ttft_ns":null,"outcome":"ok","#,
        r#""notes":["joined_running_batch"],"workload":{"comm":"vllm","container":"c0ffee","#,
        r#""pod":"vllm-0","namespace":"serving"},"workload_pid":7,"slow":true,"slo_violation":true,"#,
        r#""causes":[{"class":"network","explained_ns":6000000,"evidence":{"retransmits":2}}],"#,
        r#""tcp_retransmits":2,"gpu":{"gpus":[0],"samples":3,"before_window":false,"#,
        r#""sm_clock_min_hz":1410000000,"mem_clock_min_hz":null,"mem_used_max_bytes":null,"#,
        r#""mem_total_bytes":null,"mem_used_max_ratio":null,"utilization_max_ratio":0.5,"#,
        r#""power_max_watts":null,"temperature_max_celsius":null,"throttle_reasons":["sw_thermal_slowdown"]},"#,
        r#""evidence":{"runq_ns":2000000,"runq_max_ns":0,"cpu_stage_oncpu_ns":0,"cpu_stage_blocked_ns":0,"#,
        r#""cpu_stage_thread_max_ns":0,"gpu_thread_blocked_ns":0,"retransmits":2,"retransmit_times_ns":[1000003000000,"#,
        r#"1000007000000],"resets":0,"large_copies":0,"large_copy_bytes":0,"large_copy_h2d_bytes":0,"#,
        r#""large_copy_d2h_bytes":0,"large_copy_queue_span_ns":0,"gpu":{"gpus":[0],"#,
        r#""samples":3,"before_window":false,"sm_clock_min_hz":1410000000,"mem_clock_min_hz":null,"#,
        r#""mem_used_max_bytes":null,"mem_total_bytes":null,"mem_used_max_ratio":null,"#,
        r#""utilization_max_ratio":0.5,"power_max_watts":null,"temperature_max_celsius":null,"#,
        r#""throttle_reasons":["sw_thermal_slowdown"]},"first_gpu_work_in_window":false,"#,
        r#""gpu_process_age_ns":null},"stalls":{"threshold_ns":100000000,"count":2,"#,
        r#""total_ns":900000000,"longest_ns":500000000,"windows":[{"t_start_ns":1000020000000,"#,
        r#""t_end_ns":1000520000000,"duration_ns":500000000,"seen_at":"send","causes":[{"#,
        r#""class":"prefill_interference","explained_ns":440000000,"evidence":{"prefills":1}}],"#,
        r#""interfering_request":{"conn":"0xdef","request_index":3}}],"windows_dropped":1,"#,
        r#""pace_ratio_permille":2500,"degrading":true,"chunk_growth_permille":3100,"#,
        r#""chunks_growing":true,"truncated":"missing_terminator","finish_reason":"length"}}"#,
        "\n",
    );
    const GOLDEN_ATTACH: &str = concat!(
        r#"{"apis":["runtime"],"attach_ms":1.5,"failed":0,"#,
        r#""library":"/usr/lib/libcudart.so.12","symbols":11,"t_ns":42,"type":"attach"}"#,
    );
    const GOLDEN_DETACH: &str =
        r#"{"library":"/usr/lib/libcudart.so.12","symbols":11,"t_ns":43,"type":"detach"}"#;
    const GOLDEN_TOTALS: &str = concat!(
        r#"{"episodes_failed":0,"episodes_ok":1,"events_lost":0,"graph_launches":1,"#,
        r#""kernel_launches":12,"memcpy_bytes":{"d2d":0,"d2h":4096,"h2d":0,"h2h":0,"#,
        r#""unknown":0},"memcpy_calls":{"d2d":0,"d2h":1,"h2d":0,"h2h":0,"unknown":0},"#,
        r#""request_stats":[{"stats":{"chunk_acks_evicted":0,"connections":1,"connections_adopted":1,"#,
        r#""connections_evicted":0,"#,
        r#""connections_lost_in_kernel":0,"connections_refused":0,"connections_reopened":0,"#,
        r#""episodes_dropped":0,"episodes_held":0,"http2_frames_unseen":0,"#,
        r#""http2_streams_dropped":0,"late_events":0,"malformed_events":0,"#,
        r#""pending_events":0,"pipelined":0,"reorder_overflow":0,"requests_dropped":0,"retry_candidates_dropped":0,"#,
        r#""sends_without_request":0,"socket_errors":0,"unknown_conn_events":0},"workload_pid":7}],"#,
        r#""requests":1,"stop":"Signal","t_ns":44,"type":"totals","unrouted_events":3}"#,
    );

    #[test]
    fn the_workload_line_carries_the_claim_beside_the_labels() {
        use crate::workloads::{ClaimVerdict, PodClaim, WorkloadLabels};
        let naming = Naming {
            labels: WorkloadLabels {
                comm: "vllm".into(),
                container: "c0ffee".into(),
                pod: "vllm-0".into(),
                namespace: "serving".into(),
                pid: None,
            },
            pod_uid: Some("1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901".into()),
            claim: PodClaim {
                pod: Some("payments-api".into()),
                namespace: None,
            },
            verdict: Some(ClaimVerdict::Differs),
        };
        let line = serde_json::to_string(&workload_line(7, &naming, 45)).expect("line");
        assert_eq!(
            line,
            concat!(
                r#"{"type":"workload","t_ns":45,"workload_pid":7,"workload":{"comm":"vllm","#,
                r#""container":"c0ffee","pod":"vllm-0","namespace":"serving"},"#,
                r#""pod_uid":"1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901","claimed_pod":"payments-api","#,
                r#""claimed_namespace":null,"claim_verdict":"differs"}"#
            )
        );
        let back: WorkloadLine = serde_json::from_str(&line).expect("read back");
        assert_eq!(back.claim_verdict.as_deref(), Some("differs"));
    }

    #[test]
    fn the_lines_keep_their_field_names_order_and_format() {
        use crate::jsonl_schema::tests::{counters, library, run_totals, stats, write_request};
        let path = std::env::temp_dir().join(format!("ttft-golden-{}.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut j = Jsonl::new(&Registry::new()).expect("counter");
        j.open(&path).expect("create");
        write_request(&mut j);
        j.flush();
        let request = std::fs::read_to_string(&path).expect("read");
        let _ = std::fs::remove_file(&path);
        assert_eq!(request, GOLDEN_REQUEST);
        let attach = serde_json::to_string(&attach_line(&library(), 42)).expect("attach");
        assert_eq!(attach, GOLDEN_ATTACH);
        let detach = serde_json::to_string(&detach_line(&library(), 43)).expect("detach");
        assert_eq!(detach, GOLDEN_DETACH);
        let (counters, stats) = (counters(), stats());
        let totals = totals_line(&run_totals(&counters, &stats), 44).expect("totals");
        let totals = serde_json::to_string(&totals).expect("totals");
        assert_eq!(totals, GOLDEN_TOTALS);
    }
}
