//! Root-only: interrupted retries on the demo server under the tracer. A
//! client closes a streamed completion after its first token and sends the
//! same request again on a new connection (`tests/stacks/retry_client.py`),
//! beside the same request sent while the first was still open and a
//! request of another size: the retry's record must name the attempt it
//! repeats (`retry_of`, with its client port) and give the TTFT its user
//! saw (`user_ttft_ns`: from the first attempt's arrival to the retry's
//! first token) against the client's own, from its first send to its read
//! of the retry's first token; the other two are no retries. The tracer binary
//! is `target/debug/ttft-trace` as built: `cargo build -p ttft-trace`
//! first after a change.

use std::{collections::HashMap, process::Command, time::Duration};

use anyhow::{Context as _, Result, ensure};
use serde::Deserialize;
use ttft_trace_tests::{
    demo::DemoServer,
    stacks::{CLIENT_READ_P99_MS, stacks_dir},
    tracer::root_test,
};

#[derive(Debug, Deserialize)]
struct Round {
    first_port: u16,
    concurrent_port: u16,
    other_port: u16,
    retry_port: u16,
    user_ttft_ns: u64,
}

const ROUNDS: usize = 6;

#[test]
fn a_retry_after_a_cut_names_its_first_attempt_and_the_users_ttft() -> Result<()> {
    let Some(_g) = root_test("a_retry_after_a_cut_names_its_first_attempt_and_the_users_ttft")
    else {
        return Ok(());
    };
    let (server, tracer) = DemoServer::traced()?;
    let out = Command::new("python3")
        .arg(stacks_dir().join("retry_client.py"))
        .args([server.port.to_string(), ROUNDS.to_string()])
        .output()
        .context("running retry_client.py")?;
    ensure!(out.status.success(), "retry_client.py: {out:?}");
    std::thread::sleep(Duration::from_millis(500));
    let trace = tracer.interrupt(Duration::from_secs(30))?;
    server.stop()?;
    ensure!(trace.success, "{}", trace.stderr);
    let rounds: Vec<Round> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("client line {l}")))
        .collect::<Result<_>>()?;
    ensure!(rounds.len() == ROUNDS, "{rounds:?}");
    let requests = trace.requests();
    let by_port: HashMap<u16, _> = requests.iter().map(|r| (r.client_port, r)).collect();
    let mut worst: f64 = 0.0;
    for round in &rounds {
        let first = by_port
            .get(&round.first_port)
            .context("first attempt traced")?;
        let retry = by_port.get(&round.retry_port).context("retry traced")?;
        ensure!(first.outcome == "closed_mid_response", "{first:?}");
        let of = retry.retry_of.as_ref().context("retry_of")?;
        ensure!(
            of.conn == first.conn
                && of.request_index == first.request_index
                && of.client_port == round.first_port,
            "{retry:?} names {of:?}, not {first:?}"
        );
        for port in [round.concurrent_port, round.other_port] {
            let r = by_port.get(&port).context("other request traced")?;
            ensure!(r.retry_of.is_none(), "no retry: {r:?}");
        }
        let traced = retry.user_ttft_ns.context("user_ttft_ns")?;
        // The client's span starts at its send, before the arrival, and
        // ends at its read, after the first token: it is the longer, by a
        // loopback hop each way and the client's time to read.
        let late_ms = (round.user_ttft_ns as f64 - traced as f64) / 1e6;
        eprintln!(
            "retry of {}:{}: user TTFT client {:.3} ms, traced {:.3} ms ({late_ms:+.3})",
            of.conn,
            of.request_index,
            round.user_ttft_ns as f64 / 1e6,
            traced as f64 / 1e6
        );
        ensure!(
            late_ms >= -0.5,
            "traced past the client's own: {late_ms} ms"
        );
        worst = worst.max(late_ms);
    }
    ensure!(
        worst <= CLIENT_READ_P99_MS,
        "a user TTFT {worst:.3} ms short of the client's (bound {CLIENT_READ_P99_MS} ms)"
    );
    let linked = requests.iter().filter(|r| r.retry_of.is_some()).count();
    ensure!(linked == ROUNDS, "{linked} retries linked, {ROUNDS} made");
    Ok(())
}
