//! What the writer (`export::jsonl`) writes, the reader (`report`) and the
//! schema's types read back.

use std::{collections::BTreeMap, path::Path};

use prometheus::Registry;
use serde_json::{Value, json};
use ttft_trace_common::GpuCounters;

use super::{
    Attach, Cause, Detach, Episode, Evidence, Request, RequestId, StallWindow, Stalls, Totals,
    Workload, kind,
};
use crate::{
    causes::{self, Attribution, CauseClass, RequestTimes},
    episodes::EpisodeRecord,
    export::{
        LibraryView, WorkloadView,
        jsonl::{Jsonl, RunTotals},
    },
    judging::{JudgedRequest, JudgedStall, JudgedStalls, Truncation},
    nvml::WindowReadings,
    report::{
        Lines,
        tests::{MS, T0, record},
    },
    requests::stream_stalls::SeenAt,
    requests::{CorrelatorStats, Outcome},
    workloads::WorkloadLabels,
};

pub(crate) fn labels() -> WorkloadLabels {
    WorkloadLabels {
        comm: "vllm".into(),
        container: "c0ffee".into(),
        pod: "vllm-0".into(),
        namespace: "serving".into(),
        pid: None,
    }
}

/// A slow request with a network cause, two retransmits and GPU readings.
pub(crate) fn slow_request() -> JudgedRequest {
    let mut r = record(Outcome::Ok);
    r.notes = vec!["joined_running_batch"];
    let mut evidence = causes::Evidence::new(RequestTimes::from(&r));
    evidence.add_retransmit(r.t_arrive_ns + 3 * MS);
    evidence.add_retransmit(r.t_arrive_ns + 7 * MS);
    evidence.runq_ns = 2 * MS;
    evidence.gpu = Some(WindowReadings {
        gpus: vec![0],
        samples: 3,
        sm_clock_min_hz: Some(1_410_000_000),
        utilization_max_ratio: Some(0.5),
        throttle_reasons: vec!["sw_thermal_slowdown".into()],
        ..WindowReadings::default()
    });
    let attribution = Attribution {
        slow: true,
        slo_violation: true,
        causes: vec![causes::Cause {
            class: CauseClass::Network,
            explained_ns: 6 * MS,
            evidence: BTreeMap::from([("retransmits", json!(2))]),
        }],
        ..Attribution::default()
    };
    JudgedRequest {
        record: r,
        evidence,
        attribution,
        tcp_retransmits: 2,
        stalls: JudgedStalls {
            threshold_ns: 100 * MS,
            count: 2,
            total_ns: 900 * MS,
            longest_ns: 500 * MS,
            windows: vec![JudgedStall {
                t_start_ns: T0 + 20 * MS,
                t_end_ns: T0 + 520 * MS,
                duration_ns: 500 * MS,
                seen_at: SeenAt::Send,
                causes: vec![causes::Cause {
                    class: CauseClass::PrefillInterference,
                    explained_ns: 440 * MS,
                    evidence: BTreeMap::from([("prefills", json!(1))]),
                }],
                interfering_request: Some(causes::RequestId {
                    conn: 0xdef,
                    request_index: 3,
                }),
            }],
            windows_dropped: 1,
            pace_ratio_permille: Some(2500),
            degrading: true,
            chunk_growth_permille: Some(3100),
            chunks_growing: true,
            truncated: Some(Truncation::MissingTerminator),
            finish_reason: Some("length".into()),
        },
    }
}

pub(crate) fn episode() -> EpisodeRecord {
    EpisodeRecord {
        kind: kind::EPISODE,
        pid: 1,
        tid: 2,
        api: "runtime",
        stream: "0x0".into(),
        copy_stream: "0x10".into(),
        kernel_launches: 12,
        graph_launches: 1,
        t_first_launch_ns: 100,
        t_copy_enqueue_ns: 150,
        t_copy_done_ns: 190,
        launch_to_first_d2h_ns: 90,
        copy_bytes: 4096,
        completion: "stream_sync",
        status: 0,
        gpu: None,
    }
}

pub(crate) const FAILED: &[(String, String)] = &[];

pub(crate) fn library() -> LibraryView<'static> {
    LibraryView {
        path: Path::new("/usr/lib/libcudart.so.12"),
        apis: vec!["runtime"],
        symbols: 11,
        failed: FAILED,
        attach_ms: 1.5,
    }
}

pub(crate) fn counters() -> GpuCounters {
    let mut c = GpuCounters {
        kernel_launches: 12,
        graph_launches: 1,
        ..GpuCounters::default()
    };
    c.memcpy_calls[2] = 1;
    c.memcpy_bytes[2] = 4096;
    c
}

pub(crate) fn stats() -> Vec<(u32, CorrelatorStats)> {
    let stats = CorrelatorStats {
        connections: 1,
        connections_adopted: 1,
        ..CorrelatorStats::default()
    };
    vec![(7, stats)]
}

/// The slow request written by workload 7, through the writer.
pub(crate) fn write_request(j: &mut Jsonl) {
    let labels = labels();
    let values = labels.values();
    let workload = WorkloadView {
        root: 7,
        labels: &labels,
        values: &values,
    };
    j.request(workload, &slow_request());
}

/// What a run that stopped on a signal sums up.
pub(crate) fn run_totals<'a>(
    counters: &'a GpuCounters,
    stats: &'a [(u32, CorrelatorStats)],
) -> RunTotals<'a> {
    RunTotals {
        stop: "Signal",
        counters,
        episodes_ok: 1,
        episodes_failed: 0,
        events_lost: 0,
        requests: 1,
        request_stats: stats,
        unrouted_events: 3,
    }
}

/// Writes one line of each kind through the writer; returns the file.
fn written() -> String {
    let path = std::env::temp_dir().join(format!("ttft-schema-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut j = Jsonl::new(&Registry::new()).expect("counter");
    j.open(&path).expect("create");
    write_request(&mut j);
    j.episode(&episode());
    j.attached(&library());
    j.detached(&library());
    let (counters, stats) = (counters(), stats());
    j.totals(&run_totals(&counters, &stats));
    j.flush();
    assert_eq!(j.errors(), 0);
    let text = std::fs::read_to_string(&path).expect("read");
    let _ = std::fs::remove_file(&path);
    text
}

/// The line of kind `k`.
fn line_of<'a>(text: &'a str, k: &str) -> &'a str {
    text.lines()
        .find(|l| serde_json::from_str::<Value>(l).expect("JSON")["type"] == k)
        .unwrap_or_else(|| panic!("no {k} line in {text}"))
}

#[test]
fn the_report_reads_back_the_request_the_writer_wrote() {
    let text = written();
    let mut requests = Vec::new();
    let lines = Lines::read(text.as_bytes(), |r| requests.push(r)).expect("reads");
    assert_eq!(
        (lines.requests, lines.episodes, lines.totals_lines),
        (1, 1, 1)
    );
    assert_eq!((lines.other, lines.bad, lines.too_long), (2, 0, 0));
    let r = record(Outcome::Ok);
    let want = Request {
        pid: r.pid,
        conn: "0xabc".into(),
        client_addr: r.client_addr.clone(),
        client_port: r.client_port,
        request_index: r.request_index,
        t_arrive_ns: r.t_arrive_ns,
        t_first_token_ns: r.t_first_token_ns,
        t_done_ns: r.t_done_ns,
        ttft_ns: r.ttft_ns,
        t_first_token_acked_ns: None,
        client_ttft_estimate_ns: None,
        queue_ns: r.queue_ns,
        gpu_ns: r.gpu_ns,
        egress_ns: r.egress_ns,
        gpu_steps_waited: r.gpu_steps_waited,
        itl_ns: r.itl_ns.clone(),
        chunks: r.chunks,
        tpot_ns: r.tpot_ns,
        e2e_ns: r.e2e_ns,
        http_status: r.http_status,
        outcome: "ok".into(),
        notes: vec!["joined_running_batch".into()],
        workload: Workload {
            comm: "vllm".into(),
            container: "c0ffee".into(),
            pod: "vllm-0".into(),
            namespace: "serving".into(),
        },
        slow: true,
        causes: vec![Cause {
            class: "network".into(),
            explained_ns: 6 * MS,
            evidence: BTreeMap::from([("retransmits".into(), json!(2))]),
        }],
        tcp_retransmits: 2,
        evidence: Some(Evidence {
            runq_ns: 2 * MS,
            retransmits: 2,
            retransmit_times_ns: vec![r.t_arrive_ns + 3 * MS, r.t_arrive_ns + 7 * MS],
            ..Evidence::default()
        }),
        stalls: Stalls {
            threshold_ns: 100 * MS,
            count: 2,
            total_ns: 900 * MS,
            longest_ns: 500 * MS,
            windows: vec![StallWindow {
                t_start_ns: T0 + 20 * MS,
                t_end_ns: T0 + 520 * MS,
                duration_ns: 500 * MS,
                seen_at: "send".into(),
                causes: vec![Cause {
                    class: "prefill_interference".into(),
                    explained_ns: 440 * MS,
                    evidence: BTreeMap::from([("prefills".into(), json!(1))]),
                }],
                interfering_request: Some(RequestId {
                    conn: "0xdef".into(),
                    request_index: 3,
                }),
            }],
            windows_dropped: 1,
            pace_ratio_permille: Some(2500),
            degrading: true,
            chunk_growth_permille: Some(3100),
            chunks_growing: true,
            truncated: Some("missing_terminator".into()),
            finish_reason: Some("length".into()),
        },
        tls: None,
        retry_of: None,
        user_ttft_ns: None,
    };
    assert_eq!(requests, [want]);
}

#[test]
fn the_other_lines_read_back_as_written() {
    let text = written();
    let e: Episode = serde_json::from_str(line_of(&text, kind::EPISODE)).expect("episode");
    let rec = episode();
    assert_eq!(
        e,
        Episode {
            pid: rec.pid,
            tid: rec.tid,
            api: rec.api.into(),
            stream: rec.stream,
            copy_stream: rec.copy_stream,
            kernel_launches: rec.kernel_launches,
            graph_launches: rec.graph_launches,
            t_first_launch_ns: rec.t_first_launch_ns,
            t_copy_enqueue_ns: rec.t_copy_enqueue_ns,
            t_copy_done_ns: rec.t_copy_done_ns,
            launch_to_first_d2h_ns: rec.launch_to_first_d2h_ns,
            copy_bytes: rec.copy_bytes,
            completion: rec.completion.into(),
            status: rec.status,
        }
    );
    let a: Attach = serde_json::from_str(line_of(&text, kind::ATTACH)).expect("attach");
    assert_eq!(
        (a.apis, a.attach_ms, a.failed, a.library, a.symbols),
        (
            vec!["runtime".into()],
            1.5,
            0,
            "/usr/lib/libcudart.so.12".into(),
            11
        )
    );
    let d: Detach = serde_json::from_str(line_of(&text, kind::DETACH)).expect("detach");
    assert_eq!(
        (d.library, d.symbols),
        ("/usr/lib/libcudart.so.12".into(), 11)
    );
    assert!(a.t_ns > 0 && d.t_ns >= a.t_ns, "stamped in order");
    let t: Totals = serde_json::from_str(line_of(&text, kind::TOTALS)).expect("totals");
    assert_eq!(t.stop, "Signal");
    assert_eq!((t.kernel_launches, t.graph_launches), (12, 1));
    assert_eq!(t.memcpy_bytes.get("d2h"), Some(&4096));
    assert_eq!((t.requests, t.unrouted_events), (1, 3));
    let w = &t.request_stats[0];
    assert_eq!(w.workload_pid, 7);
    assert_eq!(w.stats.get("connections_adopted"), Some(&1));
    assert_eq!(
        w.stats.len(),
        serde_json::to_value(CorrelatorStats::default())
            .expect("stats")
            .as_object()
            .map_or(0, |o| o.len()),
        "every statistic by name"
    );
}

/// A stall's `seen_at` reads back as written; a line of a tracer before it
/// (no `seen_at`) reads as `send`.
#[test]
fn a_stalls_seen_at_reads_back() {
    let line = |extra: &str| {
        format!(r#"{{"t_start_ns":1,"t_end_ns":2,"duration_ns":1,{extra}"causes":[]}}"#)
    };
    let w: StallWindow = serde_json::from_str(&line(r#""seen_at":"delivery","#)).expect("new");
    assert_eq!(w.seen_at, "delivery");
    let w: StallWindow = serde_json::from_str(&line("")).expect("old");
    assert_eq!(w.seen_at, "send");
    let judged = JudgedStall {
        t_start_ns: 1,
        t_end_ns: 2,
        duration_ns: 1,
        seen_at: SeenAt::Delivery,
        causes: Vec::new(),
        interfering_request: None,
    };
    let back: StallWindow =
        serde_json::from_value(serde_json::to_value(&judged).expect("write")).expect("read");
    assert_eq!(back.seen_at, "delivery");
}
