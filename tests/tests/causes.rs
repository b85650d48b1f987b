//! Root-only: each of the six causes injected for real into the demo server
//! (its own fault switches, nftables packet loss, a CPU hog sharing its CPU),
//! traced, and the attribution scored: recall on the faulty requests, false
//! positives on the clean ones. Prints the matrix.
//!
//! A clean request the machine itself made slow is no false positive: one
//! over the objective by less than the run-queue delay the kernel counted
//! for the server's threads over it (their schedstat, sampled apart from
//! the tracer) plus the client's own (the load generator's schedstat) is
//! left out of the false positives, and counted; at most half the clean
//! requests may be left out, so that the check cannot become vacuous.

use std::{collections::BTreeMap, time::Duration};

use anyhow::Result;
use serde_json::Value;
use ttft_trace_tests::{
    demo::{ClientRequest, DemoServer, loadgen},
    faults::{self, CpuHog, PacketLoss, RunDelaySampler, RunDelays},
    tracer::{Tracer, root_test, wait_for_requests},
};

/// One scenario's outcome.
struct Scored {
    faulty: usize,
    recalled: usize,
    clean: usize,
    false_positives: usize,
    /// Clean requests the machine made slow: left out of the false
    /// positives.
    machine_slowed: usize,
    /// The most run-queue delay of the server's threads over a clean
    /// request's TTFT, ns.
    clean_runq_max_ns: u64,
    /// Attributed classes over the faulty requests.
    mix: BTreeMap<String, usize>,
    /// Requests with TCP retransmits on their own connection.
    with_retransmits: usize,
    total: usize,
}

type Guard = Option<Box<dyn std::any::Any>>;

/// The tracer's default objective: a request over it is slow.
const OBJECTIVE_NS: u64 = 350_000_000;

/// Whether the machine, not the server, made the traced request `t` slow:
/// it is over the objective (by its TTFT or its client TTFT estimate) by
/// less than the run-queue delay of the server's threads over that time
/// plus the client's own across the read of its first token.
fn machine_slowed(t: &Value, client: &ClientRequest, server_runq: &RunDelays) -> bool {
    let slow_figure = ["ttft_ns", "client_ttft_estimate_ns"]
        .iter()
        .filter_map(|k| t[k].as_u64())
        .max()
        .unwrap_or(0);
    let Some(excess) = slow_figure.checked_sub(OBJECTIVE_NS).filter(|e| *e > 0) else {
        return false;
    };
    let Some(arrive) = t["t_arrive_ns"].as_u64() else {
        return false;
    };
    let Some(server) = server_runq.within(arrive, arrive + slow_figure) else {
        return false;
    };
    server + client.first_token_runq_ns.unwrap_or(0) >= excess
}

/// Runs the demo server under the tracer, with `setup` applied once it
/// listens (loss, hog) and `load` for the load generator; scores the
/// attribution of `class` on the requests `is_faulty` selects.
fn scenario(
    class: &str,
    tracer_args: &[&str],
    server_args: &[&str],
    load: &[&str],
    setup: impl FnOnce(&DemoServer) -> Result<Guard>,
    is_faulty: impl Fn(&ClientRequest) -> bool,
) -> Result<Scored> {
    let server = DemoServer::start(server_args)?;
    let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let args = vec![
        "--pid".to_string(),
        server.pid.to_string(),
        "--interval".into(),
        "60".into(),
        "--listen".into(),
        listen.to_string(),
    ]
    .into_iter()
    .chain(tracer_args.iter().map(|a| a.to_string()))
    .collect::<Vec<String>>();
    let mut tracer = Tracer::start(&args, 0)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    let sampler = RunDelaySampler::start(server.pid);
    let guard = setup(&server)?;
    let clients = loadgen(server.port, load)?;
    drop(guard);
    let server_runq = sampler.finish();
    wait_for_requests(listen, clients.len(), Duration::from_secs(30))?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    server.stop()?;
    assert!(out.success, "{}", out.stderr);
    let traced: BTreeMap<(u64, u64), &Value> = out
        .lines
        .iter()
        .filter(|l| l["type"] == "request")
        .map(|r| {
            let port = r["client_port"].as_u64().unwrap_or(0);
            let index = r["request_index"].as_u64().unwrap_or(0) + 1;
            ((port, index), r)
        })
        .collect();
    let mut s = Scored {
        faulty: 0,
        recalled: 0,
        clean: 0,
        false_positives: 0,
        machine_slowed: 0,
        clean_runq_max_ns: 0,
        mix: BTreeMap::new(),
        with_retransmits: 0,
        total: clients.len(),
    };
    for c in &clients {
        let key = (u64::from(c.client_port), u64::from(c.req_on_conn));
        let Some(t) = traced.get(&key) else {
            panic!("client request {} not traced", c.id);
        };
        s.with_retransmits += usize::from(t["tcp_retransmits"].as_u64().unwrap_or(0) > 0);
        let classes: Vec<String> = t["causes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| c["class"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        if is_faulty(c) {
            s.faulty += 1;
            s.recalled += usize::from(classes.iter().any(|k| k == class));
            if classes.is_empty() {
                let label = if t["slow"] == true {
                    "unexplained"
                } else {
                    "not slow"
                };
                *s.mix.entry(label.into()).or_default() += 1;
            }
            for k in classes {
                *s.mix.entry(k).or_default() += 1;
            }
        } else {
            s.clean += 1;
            let by_machine = machine_slowed(t, c, &server_runq);
            if let (Some(a), Some(ttft)) = (t["t_arrive_ns"].as_u64(), t["ttft_ns"].as_u64()) {
                let runq = server_runq.within(a, a + ttft).unwrap_or(0);
                s.clean_runq_max_ns = s.clean_runq_max_ns.max(runq);
            }
            s.machine_slowed += usize::from(by_machine);
            s.false_positives += usize::from(!classes.is_empty() && !by_machine);
            if !classes.is_empty() {
                eprintln!(
                    "{class}: clean request {} named {classes:?}{}: client TTFT {:?} s, traced {} \
                     ns, client estimate {} ns",
                    c.id,
                    if by_machine {
                        " (slowed by the machine: left out)"
                    } else {
                        ""
                    },
                    c.ttft_s,
                    t["ttft_ns"],
                    t["client_ttft_estimate_ns"]
                );
            }
        }
    }
    eprintln!(
        "| {class} | {}/{} ({:.0}%) | {:?} | {}/{} ({} slowed by the machine, left out; server \
         run-queue delay over a clean TTFT at most {:.1} ms) | {}/{} |",
        s.recalled,
        s.faulty,
        100.0 * s.recalled as f64 / s.faulty.max(1) as f64,
        s.mix,
        s.false_positives,
        s.clean - s.machine_slowed,
        s.machine_slowed,
        s.clean_runq_max_ns as f64 / 1e6,
        s.with_retransmits,
        s.total
    );
    Ok(s)
}

fn has_fault(name: &'static str) -> impl Fn(&ClientRequest) -> bool {
    move |c| c.faults.iter().any(|f| f == name)
}

const BASE: &[&str] = &["--output-tokens", "32"];

/// 12 requests of 32 tokens, `concurrency` at a time.
fn twelve_at(concurrency: &str) -> Vec<&str> {
    vec![
        "--concurrency",
        concurrency,
        "--requests",
        "12",
        "--output-tokens",
        "32",
    ]
}

fn load(fault: &str) -> Vec<&str> {
    let mut v = twelve_at("1");
    v.extend(["--fault", fault, "--fault-share", "0.5"]);
    v
}

fn no_setup(_: &DemoServer) -> Result<Guard> {
    Ok(None)
}

#[test]
fn each_injected_cause_is_named() -> Result<()> {
    let Some(_g) = root_test("each_injected_cause_is_named") else {
        return Ok(());
    };
    eprintln!(
        "| injected | recall | attributed (faulty requests) | false positives / clean the machine did not slow | with retransmits |"
    );
    eprintln!("| --- | --- | --- | --- | --- |");
    let mut results = Vec::new();
    for (class, fault, extra) in [
        ("queueing", "queueing", vec![]),
        ("batching", "batching_mismatch", vec![]),
        ("cpu", "tokenizer_stall", vec!["--stall-ms", "400"]),
        ("gpu_memory", "gpu_memory", vec!["--swap-mb", "6144"]),
        ("cold_start", "cold_start", vec!["--load-gb", "8"]),
    ] {
        let mut args = BASE.to_vec();
        args.extend(extra);
        let s = scenario(class, &[], &args, &load(fault), no_setup, has_fault(fault))?;
        results.push((class, s));
    }

    results.push(("cpu (hog)", cpu_contention(&[])?));

    // A clean run: no request is named slow, none sees retransmits.
    let clean_load = [
        "--concurrency",
        "2",
        "--requests",
        "16",
        "--output-tokens",
        "32",
    ];
    let clean = scenario("none", &[], BASE, &clean_load, no_setup, |_| false)?;
    assert_false_positives("clean run", &clean, 0.0);
    assert_eq!(clean.with_retransmits, 0, "clean run: no retransmits");

    for (class, s) in &results {
        assert_scored(class, s);
    }
    Ok(())
}

/// CPU contention: the server shares one CPU with two busy processes; its
/// tokenizer is CPU-bound (300 µs a token, ~155 ms a request), so losing
/// two thirds of the CPU makes requests slow (~460 ms). Alone it is not
/// slow (asserted here); returns the contended run's score.
fn cpu_contention(tracer_args: &[&str]) -> Result<Scored> {
    let cpu_args = ["--output-tokens", "32", "--tokenize-us-per-token", "300"];
    let cpu_load = twelve_at("2");
    // Alone, one request at a time: at 2 the second waits for the first's
    // tokens (~310 ms of the 350 ms objective), and CI saw 2 of 12 reach
    // 367-386 ms while the load generator and tracer took their share of
    // the 2 cores (named `cpu`, rightly: the server's threads were
    // runnable and not running).
    let alone_load = twelve_at("1");
    let alone = scenario("cpu", tracer_args, &cpu_args, &alone_load, no_setup, |_| {
        false
    })?;
    assert_false_positives("the CPU-bound server alone", &alone, 0.0);
    scenario(
        "cpu",
        tracer_args,
        &cpu_args,
        &cpu_load,
        |server| {
            let cpu = *faults::server_cpus()?.last().unwrap_or(&0);
            faults::pin(server.pid, &[cpu])?;
            Ok(Some(Box::new(CpuHog::start(&[cpu], 2)?)))
        },
        |c| c.ttft_s.is_some_and(|t| t > 0.35),
    )
}

/// The `cpu` cause from the exact scheduler source (`--sched exact`: the
/// switch program's spells, to the nanosecond) as from the default sampled
/// one: the stalled tokenizer and the contended CPU are named.
#[test]
fn cpu_is_named_from_the_exact_scheduler_source() -> Result<()> {
    let Some(_g) = root_test("cpu_is_named_from_the_exact_scheduler_source") else {
        return Ok(());
    };
    let exact = ["--sched", "exact"];
    let mut args = BASE.to_vec();
    args.extend(["--stall-ms", "400"]);
    let fault = "tokenizer_stall";
    let stall = scenario(
        "cpu",
        &exact,
        &args,
        &load(fault),
        no_setup,
        has_fault(fault),
    )?;
    let hogged = cpu_contention(&exact)?;
    assert_scored("cpu (exact)", &stall);
    assert_scored("cpu (hog, exact)", &hogged);
    Ok(())
}

/// At least three quarters of the faulty requests named, at most a tenth
/// of the clean ones the machine did not slow.
fn assert_scored(class: &str, s: &Scored) {
    assert!(s.faulty > 0, "{class}: no faulty request");
    let recall = s.recalled as f64 / s.faulty as f64;
    assert!(recall >= 0.75, "{class}: recall {recall}");
    assert_false_positives(class, s, 0.1);
}

/// At most `share` of the clean requests the machine did not slow named
/// with a cause; at most half of the clean requests left out as slowed by
/// the machine (more, and the run says nothing of false positives).
fn assert_false_positives(what: &str, s: &Scored, share: f64) {
    let judged = s.clean - s.machine_slowed;
    assert!(
        s.machine_slowed * 2 <= s.clean,
        "{what}: {} of {} clean requests slowed by the machine: too busy to judge false \
         positives",
        s.machine_slowed,
        s.clean
    );
    let fp = s.false_positives as f64 / judged.max(1) as f64;
    assert!(
        fp <= share,
        "{what}: false positives {}/{judged} ({fp:.2}; at most {share}), {} clean requests \
         slowed by the machine left out",
        s.false_positives,
        s.machine_slowed
    );
}

/// Network: 20 % of the server's packets to its clients dropped. The server's
/// TTFT ends when the first token is handed to its kernel; the client's ACK of
/// it tells when it arrived. The server answers one request at a time in
/// about 200 ms and sends its second token 250 ms after the first, so a lost
/// first token waits for the tail-loss probe (about 200 ms with one segment
/// in flight): those requests are slow for their client (> 350 ms), and no
/// others are.
#[test]
fn network_loss_is_named() -> Result<()> {
    let Some(_g) = root_test("network_loss_is_named") else {
        return Ok(());
    };
    network_loss(&[], &[])
}

/// The same on a server that closes after every response (issue 13). Its
/// second token comes 150 ms after the first, and the server closes right
/// after it: a lost first token is resent then (the second one's SACK
/// shows the hole), so its ACK, and often its retransmits, come after the
/// server's `close()`, while the kernel still holds the socket. A longer
/// prefill keeps the clean requests under 350 ms and the late ones above.
/// Every ACK before the close is read from the segment itself (its
/// acknowledgment number), so one after the close is known to be late
/// (docs/figures.md, "TCP at the handshake and after the application's close"). Before that was read, a
/// client segment between the first token and the close left the delivery
/// unknown, and recall fell to 2/5 in one CI run.
#[test]
fn network_loss_is_named_when_the_server_closes_after_every_response() -> Result<()> {
    let Some(_g) = root_test("network_loss_is_named_when_the_server_closes_after_every_response")
    else {
        return Ok(());
    };
    network_loss(
        &["--decode-step-ms", "150", "--prefill-us-per-token", "500"],
        &["--close-after-response", "--split-terminator"],
    )
}

/// `timing` overrides the server's prefill and decode times (later
/// arguments win).
fn network_loss(timing: &[&str], server_extra: &[&str]) -> Result<()> {
    let mut server = vec![
        "--output-tokens",
        "2",
        "--prefill-us-per-token",
        "350",
        "--decode-step-ms",
        "250",
    ];
    server.extend_from_slice(timing);
    server.extend_from_slice(server_extra);
    let load = [
        "--concurrency",
        "1",
        "--requests",
        "32",
        "--output-tokens",
        "2",
    ];
    eprintln!(
        "| injected | recall | attributed (faulty requests) | false positives / clean the machine did not slow | with retransmits |"
    );
    eprintln!("| --- | --- | --- | --- | --- |");
    let lossy = scenario(
        "network",
        &[],
        &server,
        &load,
        |server| {
            let loss = PacketLoss::start_with(server.port, 20, faults::Direction::FromServer)?;
            Ok(Some(Box::new(loss)))
        },
        |c| c.ttft_s.is_some_and(|t| t > 0.35),
    )?;
    assert!(
        lossy.with_retransmits > 0,
        "retransmits charged to the requests' own connection"
    );
    assert_scored("network", &lossy);
    Ok(())
}
