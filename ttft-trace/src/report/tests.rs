//! The report on hand-made JSONL: figures, percentiles, objective, causes,
//! slowest requests, comparison and the page's elements.

use serde_json::{Value, json};

use super::{
    html,
    read::Lines,
    stats::{Builder, Run, Stats, percentile},
    table,
};
use crate::requests::{Figure, Outcome, RequestRecord};

pub(crate) const MS: u64 = 1_000_000;
pub(crate) const T0: u64 = 1_000_000_000_000;

/// A request line as the tracer writes it, `ttft` split 80/15/5 into
/// queue, GPU and egress.
fn request(arrive_ms: u64, ttft_ms: u64, outcome: &str) -> Value {
    let ttft = ttft_ms * MS;
    let (q, g) = (ttft * 80 / 100, ttft * 15 / 100);
    json!({
        "type": "request", "pid": 7, "tid": 8, "conn": "0xffff1", "client_addr": "10.0.0.9",
        "client_port": 40000 + arrive_ms, "server_addr": "10.0.0.1", "server_port": 8000,
        "request_index": 0, "t_arrive_ns": T0 + arrive_ms * MS,
        "t_first_token_ns": T0 + arrive_ms * MS + ttft, "t_done_ns": T0 + arrive_ms * MS + ttft + 40 * MS,
        "ttft_ns": ttft, "queue_ns": q, "gpu_ns": g, "egress_ns": ttft - q - g,
        "t_first_token_acked_ns": null, "itl_ns": [10 * MS, 20 * MS], "chunks": 3,
        "tpot_ns": 20 * MS, "e2e_ns": ttft + 40 * MS, "http_status": 200, "outcome": outcome,
        "notes": [], "workload": {"comm": "vllm", "container": "", "pod": "", "namespace": ""},
        "workload_pid": 7, "slow": false, "slo_violation": false, "causes": [], "tcp_retransmits": 0,
    })
}

fn slow(mut v: Value, causes: Value, evidence: Value) -> Value {
    v["slow"] = json!(true);
    v["slo_violation"] = json!(true);
    v["causes"] = causes;
    v["evidence"] = evidence;
    v
}

fn run_of(lines: &[String], slo_ms: u64, top: usize) -> Run {
    let text = lines.join("\n");
    let mut b = Builder::new(top);
    let l = Lines::read(text.as_bytes(), |r| b.add(r)).expect("in memory");
    b.finish("run.jsonl".into(), l, slo_ms * MS)
}

/// Five requests, two slow with evidence, one error response, plus noise.
fn sample() -> Vec<String> {
    let network = slow(
        request(300, 900, "ok"),
        json!([{"class": "network", "explained_ns": 600 * MS, "evidence": {"retransmits": 2}}]),
        json!({"runq_ns": 0, "retransmits": 2,
               "retransmit_times_ns": [T0 + 500 * MS, T0 + 900 * MS], "large_copies": 0}),
    );
    let cpu = slow(
        request(100, 500, "ok"),
        json!([{"class": "cpu", "explained_ns": 300 * MS, "evidence": {}},
               {"class": "gpu_memory", "explained_ns": 100 * MS, "evidence": {}}]),
        json!({"runq_ns": 250 * MS, "runq_max_ns": 30 * MS, "cpu_stage_thread_max_ns": 200 * MS,
               "large_copies": 3, "large_copy_bytes": 3 << 20, "large_copy_queue_span_ns": 40 * MS}),
    );
    let unexplained = slow(
        request(400, 400, "closed_mid_response"),
        json!([]),
        json!({}),
    );
    vec![
        json!({"type": "attach", "library": "/x/libcudart.so.12"}).to_string(),
        request(0, 100, "ok").to_string(),
        cpu.to_string(),
        json!({"type": "episode", "pid": 7}).to_string(),
        request(200, 200, "ok").to_string(),
        network.to_string(),
        unexplained.to_string(),
        request(500, 5000, "error_status").to_string(),
        "{\"type\":\"request\",\"pid\":7,\"t_arr".into(),
        json!({"type": "totals", "requests": 6}).to_string(),
    ]
}

#[test]
fn percentiles_interpolate_as_numpy() {
    // numpy.percentile(range(1, 11), [50, 90, 99, 99.9]) = 5.5, 9.1, 9.91, 9.991
    let mut v: Vec<u64> = (1..=10).rev().collect();
    let s = Stats::of(&mut v);
    assert_eq!(s.count, 10);
    assert!((s.mean - 5.5).abs() < 1e-9);
    assert!((s.median - 5.5).abs() < 1e-9);
    assert!((s.p90 - 9.1).abs() < 1e-9, "{s:?}");
    assert!((s.p99 - 9.91).abs() < 1e-9, "{s:?}");
    assert!((s.p999 - 9.991).abs() < 1e-9, "{s:?}");
    assert_eq!(s.max, 10.0);
    assert_eq!(percentile(&[42], 99.9), 42.0);
    assert_eq!(Stats::of(&mut []), Stats::default());
}

/// A tracer record with every optional figure present (arrival at T0,
/// TTFT 10 ms = 5 + 4 + 1, E2E 30 ms).
pub(crate) fn record(outcome: Outcome) -> RequestRecord {
    RequestRecord {
        kind: "request",
        pid: 1,
        tid: 1,
        sk: 0xabc,
        client_addr: "127.0.0.1".into(),
        client_port: 1,
        server_addr: "127.0.0.1".into(),
        server_port: 2,
        request_index: 0,
        t_arrive_ns: T0,
        t_request_segment_ns: Some(T0 - 1),
        t_first_byte_ns: Some(T0 + 9 * MS),
        t_first_token_ns: Some(T0 + 10 * MS),
        t_done_ns: Some(T0 + 30 * MS),
        ttft_ns: Some(10 * MS),
        t_first_token_acked_ns: None,
        t_first_token_unacked_ns: None,
        client_ttft_estimate_ns: None,
        srtt_ns: None,
        queue_ns: Some(5 * MS),
        gpu_ns: Some(4 * MS),
        egress_ns: Some(MS),
        gpu_pid: Some(1),
        gpu_tid: Some(2),
        gpu_t_first_launch_ns: Some(T0 + 5 * MS),
        gpu_t_copy_done_ns: Some(T0 + 9 * MS),
        gpu_steps_waited: Some(1),
        gpu_idle_before_start_ns: Some(0),
        itl_ns: vec![MS, 2 * MS, 3 * MS],
        t_first_chunk_acked_ns: None,
        chunk_ack_gaps_ns: Vec::new(),
        chunk_ack_gap_by_close: None,
        chunks: 4,
        tpot_ns: Some(5 * MS),
        e2e_ns: Some(30 * MS),
        bytes_in: 100,
        bytes_out: 200,
        http_status: Some(200),
        content_type: None,
        framing: None,
        http2_stream_id: None,
        http2_error_code: None,
        http2_ended_by: None,
        grpc_status: None,
        grpc_message: None,
        tls: None,
        retry_of: None,
        user_ttft_ns: None,
        outcome,
        notes: vec![],
        chunk_bytes: vec![],
        ending: Default::default(),
    }
}

#[test]
fn figures_are_those_the_tracer_observes_for_every_outcome() {
    for outcome in Outcome::ALL {
        let rec = record(outcome);
        let line = serde_json::to_string(&rec).expect("serialises");
        let run = run_of(&[line], 350, 10);
        assert_eq!(run.lines.requests, 1, "{outcome:?}");
        for f in Figure::ALL {
            let want = rec.observations().filter(|&(g, _)| g == f).count();
            assert_eq!(run.stats(f).count, want, "{outcome:?} {f:?}");
        }
    }
}

#[test]
fn a_run_is_summed_up() {
    let run = run_of(&sample(), 450, 3);
    let l = &run.lines;
    assert_eq!(
        (l.requests, l.episodes, l.other, l.bad, l.totals_lines),
        (6, 1, 1, 1, 1)
    );
    assert_eq!(run.outcomes.get("ok"), Some(&4));
    assert_eq!(run.outcomes.get("error_status"), Some(&1));
    // The error response's TTFT does not count; the cut-off one does (TTFT only).
    let ttft = run.stats(Figure::Ttft);
    assert_eq!(ttft.count, 5);
    assert_eq!(ttft.median, 400.0 * MS as f64);
    assert_eq!(ttft.max, 900.0 * MS as f64);
    assert_eq!(run.stats(Figure::E2e).count, 4);
    assert_eq!(run.stats(Figure::Itl).count, 10, "two gaps each of five");
    // 100, 200, 400 within 450 ms; 500 and 900 over.
    assert_eq!(run.within_slo(), Some(0.6));
    assert_eq!((run.slow, run.unexplained), (3, 1));
    assert_eq!(run.causes["cpu"].requests, 1);
    assert_eq!(run.causes["network"].explained_ns, 600 * MS);
    let slowest: Vec<u64> = run.slowest.iter().filter_map(|r| r.ttft_ns).collect();
    assert_eq!(
        slowest,
        [900 * MS, 500 * MS, 400 * MS],
        "top 3, slowest first"
    );
    assert!(
        run.slowest.iter().all(|r| r.itl_ns.is_empty()),
        "ITL moved into the figures"
    );
    assert_eq!(run.start_ns, T0);
    // The error response ends last: 500 + 5000 + 40 ms.
    assert!(
        (run.duration_s() - 5.54).abs() < 1e-9,
        "{}",
        run.duration_s()
    );
}

#[test]
fn the_table_shows_figures_objective_causes_and_evidence() {
    let text = table::single(&run_of(&sample(), 450, 3));
    for want in [
        "Successful requests:                     4\n",
        "Within objective (TTFT <= 450.00 ms):    60.00%",
        "1 not readable, 0 too long (line 9:",
        "TTFT           5    420.00    400.00    740.00    884.00    898.40    900.00",
        "  network:                               1 (33.3%), 600.00 ms explained",
        "  unexplained:                           1 (33.3%)",
        "#1 at +0.300 s  TTFT 900.00 ms = queue 720.00 + GPU 135.00 + egress 45.00",
        "    causes: network 600.00 ms",
        "    evidence: 2 TCP retransmits",
        "    causes: cpu 300.00 ms, gpu_memory 100.00 ms",
        "run queue 250.00 ms (longest wait 30.00 ms); CPU stage: longest thread 200.00 ms",
        "3 large copies, 3.0 MiB",
        "    causes: unexplained",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn a_comparison_shows_both_runs_and_the_difference() {
    let a = run_of(&sample(), 450, 3);
    let faster: Vec<String> = [100, 200, 300, 400]
        .iter()
        .map(|&t| request(t, t / 2, "ok").to_string())
        .collect();
    let b = run_of(&faster, 450, 3);
    let text = table::compare(&a, &b);
    for want in [
        "Requests traced                  6           4                    -2",
        "Within 450.00 ms            60.00%     100.00%            +40.00 pts",
        "TTFT median                 400.00      125.00      -275.00 (-68.8%)",
        "network                          1           0                    -1",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn a_line_over_the_cap_is_skipped_and_counted() {
    let mut lines = sample();
    let mut big = request(600, 50, "ok");
    big["itl_ns"] = json!(vec![1u64; super::LINE_CAP / 2]);
    lines.push(big.to_string());
    let run = run_of(&lines, 450, 3);
    assert_eq!(run.lines.too_long, 1);
    assert_eq!(run.lines.requests, 6, "the long line is not read");
}

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

#[test]
fn the_page_is_self_contained_and_draws_every_figure() {
    let mut lines = sample();
    lines.push(request(700, 120, "ok").to_string());
    let mut run = run_of(&lines, 450, 3);
    run.name = "<script>x</script><b>.jsonl".into();
    let text = table::single(&run);
    let page = html::page(&[&run], &text);
    for id in ["id=\"cdf\"", "id=\"over-time\"", "id=\"waterfall\""] {
        assert_eq!(count(&page, id), 1, "{id}");
    }
    assert_eq!(count(&page, "<path class=\"cdf\""), 1);
    assert_eq!(
        count(&page, "class=\"objective\""),
        2,
        "on the CDF and over time"
    );
    assert!(
        page.contains("objective 450 ms: 66.7% within"),
        "4 of 6 counted"
    );
    assert_eq!(
        count(&page, "<circle class=\"point\""),
        6,
        "one per counted TTFT"
    );
    assert_eq!(count(&page, "<g class=\"request\""), 3, "the top 3");
    for class in [
        "queue",
        "gpu",
        "egress",
        "response",
        "runq",
        "cpu-stage",
        "copies",
    ] {
        // One in the legend, then one per request that has it.
        let want = match class {
            "runq" | "cpu-stage" | "copies" => 2,
            _ => 4,
        };
        assert_eq!(
            count(&page, &format!("<rect class=\"{class}\"")),
            want,
            "{class}"
        );
    }
    assert_eq!(
        count(&page, "<text class=\"retransmit\""),
        2,
        "at their times"
    );
    // Nothing fetched, nothing run, everything escaped.
    assert!(!page.contains("<script"), "no script, and the name escaped");
    assert!(!page.contains("<b>"));
    assert!(page.contains("&lt;script&gt;"));
    for external in ["https:", "src=", "href=", "@import", "url("] {
        assert!(!page.contains(external), "{external}");
    }
    assert_eq!(
        count(&page, "http:"),
        count(&page, "xmlns=\"http://www.w3.org/2000/svg\""),
        "only the SVG namespace names a URL"
    );
}

#[test]
fn a_compared_page_draws_both_runs() {
    let a = run_of(&sample(), 450, 3);
    let b = run_of(&[request(0, 100, "ok").to_string()], 450, 3);
    let page = html::page(&[&a, &b], "");
    assert_eq!(count(&page, "<path class=\"cdf\""), 2);
    assert_eq!(count(&page, "<circle class=\"point\""), 6);
    assert!(page.contains("A 60.0% within, B 100.0% within"));
}

#[test]
fn an_empty_file_gives_a_report_not_a_panic() {
    let run = run_of(&[], 350, 10);
    assert_eq!(run.within_slo(), None);
    let text = table::single(&run);
    assert!(text.contains("(no request with a first token)"), "{text}");
    let page = html::page(&[&run], &text);
    assert!(page.contains("no request with a first token"));
    assert!(!page.contains("NaN"), "no NaN coordinates");
}

/// The waterfall draws each listed stall on the response's lane, with its
/// causes in the tooltip, and counts them in the row's text; a stall past
/// the axis is not drawn.
#[test]
fn the_waterfall_shows_the_stalls() {
    let mut lines = sample();
    let mut network: Value = serde_json::from_str(&lines[5]).expect("the network request");
    let arrive = T0 + 300 * MS;
    network["stalls"] = json!({
        "threshold_ns": 100 * MS, "count": 3, "total_ns": 900 * MS, "longest_ns": 500 * MS,
        "windows": [
            {"t_start_ns": arrive + 905 * MS, "t_end_ns": arrive + 935 * MS, "duration_ns": 30 * MS,
             "causes": [{"class": "prefill_interference", "explained_ns": 25 * MS, "evidence": {}}],
             "interfering_request": {"conn": "0xdef", "request_index": 3}},
            {"t_start_ns": arrive + 936 * MS, "t_end_ns": arrive + 939 * MS, "duration_ns": 3 * MS,
             "seen_at": "delivery", "causes": []},
            {"t_start_ns": arrive + 60_000 * MS, "t_end_ns": arrive + 60_500 * MS,
             "duration_ns": 500 * MS, "causes": []},
        ],
        "windows_dropped": 0, "pace_ratio_permille": 2500, "degrading": true,
        "chunk_growth_permille": 4000, "chunks_growing": true, "truncated": "cut",
    });
    lines[5] = network.to_string();
    let run = run_of(&lines, 450, 3);
    let page = html::page(&[&run], "");
    assert_eq!(
        count(&page, "<rect class=\"stall\""),
        3,
        "the legend's, and the two stalls within the axis"
    );
    assert!(page.contains("stall 30.00 ms: prefill_interference 25.00 (request 3 on 0xdef)"));
    assert!(page.contains(
        "stall 3.00 ms: unexplained (seen at the delivery: between the ACKs of the chunks)"
    ));
    assert!(
        page.contains("; 3 stalls, longest 500.00 ms; degrading; chunks growing; truncated (cut)")
    );
}

#[test]
fn retries_and_tls_handshakes_are_summed_up() {
    let mut retry = request(500, 30, "ok");
    retry["retry_of"] = json!({"conn": "0xffff1", "request_index": 0, "client_port": 40000});
    retry["user_ttft_ns"] = json!(530 * MS);
    let tls = |ms_: u64, first: bool| {
        let mut r = request(600, 20, "tls_unsupported");
        r["tls"] = json!({"version": "1.3", "resumed": false, "handshake_ns": ms_ * MS,
                          "hello_retry": false, "handshake_counted": first});
        r.to_string()
    };
    let lines = vec![
        request(0, 200, "closed_mid_response").to_string(),
        retry.to_string(),
        tls(4, true),
        tls(4, false),
        tls(8, true),
    ];
    let run = run_of(&lines, 350, 3);
    assert_eq!((run.retries.count, run.retries.max), (1, 530.0 * MS as f64));
    assert_eq!(run.tls_handshakes.count, 2, "one a connection");
    assert_eq!(run.tls_versions.get("1.3"), Some(&2));
    let text = table::single(&run);
    for want in [
        "1; the TTFT their users saw: median 530.00 ms",
        "TLS handshakes:",
        "2 (TLS 1.3 2): median 6.00 ms",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    // Neither line without such requests.
    let text = table::single(&run_of(&sample(), 450, 3));
    assert!(
        !text.contains("Retries") && !text.contains("TLS handshakes"),
        "{text}"
    );
}
