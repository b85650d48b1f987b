//! Root-only: a stream's degradation (issue 31, item 3) injected for real
//! into the demo server and scored against that truth. Each kind in many
//! streams, a clean stream after each injected one:
//!
//! - `midstream_coalesce`: from output token 16 on, four tokens a send:
//!   `chunks_growing`, and not truncated;
//! - `midstream_cut`: the server closes right after token 16: truncated
//!   `cut`;
//! - `no_terminator`: the stream ends without `data: [DONE]`: truncated
//!   `missing_terminator`;
//! - `no_finish_reason`: the last token's `finish_reason` is null:
//!   truncated `no_finish_reason`.
//!
//! Recall at least 95 % per kind; on clean streams no flag at all, and
//! their finish reason (`length`) read. Prints the table. The tracer
//! binary is `target/debug/ttft-trace` as built: `cargo build -p
//! ttft-trace` first after a change.

use std::{
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};

use anyhow::Result;
use ttft_trace::jsonl_schema::Request;
use ttft_trace_tests::{
    demo::{DemoServer, streamed_completion},
    fixtures::monotonic_ns,
    tracer::root_test,
};

/// Output tokens of each stream (5 ms a step: a quarter of a second).
const OUT_TOKENS: u32 = 48;
/// Injected streams per kind; a clean stream follows every other round of
/// the four kinds.
const STREAMS: usize = 20;
const KINDS: [&str; 4] = [
    "midstream_coalesce",
    "midstream_cut",
    "no_terminator",
    "no_finish_reason",
];

/// One stream as its client saw it.
struct Stream {
    fault: Option<&'static str>,
    client_port: u16,
    /// CLOCK_MONOTONIC before its connect and after it read to the end.
    span: (u64, u64),
    /// Whether the body read held `data: [DONE]`.
    done: bool,
}

/// One streamed completion on its own connection, read to the server's
/// close.
fn stream(port: u16, fault: Option<&'static str>) -> Result<Stream> {
    let t_connect = monotonic_ns();
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    let client_port = s.local_addr()?.port();
    s.write_all(streamed_completion(16, OUT_TOKENS, fault).as_bytes())?;
    let mut text = Vec::new();
    // A cut stream ends at the server's close: what was read is kept.
    let _ = s.read_to_end(&mut text);
    let done = String::from_utf8_lossy(&text).contains("data: [DONE]");
    Ok(Stream {
        fault,
        client_port,
        span: (t_connect, monotonic_ns()),
        done,
    })
}

/// The traced request of `st`: the one from its port within its span.
fn traced<'a>(st: &Stream, requests: &'a [Request]) -> &'a Request {
    let found: Vec<&Request> = requests
        .iter()
        .filter(|r| {
            r.client_port == st.client_port && (st.span.0..=st.span.1).contains(&r.t_arrive_ns)
        })
        .collect();
    assert_eq!(found.len(), 1, "port {}: {found:#?}", st.client_port);
    found[0]
}

/// Whether `r` carries the flag `fault` injects.
fn flagged(fault: &str, r: &Request) -> bool {
    let s = &r.stalls;
    match fault {
        "midstream_coalesce" => s.chunks_growing && s.truncated.is_none(),
        "midstream_cut" => s.truncated.as_deref() == Some("cut"),
        "no_terminator" => s.truncated.as_deref() == Some("missing_terminator"),
        "no_finish_reason" => s.truncated.as_deref() == Some("no_finish_reason"),
        _ => unreachable!("{fault}"),
    }
}

#[test]
fn each_kind_of_degradation_injected_is_flagged() -> Result<()> {
    let Some(_g) = root_test("each_kind_of_degradation_injected_is_flagged") else {
        return Ok(());
    };
    let (server, tracer) = DemoServer::traced()?;
    let mut streams = Vec::new();
    for i in 0..STREAMS {
        for kind in KINDS {
            streams.push(stream(server.port, Some(kind))?);
            if i % 2 == 0 {
                streams.push(stream(server.port, None)?);
            }
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let out = tracer.interrupt(Duration::from_secs(30))?;
    server.stop()?;
    assert!(out.success, "{}", out.stderr);
    let requests = out.requests();

    eprintln!("| injected | streams | flagged | recall |");
    eprintln!("| --- | --- | --- | --- |");
    for kind in KINDS {
        let of_kind: Vec<&Stream> = streams.iter().filter(|s| s.fault == Some(kind)).collect();
        let hits = of_kind
            .iter()
            .filter(|st| flagged(kind, traced(st, &requests)))
            .count();
        eprintln!(
            "| {kind} | {} | {hits} | {:.1} % |",
            of_kind.len(),
            100.0 * hits as f64 / of_kind.len() as f64
        );
        assert!(
            hits * 100 >= of_kind.len() * 95,
            "{kind}: {hits} of {}",
            of_kind.len()
        );
    }
    // The truth of the injections, as the client read them.
    for st in &streams {
        let without_done = matches!(st.fault, Some("midstream_cut" | "no_terminator"));
        assert_eq!(
            st.done, !without_done,
            "port {}: {:?}",
            st.client_port, st.fault
        );
    }
    let clean: Vec<&Stream> = streams.iter().filter(|s| s.fault.is_none()).collect();
    let mut false_flags = 0;
    for st in &clean {
        let r = traced(st, &requests);
        let s = &r.stalls;
        if s.chunks_growing || s.truncated.is_some() {
            eprintln!("clean stream flagged: {r:?}");
            false_flags += 1;
        }
        assert_eq!(s.finish_reason.as_deref(), Some("length"), "{r:?}");
    }
    eprintln!(
        "| clean | {} | {false_flags} | false positives {:.1} % |",
        clean.len(),
        100.0 * false_flags as f64 / clean.len() as f64
    );
    assert!(
        false_flags * 100 <= clean.len() * 2,
        "{false_flags} of {}",
        clean.len()
    );
    Ok(())
}
