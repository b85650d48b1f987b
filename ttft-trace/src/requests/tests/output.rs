//! What leaves the module: the JSONL line, the Prometheus series and the
//! terminal's percentile lines.

use prometheus::Registry;

use super::*;
use crate::{
    export::prometheus::{RequestMetrics, render},
    record::Percentiles,
    requests::{Figure, Outcome, RequestRecorders},
};

/// One streamed request joined to an episode, one cut short, one error.
fn three_requests() -> Vec<RequestRecord> {
    let mut w = Wire::new();
    w.open(1, 0);
    w.recv(1, ms(1000), 300);
    w.episode(ms(1020), ms(1090));
    w.send(1, ms(1010), SSE_HEADERS);
    w.send(1, ms(1100), &sse_chunk("a"));
    w.send(1, ms(1120), &sse_chunk("b"));
    w.send(1, ms(1150), &sse_done());
    w.open(2, 0);
    w.recv(2, ms(1000), 300);
    w.send(2, ms(1010), SSE_HEADERS);
    w.send(2, ms(1300), &sse_chunk("a"));
    w.close(2, ms(1400));
    w.open(3, 0);
    w.recv(3, ms(1000), 300);
    w.send(3, ms(1001), &json_response("503 Service Unavailable", "{}"));
    let rs = w.drain(ms(2000));
    assert_eq!(rs.len(), 3);
    rs
}

#[test]
fn one_jsonl_line_per_request() {
    let rs = three_requests();
    let r = rs.iter().find(|r| r.sk == 1).expect("the streamed one");
    let json = serde_json::to_string(r).expect("json");
    assert!(
        json.starts_with("{\"type\":\"request\",\"pid\":10,\"tid\":11,"),
        "{json}"
    );
    for field in [
        "\"conn\":\"0x1\"",
        "\"client_addr\":\"127.0.0.2\",\"client_port\":40001",
        "\"server_addr\":\"127.0.0.1\",\"server_port\":8000",
        "\"request_index\":0",
        "\"t_arrive_ns\":1000000000",
        "\"t_first_token_ns\":1100000000",
        "\"ttft_ns\":100000000",
        "\"queue_ns\":20000000,\"gpu_ns\":70000000,\"egress_ns\":10000000",
        "\"itl_ns\":[20000000,30000000]",
        "\"chunks\":3",
        "\"framing\":\"http1\"",
        "\"outcome\":\"ok\"",
        "\"notes\":[]",
    ] {
        assert!(json.contains(field), "missing {field} in {json}");
    }
}

#[test]
fn ipv6_addresses() {
    let mut w = Wire::new();
    let mut open = ConnEvent {
        kind: EVENT_CONN,
        op: CONN_OPEN,
        sk: 9,
        family: 10,
        sport: 8000,
        dport: 50000,
        ..ConnEvent::default()
    };
    open.saddr[15] = 1;
    open.daddr[15] = 1;
    w.c.on_conn(&open);
    w.recv(9, ms(1), 10);
    w.send(9, ms(2), &json_response("200 OK", "{}"));
    let r = w.one(ms(100));
    assert_eq!((r.server_addr.as_str(), r.client_port), ("::1", 50000));
}

#[test]
fn prometheus_series() {
    let registry = Registry::new();
    let m = RequestMetrics::new(&registry, &[]).expect("register");
    m.init_workload(&[]);
    for r in three_requests() {
        m.observe(&r, &[]);
    }
    let text = render(&registry);
    for needle in [
        "ttft_trace_requests_total{outcome=\"ok\"} 1",
        "ttft_trace_requests_total{outcome=\"closed_mid_response\"} 1",
        "ttft_trace_requests_total{outcome=\"error_status\"} 1",
        "ttft_trace_requests_total{outcome=\"pipelined_unsupported\"} 0",
        // The ok one and the one cut short; not the error.
        "ttft_trace_time_to_first_token_seconds_count 2",
        "ttft_trace_time_to_first_token_seconds_bucket{le=\"0.1\"} 1",
        "ttft_trace_time_to_first_token_seconds_bucket{le=\"0.3\"} 2",
        // Both started after the episode: both joined to it.
        "ttft_trace_request_queue_seconds_count 2",
        "ttft_trace_request_gpu_seconds_count 2",
        "ttft_trace_request_egress_seconds_count 2",
        "ttft_trace_inter_token_latency_seconds_count 2",
        "ttft_trace_request_duration_seconds_count 1",
        "ttft_trace_time_per_output_token_seconds_count 1",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    assert!(
        RequestMetrics::new(&registry, &[]).is_err(),
        "registered once"
    );
}

#[test]
fn figure_order_matches_the_indexes() {
    for (i, f) in Figure::ALL.iter().enumerate() {
        assert_eq!(*f as usize, i);
    }
    let names: std::collections::HashSet<_> = Outcome::ALL.iter().map(|o| o.name()).collect();
    assert_eq!(names.len(), Outcome::ALL.len());
}

#[test]
fn percentile_lines_per_figure() {
    let mut rec = RequestRecorders::new();
    for r in three_requests() {
        rec.record(&r);
    }
    let fmt = |p: &Percentiles| format!("p50 {} max {}", p.p50 / 1_000_000, p.max / 1_000_000);
    let window = rec.window_lines(fmt);
    assert_eq!(window.len(), Figure::ALL.len());
    assert!(window[0].starts_with("TTFT   n=2 "), "{window:?}");
    assert!(window[0].ends_with("max 300"), "{window:?}");
    assert!(window[4].starts_with("ITL    n=2 "), "{window:?}");
    assert!(
        rec.window_lines(fmt)[0].starts_with("TTFT   n=0 "),
        "a new window"
    );
    assert!(rec.total_lines(fmt)[0].starts_with("TTFT   n=2 "));
}
