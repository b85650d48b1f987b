//! Root-only: a stall after the first token, injected for real into the demo
//! server. A long prompt (10000 tokens: 400 ms of prefill on the emulated
//! GPU at the demo's 40 µs a token) arrives while another request streams;
//! the demo's engine runs a new request's prefill in the same step as the
//! running ones' decode (continuous batching), so the stream stands still for
//! the prefill. The traced stall must be `prefill_interference` naming the
//! long request by its connection and index, explaining most of the stall;
//! the long request itself has no stall. Prints both requests' stalls.

use std::{
    io::{Read, Write},
    net::TcpStream,
    thread,
    time::Duration,
};

use anyhow::Result;
use ttft_trace_tests::{
    demo::DemoServer,
    tracer::{Tracer, root_test},
};

/// One streamed completion of `max_tokens` for a prompt of `prompt_tokens`;
/// returns the whole response.
fn complete(port: u16, prompt_tokens: u32, max_tokens: u32) -> Result<String> {
    let body = format!(
        r#"{{"model":"ttft-demo","prompt":"x","max_tokens":{max_tokens},"stream":true,"demo_prompt_tokens":{prompt_tokens}}}"#
    );
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

#[test]
fn a_long_prefill_is_named_in_the_stream_it_stalls() -> Result<()> {
    let Some(_g) = root_test("a_long_prefill_is_named_in_the_stream_it_stalls") else {
        return Ok(());
    };
    let server = DemoServer::start(&[])?;
    let args = vec![
        "--pid".to_string(),
        server.pid.to_string(),
        "--interval".into(),
        "60".into(),
    ];
    let mut tracer = Tracer::start(&args, 0)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
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
