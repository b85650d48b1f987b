//! The GenAI metrics against real OTLP receivers (the collector's metrics
//! service generated from the OpenTelemetry protocol definitions, over gRPC
//! and over HTTP).

use std::{collections::BTreeMap, time::Duration};

use opentelemetry_proto::tonic::{
    common::v1::{KeyValue, any_value},
    metrics::v1::{AggregationTemporality, HistogramDataPoint, metric::Data},
};
use prometheus::Registry;

use super::{DURATION_BOUNDARIES, MAX_ATTRIBUTE_SETS, TPOT_BOUNDARIES, TTFT_BOUNDARIES};
use crate::{
    export::otlp::{
        Otlp, OtlpConfig, Protocol,
        tests::{Collector, config, free_addr, judged, labels, serve, serve_http, wait_for},
    },
    judging::JudgedRequest,
    report::tests::MS,
    requests::{Figure, Outcome},
};

const TTFT: &str = "gen_ai.server.time_to_first_token";
const TPOT: &str = "gen_ai.server.time_per_output_token";
const DURATION: &str = "gen_ai.server.request.duration";

/// Request `i` with a TTFT of its own (so that the sum means something);
/// every fourth one a 503.
fn request(i: u64) -> JudgedRequest {
    let mut j = judged(i);
    j.record.ttft_ns = Some(10 * MS + i * 137_531);
    if i % 4 == 3 {
        j.record.outcome = Outcome::ErrorStatus;
        j.record.http_status = Some(503);
    }
    j
}

/// The histogram as the last export carried it: one data point per
/// attribute set (cumulative, so the last one holds the totals), its unit
/// and temporality.
struct Received {
    unit: String,
    temporality: i32,
    points: BTreeMap<String, HistogramDataPoint>,
}

fn key(attrs: &[KeyValue]) -> String {
    let mut kv: Vec<String> = attrs.iter().map(|a| format!("{a:?}")).collect();
    kv.sort();
    kv.join(",")
}

fn received(c: &Collector, name: &str) -> Option<Received> {
    let mut out: Option<Received> = None;
    for m in &c.metrics_named(name) {
        let Some(Data::Histogram(h)) = &m.data else {
            panic!("{name} is not a histogram: {m:?}");
        };
        let r = out.get_or_insert_with(|| Received {
            unit: m.unit.clone(),
            temporality: h.aggregation_temporality,
            points: BTreeMap::new(),
        });
        for p in &h.data_points {
            r.points.insert(key(&p.attributes), p.clone());
        }
    }
    out
}

fn count(c: &Collector, name: &str) -> u64 {
    received(c, name).map_or(0, |r| r.points.values().map(|p| p.count).sum())
}

fn string_attr<'a>(p: &'a HistogramDataPoint, key: &str) -> Option<&'a str> {
    p.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .and_then(|v| match v {
            any_value::Value::StringValue(s) => Some(s.as_str()),
            _ => None,
        })
}

fn int_attr(p: &HistogramDataPoint, key: &str) -> Option<i64> {
    p.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .and_then(|v| match v {
            any_value::Value::IntValue(i) => Some(*i),
            _ => None,
        })
}

/// `ttft_trace_otlp_metric_exports_total{result}` from the registry.
fn exports(registry: &Registry, result: &str) -> u64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == "ttft_trace_otlp_metric_exports_total")
        .flat_map(|f| f.get_metric())
        .filter(|m| m.get_label().iter().any(|l| l.value() == result))
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

/// The figures of `requests` a histogram must hold, in seconds.
fn figures(requests: &[JudgedRequest], figure: Figure) -> Vec<f64> {
    requests
        .iter()
        .flat_map(|j| j.record.observations())
        .filter(|&(f, _)| f == figure)
        .map(|(_, ns)| ns as f64 / 1e9)
        .collect()
}

/// The sum of a histogram against the JSONL's figures: they differ only by
/// the rounding of f64 additions (about 1e-16 relative each), so 1 ns is a
/// wide margin.
const SUM_TOLERANCE_S: f64 = 1e-9;

#[test]
fn the_genai_histograms_reach_a_real_receiver_with_the_conventions_buckets() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let _receiver = serve(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let mut otlp = Otlp::start(&config(addr), &registry).expect("starts");
    let requests: Vec<JudgedRequest> = (0..20).map(request).collect();
    for j in &requests {
        otlp.request(&labels(), 42, j);
    }
    otlp.shutdown();
    assert!(exports(&registry, "ok") > 0);
    assert_eq!(exports(&registry, "failed"), 0);

    for (name, figure, bounds) in [
        (TTFT, Figure::Ttft, &TTFT_BOUNDARIES[..]),
        (TPOT, Figure::Tpot, &TPOT_BOUNDARIES[..]),
        (DURATION, Figure::E2e, &DURATION_BOUNDARIES[..]),
    ] {
        let r = received(&collector, name).unwrap_or_else(|| panic!("{name} received"));
        assert_eq!(r.unit, "s", "{name}");
        assert_eq!(
            r.temporality,
            AggregationTemporality::Cumulative as i32,
            "{name}"
        );
        let want = figures(&requests, figure);
        let mut got_count = 0;
        let mut got_sum = 0.0;
        for p in r.points.values() {
            assert_eq!(
                p.explicit_bounds, bounds,
                "{name}: the conventions' buckets"
            );
            assert_eq!(p.bucket_counts.iter().sum::<u64>(), p.count, "{name}");
            assert_eq!(string_attr(p, "gen_ai.operation.name"), Some("chat"));
            assert_eq!(int_attr(p, "server.port"), Some(2));
            assert_eq!(string_attr(p, "k8s.pod.name"), Some("vllm-0"));
            assert_eq!(string_attr(p, "k8s.namespace.name"), Some("serving"));
            assert_eq!(string_attr(p, "ttft_trace.workload.comm"), Some("vllm"));
            got_count += p.count;
            got_sum += p.sum.expect("a sum");
        }
        if name == DURATION {
            // The 503s are timed too, under their error type.
            let errors = requests
                .iter()
                .filter(|j| j.record.outcome == Outcome::ErrorStatus)
                .count() as u64;
            assert!(errors > 0);
            let failed = r
                .points
                .values()
                .find(|p| string_attr(p, "error.type") == Some("503"))
                .expect("a point for the 503s");
            assert_eq!(failed.count, errors);
            assert_eq!(got_count, want.len() as u64 + errors);
            got_count -= errors;
            got_sum -= failed.sum.expect("a sum");
        } else {
            assert!(
                r.points
                    .values()
                    .all(|p| string_attr(p, "error.type").is_none())
            );
        }
        assert!(!want.is_empty());
        assert_eq!(got_count, want.len() as u64, "{name}: one per request");
        let want_sum: f64 = want.iter().sum();
        assert!(
            (got_sum - want_sum).abs() <= SUM_TOLERANCE_S,
            "{name}: sum {got_sum} vs {want_sum}"
        );
    }
    assert_eq!(
        count(&collector, TTFT),
        requests
            .iter()
            .filter(|j| j.record.outcome == Outcome::Ok)
            .count() as u64,
        "TTFT of every whole response, none of the 503s"
    );
}

#[test]
fn http_protobuf_carries_the_metrics_too() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let _receiver = serve_http(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let cfg = OtlpConfig {
        protocol: Protocol::HttpProtobuf,
        ..config(addr)
    };
    let mut otlp = Otlp::start(&cfg, &registry).expect("starts");
    let requests: Vec<JudgedRequest> = (0..6).map(judged).collect();
    for j in &requests {
        otlp.request(&labels(), 42, j);
    }
    otlp.shutdown();
    assert_eq!(count(&collector, TTFT), 6);
    assert_eq!(count(&collector, DURATION), 6);
    assert_eq!(exports(&registry, "failed"), 0);
}

#[test]
fn totals_survive_a_collector_down_and_its_failed_exports_are_counted() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let receiver = serve(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let cfg = OtlpConfig {
        metrics_every: Some(Duration::from_millis(100)),
        ..config(addr)
    };
    let mut otlp = Otlp::start(&cfg, &registry).expect("starts");
    for i in 0..5 {
        otlp.request(&labels(), 42, &judged(i));
    }
    wait_for("the first totals", || count(&collector, TTFT) == 5);

    receiver.shutdown_background();
    wait_for("the receiver to stop", || {
        std::net::TcpStream::connect(addr).is_err()
    });
    for i in 5..15 {
        otlp.request(&labels(), 42, &judged(i));
    }
    wait_for("a failed export", || exports(&registry, "failed") > 0);
    assert_eq!(
        count(&collector, TTFT),
        5,
        "nothing reached a stopped receiver"
    );

    let _receiver = serve(addr, &collector).expect("receiver");
    wait_for("the totals after the restart", || {
        count(&collector, TTFT) == 15
    });
    otlp.shutdown();
}

#[test]
fn attribute_sets_past_the_cap_fold_into_the_overflow_set() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let _receiver = serve(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let mut otlp = Otlp::start(&config(addr), &registry).expect("starts");
    let n = MAX_ATTRIBUTE_SETS + 50;
    for port in 0..n {
        let mut j = judged(1);
        j.record.server_port = port as u16;
        otlp.request(&labels(), 42, &j);
    }
    otlp.shutdown();
    let r = received(&collector, TTFT).expect("received");
    assert!(
        r.points.len() <= MAX_ATTRIBUTE_SETS + 1,
        "{} attribute sets",
        r.points.len()
    );
    let overflow = r
        .points
        .values()
        .find(|p| {
            p.attributes.iter().any(|kv| {
                kv.key == "otel.metric.overflow"
                    && kv.value.as_ref().and_then(|v| v.value.as_ref())
                        == Some(&any_value::Value::BoolValue(true))
            })
        })
        .expect("an overflow set");
    assert!(overflow.count >= 50);
    assert_eq!(
        r.points.values().map(|p| p.count).sum::<u64>(),
        n as u64,
        "every request counted, in its own set or the overflow one"
    );
}
