//! What the verdicts become: JSONL, Prometheus counters, terminal lines.

use prometheus::Registry;

use super::super::CauseSummary;
use super::*;
use crate::export::prometheus::{CauseMetrics, render};

/// A slow request explained by run-queue delay (`runq` ms) and cold start.
fn cpu_and_cold(ttft_ms: u64, runq_ms: u64) -> Attribution {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(ttft_ms));
    ev.runq_ns = ms(runq_ms);
    ev.first_gpu_work_in_window = true;
    judge(&ev)
}

fn fast() -> Attribution {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(120));
    judge(&ev)
}

fn client_slow() -> Attribution {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(200));
    acked(&mut ev, ms(300), 0);
    ev.add_retransmit(T0 + ms(400));
    judge(&ev)
}

#[test]
fn a_verdict_serialises_with_class_names_and_evidence() {
    let v = serde_json::to_value(cpu_and_cold(700, 80)).expect("json");
    assert_eq!(v["slow"], true);
    assert_eq!(v["slo_violation"], true);
    assert_eq!(v["causes"][0]["class"], "cold_start");
    assert_eq!(v["causes"][0]["explained_ns"], ms(550));
    assert_eq!(v["causes"][0]["evidence"]["first_gpu_work_in_window"], true);
    assert_eq!(v["causes"][1]["class"], "cpu");
    assert_eq!(v["causes"][1]["evidence"]["runq_ns"], ms(80));
    assert!(v.get("ttft_ns").is_none());

    let v = serde_json::to_value(client_slow()).expect("json");
    assert_eq!(v["slo_violation"], false);
    // The estimate is in the request's own line, not repeated by the verdict.
    assert!(v.get("client_ttft_estimate_ns").is_none());
    assert_eq!(v["causes"][0]["class"], "network");
}

#[test]
fn metrics_count_each_cause_of_each_slow_request_and_violations() {
    let registry = Registry::new();
    let m = CauseMetrics::new(&registry, &[]).expect("metrics");
    m.init_workload(&[]);
    let text = render(&registry);
    for label in [
        "queueing",
        "batching",
        "cpu",
        "network",
        "gpu_memory",
        "cold_start",
    ] {
        let series = format!("ttft_trace_slow_requests_total{{cause=\"{label}\"}} 0");
        assert!(text.contains(&series), "missing {series} in\n{text}");
    }
    assert!(text.contains("ttft_trace_slow_requests_total{cause=\"unexplained\"} 0"));
    assert!(text.contains("ttft_trace_slo_violations_total 0"));

    m.observe(&cpu_and_cold(700, 80), &[]);
    m.observe(&judge(&slow_request()), &[]);
    m.observe(&fast(), &[]);
    m.observe(&client_slow(), &[]);
    m.observe(&Attribution::default(), &[]);
    let text = render(&registry);
    for needle in [
        "ttft_trace_slow_requests_total{cause=\"cold_start\"} 1",
        "ttft_trace_slow_requests_total{cause=\"cpu\"} 1",
        "ttft_trace_slow_requests_total{cause=\"network\"} 1",
        "ttft_trace_slow_requests_total{cause=\"unexplained\"} 1",
        "ttft_trace_slow_requests_total{cause=\"queueing\"} 0",
        "ttft_trace_slo_violations_total 2",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[test]
fn summary_shows_the_cause_mix_and_the_slowest_requests() {
    let mut s = CauseSummary::new(2);
    let labelled = std::cell::RefCell::new(Vec::new());
    let record = |s: &mut CauseSummary, a: Attribution, name: &'static str| {
        s.record(&a, || {
            labelled.borrow_mut().push(name);
            name.to_string()
        });
    };
    record(&mut s, cpu_and_cold(700, 80), "a");
    record(&mut s, fast(), "fast");
    record(&mut s, judge(&slow_request()), "b");
    record(&mut s, cpu_and_cold(3_000, 60), "c");
    record(&mut s, client_slow(), "d");
    record(&mut s, Attribution::default(), "not judged");
    assert_eq!(
        s.window_lines(),
        [
            "slow 4/5 (80.0%), SLO violations 3: cpu 2 (140ms), cold_start 2 (1.10s), \
             network 1 (300ms), unexplained 1",
            "     3.00s c: cold_start 550ms, cpu 60.0ms",
            "     700ms a: cold_start 550ms, cpu 80.0ms",
        ]
    );
    // Neither the fast request nor one that no top N wanted was labelled.
    assert_eq!(*labelled.borrow(), ["a", "b", "c"]);

    record(&mut s, judge(&slow_request()), "e");
    assert_eq!(
        s.window_lines(),
        [
            "slow 1/1 (100.0%), SLO violations 1: unexplained 1",
            "     600ms e: unexplained"
        ]
    );
    assert_eq!(s.window_lines(), ["slow 0/0 (0.0%), SLO violations 0"]);
    let total = s.total_lines();
    assert_eq!(
        total[0],
        "slow 5/6 (83.3%), SLO violations 4: cpu 2 (140ms), cold_start 2 (1.10s), \
         network 1 (300ms), unexplained 2"
    );
    assert_eq!(
        total[1..],
        [
            "     3.00s c: cold_start 550ms, cpu 60.0ms",
            "     700ms a: cold_start 550ms, cpu 80.0ms"
        ]
    );
}

#[test]
fn a_summary_without_top_n_keeps_only_the_mix() {
    let mut s = CauseSummary::new(0);
    s.record(&cpu_and_cold(900, 70), || {
        unreachable!("no top N to label for")
    });
    assert_eq!(s.total_lines().len(), 1);
    assert_eq!(s.window_lines().len(), 1);
}
