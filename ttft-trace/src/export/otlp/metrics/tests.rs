//! The GenAI metrics against real OTLP receivers (the collector's metrics
//! service generated from the OpenTelemetry protocol definitions, over gRPC
//! and over HTTP).

use std::{collections::BTreeMap, time::Duration};

use opentelemetry_proto::tonic::{
    common::v1::{KeyValue, any_value},
    metrics::v1::{AggregationTemporality, HistogramDataPoint, metric::Data},
};
use prometheus::Registry;

use super::{
    AttributeSets, DURATION_BOUNDARIES, MAX_ATTRIBUTE_SETS, TPOT_BOUNDARIES, TTFT_BOUNDARIES,
};
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
    let n = MAX_ATTRIBUTE_SETS + 50;
    // No workload share below the SDK's cap: the cap is what is tested.
    let cfg = OtlpConfig {
        attribute_sets_per_workload: n,
        ..config(addr)
    };
    let mut otlp = Otlp::start(&cfg, &registry).expect("starts");
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

/// The attribute sets of one workload whose pod is `pod`, under `comm`.
fn in_pod(comm: &str, pod: &str) -> crate::workloads::WorkloadLabels {
    crate::workloads::WorkloadLabels {
        comm: comm.into(),
        pod: pod.into(),
        ..labels()
    }
}

#[test]
fn a_workload_holds_its_share_of_attribute_sets_until_it_retires() {
    let mut sets = AttributeSets::new(2);
    let (a, a2, b) = (in_pod("a", "p"), in_pod("a2", "p"), in_pod("b", "q"));
    assert!(sets.admit(&a, (80, None)));
    assert!(sets.admit(&a, (80, Some("503".into()))));
    assert!(sets.admit(&a, (80, None)), "a set it holds");
    assert!(!sets.admit(&a, (81, None)), "past its pod's share");
    assert!(!sets.admit(&a2, (80, None)), "the share is the pod's");
    assert!(sets.admit(&b, (80, None)), "another pod is untouched");
    assert_eq!((sets.exceeded(), sets.len()), (2, 3));
    // Its label set retired: its sets are forgotten, its pod has room.
    sets.retire(&a);
    assert_eq!(sets.len(), 1);
    assert!(sets.admit(&a2, (80, None)));
    sets.retire(&a2);
    sets.retire(&b);
    assert!(sets.is_empty());
    // Outside a pod, a workload is its own tenant.
    let mut sets = AttributeSets::new(1);
    let (x, y) = (in_pod("x", ""), in_pod("y", ""));
    assert!(sets.admit(&x, (1, None)) && sets.admit(&y, (1, None)));
    assert!(!sets.admit(&x, (2, None)));
}

/// Against a real receiver: a workload with a share of 10 sets, on 30
/// ports, gets 10 sets of its own and one overflow set of its pod
/// (`comm="_other"`) with its 20 other requests; another pod's 5 sets are
/// its own; once its label set retired, its next request gets a set of its
/// own again.
#[test]
fn past_its_share_a_workload_records_in_its_own_overflow_set() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let _receiver = serve(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let cfg = OtlpConfig {
        attribute_sets_per_workload: 10,
        ..config(addr)
    };
    let mut otlp = Otlp::start(&cfg, &registry).expect("starts");
    let (greedy, other) = (in_pod("greedy", "greedy-0"), in_pod("vllm", "vllm-0"));
    let send = |otlp: &mut Otlp, l: &crate::workloads::WorkloadLabels, port: u16| {
        let mut j = judged(1);
        j.record.server_port = port;
        otlp.request(l, 42, &j);
    };
    for port in 0..30 {
        send(&mut otlp, &greedy, 1000 + port);
    }
    for port in 0..5 {
        send(&mut otlp, &other, 2000 + port);
    }
    assert_eq!(otlp.attribute_sets(&[]), (20, 15));
    assert_eq!(otlp.attribute_sets(std::slice::from_ref(&greedy)), (20, 5));
    send(&mut otlp, &greedy, 3000);
    assert_eq!(otlp.attribute_sets(&[]), (20, 6));
    otlp.shutdown();
    let r = received(&collector, TTFT).expect("received");
    let of = |comm: &str, pod: &str| -> Vec<&HistogramDataPoint> {
        r.points
            .values()
            .filter(|p| {
                string_attr(p, "ttft_trace.workload.comm") == Some(comm)
                    && string_attr(p, "k8s.pod.name") == Some(pod)
            })
            .collect()
    };
    assert_eq!(
        of("greedy", "greedy-0").len(),
        11,
        "10, then one after it retired"
    );
    let overflow = of("_other", "greedy-0");
    assert_eq!(overflow.len(), 1);
    assert_eq!(overflow[0].count, 20);
    assert!(int_attr(overflow[0], "server.port").is_none());
    assert_eq!(of("vllm", "vllm-0").len(), 5);
    assert!(of("_other", "vllm-0").is_empty());
}
