//! Root-only: a stall after the first token, injected for real into the demo
//! server. A long prompt (10000 tokens: 400 ms of prefill on the emulated
//! GPU at the demo's 40 µs a token) arrives while another request streams;
//! the demo's engine runs a new request's prefill in the same step as the
//! running ones' decode (continuous batching), so the stream stands still for
//! the prefill. The traced stall must be `prefill_interference` naming the
//! long request by its connection and index, explaining most of the stall;
//! the long request itself has no stall. Prints both requests' stalls.
//!
//! Then the recall matrix (issue 31, item 5): each kind injected mid-stream
//! into many streams, a third left clean; loss mid-stream is found between
//! the chunks' ACKs (`seen_at: "delivery"`), the sends being on time. The
//! tracer binary is `target/debug/ttft-trace` as built: `cargo build -p
//! ttft-trace` first after a change.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Read, Write},
    net::TcpStream,
    thread,
    time::Duration,
};

use anyhow::Result;
use ttft_trace::jsonl_schema::{Request, StallWindow};
use ttft_trace_tests::{
    demo::{DemoServer, streamed_completion},
    faults::PacketLoss,
    fixtures::monotonic_ns,
    tracer::root_test,
};

/// One streamed completion of `max_tokens` for a prompt of `prompt_tokens`;
/// returns the whole response.
fn complete(port: u16, prompt_tokens: u32, max_tokens: u32) -> Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.write_all(streamed_completion(prompt_tokens, max_tokens, None).as_bytes())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

#[test]
fn a_long_prefill_is_named_in_the_stream_it_stalls() -> Result<()> {
    let Some(_g) = root_test("a_long_prefill_is_named_in_the_stream_it_stalls") else {
        return Ok(());
    };
    let (server, tracer) = DemoServer::traced()?;
    let port = server.port;
    // 256 tokens at ~5 ms a step: streaming for over a second.
    let streamed = thread::spawn(move || complete(port, 16, 256));
    thread::sleep(Duration::from_millis(400));
    let long = complete(port, 10_000, 2)?;
    let streamed = streamed.join().expect("the streamed request")?;
    assert!(streamed.contains("[DONE]"), "{streamed}");
    assert!(long.contains("[DONE]"), "{long}");
    thread::sleep(Duration::from_millis(500));
    let out = tracer.interrupt(Duration::from_secs(30))?;
    server.stop()?;
    assert!(out.success, "{}", out.stderr);
    let requests = out.requests();
    assert_eq!(requests.len(), 2, "{requests:#?}");
    let (stalled, long) = match &requests[..] {
        [a, b] if a.chunks > b.chunks => (a, b),
        [a, b] => (b, a),
        _ => unreachable!(),
    };
    eprintln!("streamed: {:?}", stalled.stalls);
    eprintln!("long prompt: {:?}", long.stalls);
    assert_eq!(long.stalls.count, 0, "the long request streamed on");
    let stalls = &stalled.stalls;
    assert_eq!(stalls.count, 1, "one stall: {stalls:?}");
    let w = &stalls.windows[0];
    assert!(w.duration_ns >= 300_000_000, "the prefill's length: {w:?}");
    let cause = &w.causes[0];
    assert_eq!(cause.class, "prefill_interference", "{w:?}");
    assert!(
        cause.explained_ns * 2 >= w.duration_ns && cause.explained_ns <= w.duration_ns,
        "most of the stall: {w:?}"
    );
    let named = w
        .interfering_request
        .as_ref()
        .expect("the interfering request");
    assert_eq!(
        (named.conn.as_str(), named.request_index),
        (long.conn.as_str(), long.request_index)
    );
    Ok(())
}

// ---- Recall matrix (issue 31, item 5): each kind of stall injected
// mid-stream at a known time, many streams, scored against that truth.

/// Output tokens of each stream, and the token whose gap the injection
/// holds. A stream must outlast the long prompt's tokenizing: with 64
/// tokens most streams ended before its prefill began (1 of 24 recalled).
const OUT_TOKENS: u32 = 120;
const AT: usize = 16;
/// Streams per kind: two injected for one clean, interleaved, one at a time.
const STREAMS: usize = 36;

/// How a stream is injected.
#[derive(Clone, Copy)]
enum Inject {
    /// A demo fault switch (`X-Demo-Fault`) acting on the gap before token [`AT`].
    Fault(&'static str),
    /// A 10000-token prompt (a 400 ms prefill) sent once token [`AT`] is read.
    Prefill,
    /// Every packet from the server dropped for 300 ms once token [`AT`] is read.
    Loss,
}

/// One stream as its client saw it.
struct Stream {
    client_port: u16,
    /// CLOCK_MONOTONIC before it connected and after it read its end: its
    /// request arrived in between (ports are reused, times tell them apart).
    span: (u64, u64),
    /// When the injection held it, on CLOCK_MONOTONIC; `None`: clean.
    injected: Option<(u64, u64)>,
}

/// One streamed completion on a connection of its own, with `fault` asked
/// for; `hook(n)` runs after the n-th token's chunk is read (1-based).
/// Returns the client's port, when each token's chunk was read, and the
/// stream's span (before the connect, after the end).
fn stream(
    port: u16,
    prompt_tokens: u32,
    max_tokens: u32,
    fault: Option<&str>,
    mut hook: impl FnMut(usize) -> Result<()>,
) -> Result<(u16, Vec<u64>, (u64, u64))> {
    let t_connect = monotonic_ns();
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    let client_port = s.local_addr()?.port();
    s.write_all(streamed_completion(prompt_tokens, max_tokens, fault).as_bytes())?;
    let mut times = Vec::new();
    let mut done = false;
    for line in BufReader::new(s).lines() {
        let line = line?;
        if line.starts_with("data: {") {
            times.push(monotonic_ns());
            hook(times.len())?;
        }
        done |= line.starts_with("data: [DONE]");
    }
    anyhow::ensure!(done, "stream on port {client_port} ended early");
    Ok((client_port, times, (t_connect, monotonic_ns())))
}

/// Runs `STREAMS` streams one at a time under the tracer, two of three
/// injected with `inject`; returns them and the traced request lines.
fn run_kind(inject: Inject) -> Result<(Vec<Stream>, Vec<Request>)> {
    let (server, tracer) = DemoServer::traced()?;
    let port = server.port;
    let mut streams = Vec::new();
    for i in 0..STREAMS {
        if i % 3 == 2 {
            let (client_port, _, span) = stream(port, 16, OUT_TOKENS, None, |_| Ok(()))?;
            streams.push(Stream {
                client_port,
                span,
                injected: None,
            });
            continue;
        }
        match inject {
            Inject::Fault(fault) => {
                let (client_port, t, span) = stream(port, 16, OUT_TOKENS, Some(fault), |_| Ok(()))?;
                // Token AT (0-based) waited: the gap between its read and the one before.
                streams.push(Stream {
                    client_port,
                    span,
                    injected: Some((t[AT - 1], t[AT])),
                });
            }
            Inject::Prefill => {
                let mut long = None;
                let (client_port, _, span) = stream(port, 16, OUT_TOKENS, None, |n| {
                    if n == AT + 1 {
                        let from = monotonic_ns();
                        long = Some((
                            from,
                            thread::spawn(move || stream(port, 10_000, 2, None, |_| Ok(()))),
                        ));
                    }
                    Ok(())
                })?;
                let (from, long) = long.expect("the long prompt was sent");
                let (long_port, t, long_span) = long.join().expect("the long prompt")?;
                let to = *t.last().expect("its tokens");
                streams.push(Stream {
                    client_port,
                    span,
                    injected: Some((from, to)),
                });
                // The long request itself is not injected: a clean stream.
                streams.push(Stream {
                    client_port: long_port,
                    span: long_span,
                    injected: None,
                });
            }
            Inject::Loss => {
                let mut window = None;
                let (client_port, _, span) = stream(port, 16, OUT_TOKENS, None, |n| {
                    if n == AT + 1 {
                        let loss = PacketLoss::from_server_after_handshake(port, 99)?;
                        let from = monotonic_ns();
                        thread::sleep(Duration::from_millis(300));
                        let to = monotonic_ns();
                        loss.stop()?;
                        window = Some((from, to));
                    }
                    Ok(())
                })?;
                streams.push(Stream {
                    client_port,
                    span,
                    injected: window,
                });
            }
        }
    }
    thread::sleep(Duration::from_millis(500));
    let out = tracer.interrupt(Duration::from_secs(30))?;
    server.stop()?;
    assert!(out.success, "{}", out.stderr);
    Ok((streams, out.requests()))
}

/// One kind's score.
#[derive(Default)]
struct Score {
    injected: usize,
    recalled: usize,
    clean: usize,
    /// Clean streams with a stall named a cause.
    false_positives: usize,
    /// Clean streams with any stall (unexplained ones too).
    clean_with_stall: usize,
    /// What the stalls over the injections were named (`no stall` when
    /// none overlapped; `unexplained`).
    named: BTreeMap<String, usize>,
    /// Injected streams whose connection retransmitted.
    with_retransmits: usize,
    /// Where the stalls over the injections were seen (`send`, `delivery`).
    seen_at: BTreeMap<String, usize>,
}

fn score(kind: &str, streams: &[Stream], requests: &[Request]) -> Score {
    let mut s = Score::default();
    for st in streams {
        let (t_connect, t_end) = st.span;
        let traced: Vec<&Request> = requests
            .iter()
            .filter(|r| {
                r.client_port == st.client_port
                    && r.t_arrive_ns >= t_connect
                    && r.t_arrive_ns <= t_end
            })
            .collect();
        assert_eq!(traced.len(), 1, "{kind}: port {}", st.client_port);
        let r = traced[0];
        let Some((from, to)) = st.injected else {
            s.clean += 1;
            if r.stalls.count > 0 {
                s.clean_with_stall += 1;
                eprintln!("{kind}: clean stream {} stalled: {:?}", r.conn, r.stalls);
            }
            let named: Vec<&str> = r
                .stalls
                .windows
                .iter()
                .flat_map(|w| w.causes.iter().map(|c| c.class.as_str()))
                .collect();
            if !named.is_empty() {
                s.false_positives += 1;
                eprintln!(
                    "{kind}: clean stream {} named {named:?}: {:?}",
                    r.conn, r.stalls
                );
            }
            continue;
        };
        s.injected += 1;
        s.with_retransmits += usize::from(r.tcp_retransmits > 0);
        let over: Vec<&StallWindow> = r
            .stalls
            .windows
            .iter()
            .filter(|w| w.t_start_ns < to && w.t_end_ns > from)
            .collect();
        if over.is_empty() {
            *s.named.entry("no stall".into()).or_default() += 1;
        }
        for w in &over {
            if w.causes.is_empty() {
                *s.named.entry("unexplained".into()).or_default() += 1;
            }
            for c in &w.causes {
                *s.named.entry(c.class.clone()).or_default() += 1;
            }
        }
        for w in &over {
            *s.seen_at.entry(w.seen_at.clone()).or_default() += 1;
        }
        let hit = over
            .iter()
            .any(|w| w.causes.iter().any(|c| c.class == kind));
        s.recalled += usize::from(hit);
        if !hit {
            eprintln!(
                "{kind}: injected stream {} over [{from}, {to}] missed: {:?}",
                r.conn, r.stalls
            );
        }
    }
    s
}

/// The kinds to run: all, or those `TTFT_STALLS_KINDS` lists (comma-separated).
fn selected(kind: &str) -> bool {
    std::env::var("TTFT_STALLS_KINDS")
        .map(|v| v.split(',').any(|k| k.trim() == kind))
        .unwrap_or(true)
}

/// Recall ≥ 95 % per kind (the goal of issue 31): the stall over the injection is named the
/// kind. For `network` that stall is seen at the delivery (the chunks are sent on time and
/// ACKed late), and the loss must reach the request's connection (retransmits on every
/// injected stream). False positives ≤ 2 % over the clean streams of all kinds: a stall
/// named a cause, and any stall at all, each counted.
#[test]
fn each_kind_of_stall_injected_mid_stream_is_recalled() -> Result<()> {
    let Some(_g) = root_test("each_kind_of_stall_injected_mid_stream_is_recalled") else {
        return Ok(());
    };
    let kinds = [
        ("prefill_interference", Inject::Prefill),
        ("gpu_memory", Inject::Fault("midstream_copy")),
        ("cpu", Inject::Fault("midstream_cpu")),
        ("network", Inject::Loss),
    ];
    let mut scores = Vec::new();
    for (kind, inject) in kinds {
        if !selected(kind) {
            continue;
        }
        let (streams, requests) = run_kind(inject)?;
        scores.push((kind, score(kind, &streams, &requests)));
    }
    eprintln!(
        "| kind | injected | recalled | clean | false positives (named) | clean with any stall | over the injections | seen at |"
    );
    eprintln!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (kind, s) in &scores {
        eprintln!(
            "| {kind} | {} | {} ({:.0} %) | {} | {} | {} | {:?} | {:?} |",
            s.injected,
            s.recalled,
            100.0 * s.recalled as f64 / s.injected.max(1) as f64,
            s.clean,
            s.false_positives,
            s.clean_with_stall,
            s.named,
            s.seen_at
        );
    }
    let (clean, fp, stalled) = scores.iter().fold((0, 0, 0), |(c, f, a), (_, s)| {
        (c + s.clean, f + s.false_positives, a + s.clean_with_stall)
    });
    eprintln!(
        "clean streams: {fp} of {clean} with a stall named a cause, {stalled} with any stall"
    );
    // Every bound checked, all that failed said at once.
    let mut failed = Vec::new();
    for (kind, s) in &scores {
        if s.injected == 0 {
            failed.push(format!("{kind}: nothing injected"));
            continue;
        }
        if *kind == "network" && s.with_retransmits != s.injected {
            failed.push(format!(
                "network: the loss reached {} of {} injected streams' connections",
                s.with_retransmits, s.injected
            ));
        }
        let recall = s.recalled as f64 / s.injected as f64;
        if recall < 0.95 {
            failed.push(format!("{kind}: recall {recall:.3} < 0.95"));
        }
    }
    if fp as f64 > 0.02 * clean as f64 {
        failed.push(format!(
            "false positives {fp} of {clean} clean streams > 2 %"
        ));
    }
    if stalled as f64 > 0.02 * clean as f64 {
        failed.push(format!(
            "clean streams with a stall: {stalled} of {clean} > 2 %"
        ));
    }
    assert!(failed.is_empty(), "{}", failed.join("; "));
    Ok(())
}
