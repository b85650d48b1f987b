//! Cost of the OTLP sink per request on the event loop's thread, with the
//! collector down (its port refuses connections): the GenAI histograms
//! alone (sample ratio 0: no spans), then histograms and spans (ratio 1:
//! four spans a request, queued without blocking and dropped when the
//! export fails). Also the process's RSS before and after, to show that an
//! outage holds nothing. Prints one JSON line per case.
//! Run: `cargo bench -p ttft-trace --bench otlp`.

use std::{hint::black_box, time::Instant};

use prometheus::Registry;
use ttft_trace::{
    causes::{Attribution, Evidence, RequestTimes},
    export::otlp::{Otlp, OtlpConfig},
    judging::{JudgedRequest, JudgedStalls},
    requests::{Outcome, RequestRecord},
    workloads::WorkloadLabels,
};

const REQUESTS: u64 = 200_000;
const MS: u64 = 1_000_000;

/// Request `i`: a whole streamed response with a GPU breakdown (so four
/// spans), its TTFT varying over the TTFT buckets.
fn request(i: u64) -> JudgedRequest {
    let t0 = 1_000_000_000 + i * 10 * MS;
    let ttft = 5 * MS + (i % 400) * MS;
    let record = RequestRecord {
        kind: "request",
        pid: 100,
        tid: 101,
        sk: 0xffff_0000 + (i % 64),
        client_addr: "10.0.0.2".into(),
        client_port: 40_000 + (i % 64) as u16,
        server_addr: "10.0.0.1".into(),
        server_port: 8000,
        request_index: i as u32,
        t_arrive_ns: t0,
        t_request_segment_ns: Some(t0),
        t_first_byte_ns: Some(t0 + ttft - MS),
        t_first_token_ns: Some(t0 + ttft),
        t_done_ns: Some(t0 + ttft + 100 * MS),
        ttft_ns: Some(ttft),
        t_first_token_acked_ns: None,
        t_first_token_unacked_ns: None,
        client_ttft_estimate_ns: None,
        srtt_ns: None,
        queue_ns: Some(ttft / 2),
        gpu_ns: Some(ttft / 4),
        egress_ns: Some(ttft - ttft / 2 - ttft / 4),
        gpu_pid: Some(100),
        gpu_tid: Some(102),
        gpu_t_first_launch_ns: Some(t0 + ttft / 2),
        gpu_t_copy_done_ns: Some(t0 + ttft / 2 + ttft / 4),
        gpu_steps_waited: Some(1),
        gpu_idle_before_start_ns: Some(0),
        itl_ns: vec![4 * MS; 25],
        t_first_chunk_acked_ns: None,
        chunk_ack_gaps_ns: Vec::new(),
        chunk_ack_gap_by_close: None,
        chunks: 26,
        tpot_ns: Some(4 * MS),
        e2e_ns: Some(ttft + 100 * MS),
        bytes_in: 600,
        bytes_out: 4000,
        http_status: Some(200),
        content_type: Some("text/event-stream".into()),
        framing: None,
        http2_stream_id: None,
        http2_error_code: None,
        http2_ended_by: None,
        grpc_status: None,
        grpc_message: None,
        tls: None,
        retry_of: None,
        user_ttft_ns: None,
        outcome: Outcome::Ok,
        notes: vec![],
        chunk_bytes: vec![],
        ending: Default::default(),
    };
    JudgedRequest {
        evidence: Evidence::new(RequestTimes::from(&record)),
        record,
        attribution: Attribution::default(),
        tcp_retransmits: 0,
        stalls: JudgedStalls::default(),
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() -> anyhow::Result<()> {
    // A port nothing listens on: every export is refused.
    let down = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let labels = WorkloadLabels {
        comm: "python3".into(),
        container: "4f1c3c2a9e8b".into(),
        pod: "vllm-0".into(),
        namespace: "serving".into(),
        pid: None,
    };
    let requests: Vec<JudgedRequest> = (0..1024).map(request).collect();
    for (case, sample_ratio) in [("metrics_only", 0.0), ("metrics_and_spans", 1.0)] {
        let registry = Registry::new();
        let cfg = OtlpConfig {
            endpoint: Some(format!("http://{down}")),
            sample_ratio,
            ..OtlpConfig::default()
        };
        let mut otlp = Otlp::start(&cfg, &registry)?;
        let rss_before = rss_kib();
        let start = Instant::now();
        for i in 0..REQUESTS {
            otlp.request(&labels, 100, black_box(&requests[(i % 1024) as usize]));
        }
        let secs = start.elapsed().as_secs_f64();
        let rss_after = rss_kib();
        let (exported, queue_full, failed) = (
            otlp.exported(),
            otlp.dropped("queue_full"),
            otlp.dropped("export_failed"),
        );
        println!(
            "{{\"bench\":\"otlp_request_{case}_collector_down\",\"requests\":{REQUESTS},\
             \"seconds\":{secs:.3},\"ns_per_request\":{:.0},\"spans_exported\":{exported},\
             \"spans_dropped_queue_full\":{queue_full},\"spans_dropped_export_failed\":{failed},\
             \"rss_before_kib\":{rss_before},\"rss_after_kib\":{rss_after}}}",
            secs * 1e9 / REQUESTS as f64,
        );
        otlp.shutdown();
    }
    Ok(())
}
