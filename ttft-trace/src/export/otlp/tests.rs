//! The sink against a real OTLP receiver (gRPC and HTTP): the collector
//! services generated from the OpenTelemetry protocol definitions
//! (`opentelemetry-proto`), served on loopback.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    time::{Duration, Instant},
};

use opentelemetry_proto::tonic::{
    common::v1::{AnyValue, any_value},
    trace::v1::Span,
};
use prometheus::Registry;

use super::{Otlp, OtlpConfig};
use crate::{
    causes::{Attribution, Cause, CauseClass, Evidence, RequestTimes},
    judging::{JudgedRequest, JudgedStalls, Truncation},
    report::tests::{MS, record},
    requests::Outcome,
    workloads::WorkloadLabels,
};

/// The tests crate's OTLP receiver (`tests/src/otlp_receiver.rs`), the one
/// every test that exports to a collector uses: included by path, as this
/// crate cannot depend on the tests crate. Its helpers for the daemon's
/// tests (`histogram`) are not all used here.
#[allow(dead_code)]
#[path = "../../../../tests/src/otlp_receiver.rs"]
pub(super) mod receiver;

pub(super) use receiver::{Collector, free_addr, serve, serve_http};

pub(super) fn config(addr: SocketAddr) -> OtlpConfig {
    OtlpConfig {
        endpoint: Some(format!("http://{addr}")),
        flush_every: Duration::from_millis(50),
        ..OtlpConfig::default()
    }
}

pub(super) fn labels() -> WorkloadLabels {
    WorkloadLabels {
        comm: "vllm".into(),
        container: String::new(),
        pod: "vllm-0".into(),
        namespace: "serving".into(),
        pid: None,
    }
}

/// Request `i`: arrival `i` ms after T0; every third one slow with a
/// network cause and two retransmits; every fifth without a GPU episode.
pub(super) fn judged(i: u64) -> JudgedRequest {
    let mut r = record(Outcome::Ok);
    let shift = i * MS;
    r.request_index = i as u32;
    r.t_arrive_ns += shift;
    for t in [
        &mut r.t_first_byte_ns,
        &mut r.t_first_token_ns,
        &mut r.t_done_ns,
    ] {
        *t = t.map(|t| t + shift);
    }
    r.t_first_token_acked_ns = r.t_first_token_ns.map(|t| t + 2 * MS);
    r.srtt_ns = Some(MS);
    if i % 5 == 4 {
        (r.queue_ns, r.gpu_ns, r.egress_ns) = (None, None, None);
    }
    let slow = i.is_multiple_of(3);
    let mut evidence = Evidence::new(RequestTimes::from(&r));
    let mut attribution = Attribution {
        slow,
        slo_violation: slow,
        ..Attribution::default()
    };
    if slow {
        evidence.add_retransmit(r.t_arrive_ns + 3 * MS);
        evidence.add_retransmit(r.t_arrive_ns + 7 * MS);
        evidence.runq_ns = 2 * MS;
        attribution.causes = vec![Cause {
            class: CauseClass::Network,
            explained_ns: 6 * MS,
            evidence: BTreeMap::new(),
        }];
    }
    JudgedRequest {
        record: r,
        evidence,
        attribution,
        tcp_retransmits: if slow { 2 } else { 0 },
        stalls: JudgedStalls::default(),
    }
}

fn spans_of(j: &JudgedRequest) -> u64 {
    if j.record.queue_ns.is_some() { 4 } else { 1 }
}

/// Polls `done` until true or 30 s pass (a generous bound for a loaded
/// machine, not a timing assertion).
pub(super) fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a any_value::Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

fn int_attr(span: &Span, key: &str) -> Option<i64> {
    match attr(span, key) {
        Some(any_value::Value::IntValue(v)) => Some(*v),
        _ => None,
    }
}

#[test]
fn a_span_tree_per_request_reaches_a_real_receiver_with_the_jsonl_times() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let _receiver = serve(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let mut otlp = Otlp::start(&config(addr), &registry).expect("starts");
    let requests: Vec<JudgedRequest> = (0..20).map(judged).collect();
    for j in &requests {
        otlp.request(&labels(), 42, j);
    }
    otlp.shutdown();
    let want: u64 = requests.iter().map(spans_of).sum();
    assert_eq!(otlp.exported(), want);
    assert_eq!(
        otlp.dropped("queue_full") + otlp.dropped("export_failed"),
        0
    );

    let got = collector.traces();
    let mut offset = None;
    let mut spans = Vec::new();
    for req in got.iter() {
        for rs in &req.resource_spans {
            let resource = rs.resource.as_ref().expect("resource");
            let find = |key: &str| {
                resource
                    .attributes
                    .iter()
                    .find(|kv| kv.key == key)
                    .and_then(|kv| kv.value.as_ref())
                    .and_then(|v| v.value.clone())
            };
            assert_eq!(
                find("service.name"),
                Some(any_value::Value::StringValue("ttft-trace".into()))
            );
            match find("ttft_trace.clock.monotonic_to_unix_offset_ns") {
                Some(any_value::Value::IntValue(o)) => offset = Some(o),
                other => panic!("no clock offset on the resource: {other:?}"),
            }
            for ss in &rs.scope_spans {
                spans.extend(ss.spans.iter().cloned());
            }
        }
    }
    assert_eq!(spans.len() as u64, want, "spans received = spans sent");
    let offset = i128::from(offset.expect("an offset"));
    let unix = |mono: u64| u64::try_from(i128::from(mono) + offset).expect("after 1970");
    let roots: HashMap<i64, &Span> = spans
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .map(|s| (int_attr(s, "ttft_trace.request_index").expect("index"), s))
        .collect();
    assert_eq!(roots.len(), requests.len(), "one server span per request");
    for j in &requests {
        let r = &j.record;
        let root = roots[&i64::from(r.request_index)];
        assert_eq!(root.kind, 2, "SPAN_KIND_SERVER");
        assert_eq!(
            root.start_time_unix_nano,
            unix(r.t_arrive_ns),
            "arrival, to the ns"
        );
        assert_eq!(root.end_time_unix_nano, unix(r.t_done_ns.expect("done")));
        assert_eq!(int_attr(root, "http.response.status_code"), Some(200));
        assert_eq!(int_attr(root, "ttft_trace.ttft_ns"), Some(10 * MS as i64));
        for key in [
            "client.address",
            "server.port",
            "ttft_trace.outcome",
            "k8s.pod.name",
        ] {
            assert!(attr(root, key).is_some(), "{key}");
        }
        let event = |name: &str| -> Vec<u64> {
            root.events
                .iter()
                .filter(|e| e.name == name)
                .map(|e| e.time_unix_nano)
                .collect()
        };
        assert_eq!(
            event("first_token"),
            [unix(r.t_first_token_ns.expect("ft"))]
        );
        assert_eq!(
            event("first_token_acked"),
            [unix(r.t_first_token_acked_ns.expect("acked"))]
        );
        let retransmits: Vec<u64> = j
            .evidence
            .retransmit_times_ns
            .iter()
            .map(|&t| unix(t))
            .collect();
        assert_eq!(event("tcp.retransmit"), retransmits);
        if j.attribution.slow {
            assert_eq!(
                int_attr(root, "ttft_trace.cause.network.explained_ns"),
                Some(6 * MS as i64)
            );
            assert_eq!(
                int_attr(root, "ttft_trace.evidence.runq_ns"),
                Some(2 * MS as i64)
            );
            assert!(attr(root, "ttft_trace.causes").is_some());
        } else {
            assert!(attr(root, "ttft_trace.causes").is_none());
        }
        let children: BTreeMap<&str, &Span> = spans
            .iter()
            .filter(|s| s.parent_span_id == root.span_id)
            .map(|s| (s.name.as_str(), s))
            .collect();
        match (r.queue_ns, r.gpu_ns, r.egress_ns) {
            (Some(q), Some(g), Some(e)) => {
                let t0 = r.t_arrive_ns;
                let at = |name: &str| {
                    let s = children[name];
                    assert_eq!(s.trace_id, root.trace_id, "{name}: same trace");
                    assert_eq!(s.kind, 1, "{name}: SPAN_KIND_INTERNAL");
                    (s.start_time_unix_nano, s.end_time_unix_nano)
                };
                assert_eq!(at("queue"), (unix(t0), unix(t0 + q)));
                assert_eq!(at("gpu_episode"), (unix(t0 + q), unix(t0 + q + g)));
                assert_eq!(at("egress"), (unix(t0 + q + g), unix(t0 + q + g + e)));
                assert_eq!(t0 + q + g + e, r.t_first_token_ns.expect("ft"));
            }
            _ => assert!(children.is_empty(), "no breakdown, no children"),
        }
    }
}

#[test]
fn a_receiver_stopped_and_restarted_loses_spans_counted_and_memory_stays_bounded() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let receiver = serve(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let cfg = OtlpConfig {
        queue_requests: 8,
        batch_spans: 16,
        ..config(addr)
    };
    let mut otlp = Otlp::start(&cfg, &registry).expect("starts");
    let mut sent = 0u64;
    let mut send = |otlp: &mut Otlp, range: std::ops::Range<u64>| {
        for i in range {
            // Not slow, with a breakdown: four spans each.
            let j = judged(i * 15 + 1);
            sent += spans_of(&j);
            otlp.request(&labels(), 42, &j);
        }
        sent
    };
    let accounted = |o: &Otlp| o.exported() + o.dropped("queue_full") + o.dropped("export_failed");

    let before = send(&mut otlp, 0..5);
    wait_for("the first spans", || otlp.exported() == before);

    // The collector dies: its connections close, new ones are refused.
    receiver.shutdown_background();
    wait_for("the receiver to stop", || {
        std::net::TcpStream::connect(addr).is_err()
    });
    let during = send(&mut otlp, 5..2005);
    wait_for("every span exported or dropped", || {
        accounted(&otlp) == during
    });
    assert_eq!(
        otlp.exported(),
        before,
        "nothing reached a stopped receiver"
    );
    assert!(
        otlp.dropped("queue_full") > 0,
        "a flood beyond the queue is dropped at once, not held"
    );
    assert!(
        otlp.dropped("queue_full") >= (during - before) - (8 + 16) * 4,
        "at most the queue and one batch were held"
    );

    let _receiver = serve(addr, &collector).expect("receiver");
    // The channel reconnects: spans sent after the restart arrive.
    let mut after = during;
    wait_for("export after the restart", || {
        after = send(&mut otlp, 0..1);
        std::thread::sleep(Duration::from_millis(100));
        otlp.exported() > before
    });
    otlp.shutdown();
    eprintln!(
        "spans sent {after}: exported {}, dropped queue_full {}, export_failed {}",
        otlp.exported(),
        otlp.dropped("queue_full"),
        otlp.dropped("export_failed")
    );
    assert_eq!(
        accounted(&otlp),
        after,
        "every span exported or counted dropped"
    );
    assert_eq!(
        collector.spans() as u64,
        otlp.exported(),
        "the receiver got what was counted"
    );
    let text = crate::export::prometheus::render(&registry);
    assert!(
        text.contains(&format!(
            "ttft_trace_otlp_spans_dropped_total{{reason=\"queue_full\"}} {}",
            otlp.dropped("queue_full")
        )),
        "{text}"
    );
}

#[test]
fn the_ratio_samples_that_share_of_trace_ids() {
    use super::sampled;
    use opentelemetry::trace::TraceId;
    // Ids spread evenly over the space, as random ones are.
    let ids: Vec<TraceId> = (0..1000u128)
        .map(|i| TraceId::from(i * (u128::MAX / 1000) + 12345))
        .collect();
    let share = |ratio: f64| ids.iter().filter(|&&id| sampled(id, ratio)).count();
    assert_eq!(share(0.0), 0);
    assert_eq!(share(1.0), 1000);
    let quarter = share(0.25);
    assert!((240..=260).contains(&quarter), "{quarter}");
}

#[test]
fn slow_requests_are_exported_whatever_the_ratio() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let _receiver = serve(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let cfg = OtlpConfig {
        sample_ratio: 0.0,
        ..config(addr)
    };
    let mut otlp = Otlp::start(&cfg, &registry).expect("starts");
    let requests: Vec<JudgedRequest> = (0..12).map(judged).collect();
    for j in &requests {
        otlp.request(&labels(), 42, j);
    }
    otlp.shutdown();
    let slow = requests.iter().filter(|j| j.attribution.slow);
    assert_eq!(otlp.exported(), slow.clone().map(spans_of).sum::<u64>());
    assert_eq!(
        otlp.counters.unsampled.get(),
        (requests.len() - slow.count()) as u64
    );
}

#[test]
fn http_protobuf_reaches_an_http_receiver() {
    let addr = free_addr().expect("a free port");
    let collector = Collector::default();
    let _receiver = serve_http(addr, &collector).expect("receiver");
    let registry = Registry::new();
    let cfg = OtlpConfig {
        protocol: super::Protocol::HttpProtobuf,
        ..config(addr)
    };
    let mut otlp = Otlp::start(&cfg, &registry).expect("starts");
    let requests: Vec<JudgedRequest> = (0..6).map(judged).collect();
    for j in &requests {
        otlp.request(&labels(), 42, j);
    }
    otlp.shutdown();
    let want: u64 = requests.iter().map(spans_of).sum();
    assert_eq!(otlp.exported(), want);
    assert_eq!(collector.spans() as u64, want);
}

#[test]
fn http_base_urls_get_the_signal_path() {
    let url = |e| super::http_signal_url(e, "v1/traces");
    assert_eq!(url("http://c:4318"), "http://c:4318/v1/traces");
    assert_eq!(url("http://c:4318/"), "http://c:4318/v1/traces");
    assert_eq!(url("https://c/otlp/v1/traces"), "https://c/otlp/v1/traces");
    assert_eq!(
        super::http_signal_url("http://c:4318", "v1/metrics"),
        "http://c:4318/v1/metrics"
    );
}

/// One `stall` event per judged stall on the server span, at the stall's
/// start, with its cause, the time it explains and the interfering request;
/// the request's stall totals and pace as attributes.
#[test]
fn each_stall_is_an_event_with_its_cause_and_explained_time() {
    use opentelemetry::{Key, Value, trace::Event};
    use opentelemetry_sdk::trace::{IdGenerator as _, RandomIdGenerator};

    use super::{Clock, spans};
    use crate::{causes::RequestId, judging::JudgedStall, requests::stream_stalls::SeenAt};

    let mut j = judged(1);
    let t = j.record.t_first_token_ns.expect("first token");
    let stall = |start: u64, causes: Vec<Cause>, interfering, seen_at| JudgedStall {
        t_start_ns: start,
        t_end_ns: start + 500 * MS,
        duration_ns: 500 * MS,
        seen_at,
        causes,
        interfering_request: interfering,
    };
    let prefill = Cause {
        class: CauseClass::PrefillInterference,
        explained_ns: 440 * MS,
        evidence: BTreeMap::new(),
    };
    let other = RequestId {
        conn: 0xdef,
        request_index: 3,
    };
    j.stalls = JudgedStalls {
        count: 2,
        total_ns: 1_000 * MS,
        longest_ns: 500 * MS,
        windows: vec![
            stall(t + 20 * MS, vec![prefill], Some(other), SeenAt::Send),
            stall(t + 600 * MS, vec![], None, SeenAt::Delivery),
        ],
        pace_ratio_permille: Some(2500),
        degrading: true,
        chunk_growth_permille: Some(900),
        truncated: Some(Truncation::NoFinishReason),
        ..JudgedStalls::default()
    };
    let clock = Clock::now();
    let ids = RandomIdGenerator::default();
    let out = spans(&j, &labels(), 7, clock, ids.new_trace_id(), &ids);
    let root = &out[0];
    let get = |attrs: &[opentelemetry::KeyValue], key: &'static str| {
        attrs
            .iter()
            .find(|kv| kv.key == Key::from_static_str(key))
            .map(|kv| kv.value.clone())
    };
    let stalls: Vec<&Event> = root
        .events
        .events
        .iter()
        .filter(|e| e.name == "stall")
        .collect();
    assert_eq!(stalls.len(), 2);
    assert_eq!(stalls[0].timestamp, clock.at(t + 20 * MS));
    let first = &stalls[0].attributes;
    assert_eq!(
        get(first, "ttft_trace.stall.cause"),
        Some(Value::from("prefill_interference"))
    );
    assert_eq!(
        get(first, "ttft_trace.stall.explained_ns"),
        Some(Value::I64((440 * MS) as i64))
    );
    assert_eq!(
        get(first, "ttft_trace.stall.duration_ns"),
        Some(Value::I64((500 * MS) as i64))
    );
    assert_eq!(
        get(first, "ttft_trace.stall.seen_at"),
        Some(Value::from("send"))
    );
    assert_eq!(
        get(first, "ttft_trace.stall.interfering.connection"),
        Some(Value::from("0xdef"))
    );
    assert_eq!(
        get(first, "ttft_trace.stall.interfering.request_index"),
        Some(Value::I64(3))
    );
    let second = &stalls[1].attributes;
    assert_eq!(
        get(second, "ttft_trace.stall.cause"),
        Some(Value::from("unexplained"))
    );
    assert_eq!(
        get(second, "ttft_trace.stall.explained_ns"),
        Some(Value::I64(0))
    );
    assert_eq!(get(second, "ttft_trace.stall.interfering.connection"), None);
    assert_eq!(
        get(second, "ttft_trace.stall.seen_at"),
        Some(Value::from("delivery"))
    );
    let attrs = &root.attributes;
    assert_eq!(get(attrs, "ttft_trace.stalls.count"), Some(Value::I64(2)));
    assert_eq!(
        get(attrs, "ttft_trace.pace_ratio_permille"),
        Some(Value::I64(2500))
    );
    assert_eq!(get(attrs, "ttft_trace.degrading"), Some(Value::Bool(true)));
    assert_eq!(
        get(attrs, "ttft_trace.chunk_growth_permille"),
        Some(Value::I64(900))
    );
    assert_eq!(
        get(attrs, "ttft_trace.chunks_growing"),
        Some(Value::Bool(false))
    );
    assert_eq!(
        get(attrs, "ttft_trace.truncated"),
        Some(Value::from("no_finish_reason"))
    );
    assert_eq!(get(attrs, "ttft_trace.finish_reason"), None);
    assert_eq!(get(attrs, "tls.protocol.version"), None, "not TLS");
}

#[test]
fn tls_and_retry_facts_are_in_the_root_span() {
    use opentelemetry::{Key, Value};
    use opentelemetry_sdk::trace::{IdGenerator as _, RandomIdGenerator};

    use super::{Clock, spans};
    use crate::requests::{AttemptId, TlsFacts, TlsVersion};

    let mut j = judged(1);
    j.record.tls = Some(TlsFacts {
        version: TlsVersion::Tls13,
        resumed: Some(true),
        handshake_ns: Some(3 * MS),
        hello_retry: false,
        counted: true,
    });
    j.record.retry_of = Some(AttemptId {
        conn: 0xabc,
        request_index: 2,
        client_port: 41_000,
    });
    j.record.user_ttft_ns = Some(400 * MS);
    let ids = RandomIdGenerator::default();
    let out = spans(&j, &labels(), 7, Clock::now(), ids.new_trace_id(), &ids);
    let attrs = &out[0].attributes;
    let get = |key: &'static str| {
        attrs
            .iter()
            .find(|kv| kv.key == Key::from_static_str(key))
            .map(|kv| kv.value.clone())
    };
    assert_eq!(get("tls.protocol.name"), Some(Value::from("tls")));
    assert_eq!(get("tls.protocol.version"), Some(Value::from("1.3")));
    assert_eq!(get("tls.resumed"), Some(Value::Bool(true)));
    assert_eq!(
        get("ttft_trace.tls.handshake_ns"),
        Some(Value::I64(3_000_000))
    );
    assert_eq!(
        get("ttft_trace.tls.handshake_counted"),
        Some(Value::Bool(true))
    );
    assert_eq!(
        get("ttft_trace.retry_of.connection"),
        Some(Value::from("0xabc"))
    );
    assert_eq!(
        get("ttft_trace.retry_of.request_index"),
        Some(Value::I64(2))
    );
    assert_eq!(
        get("ttft_trace.user_ttft_ns"),
        Some(Value::I64(400_000_000))
    );
}
