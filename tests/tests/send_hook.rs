//! Root-only: the head and tail of each response send are read exactly by
//! both send hooks (the default raw tracepoints `tcp:tcp_sendmsg_locked` and
//! `tcp:tcp_rcv_space_adjust`, and the syscall tracepoints with the socket
//! lengths they replace), for every way a server writes: plain sends,
//! `sendmsg` and `writev` with several iovecs (empty ones, a chunk split
//! across iovecs, hyper's three buffers a chunk whose bytes are read across
//! them), one multi-megabyte send that the kernel copies in many
//! steps, and the same sent non-blocking (partial sends, retries after
//! `EAGAIN`), whose bytes must be counted once. The server
//! stamps its own sends on the tracer's clock (CLOCK_MONOTONIC). The socket
//! lengths that end each send and receive are read by both event hooks too
//! (the default raw tracepoints and the classic ones they replace).

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use ttft_trace_tests::{
    fixtures::{self, ChildGuard},
    tracer::{Tracer, root_test},
};

/// ttft-trace's switch for the send hook (`probes::SEND_HOOK_ENV`).
const SEND_HOOK_ENV: &str = "TTFT_TRACE_SEND_HOOK";
/// ttft-trace's switch for the event hook (`probes::EVENT_HOOK_ENV`).
const EVENT_HOOK_ENV: &str = "TTFT_TRACE_EVENT_HOOK";
const SHAPES: u64 = 6;
/// The shape written as hyper writes an OpenAI stream (`send_shapes.py`).
const HYPER_SHAPE: usize = 4;
/// The server's delay between headers and body in shapes 0-2.
const BODY_DELAY_NS: u64 = 40_000_000;
/// How far past the server's stamp after a send call the traced time of the
/// send may be (the stamps are taken in Python around the call).
const STAMP_SLACK_NS: u64 = 1_000_000;

/// What one run saw: the tracer's request lines and the server's stamps,
/// both by request index.
struct Run {
    requests: Vec<Value>,
    stamps: Vec<Value>,
    stderr: String,
}

fn run(hook: &str, event_hook: &str) -> Result<Run> {
    let mut child = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/send_shapes.py"
        ))
        .arg(fixtures::existing_fixture(fixtures::STUB_CUDART)?)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting send_shapes.py")?;
    let pid = child.id();
    let mut out = BufReader::new(child.stdout.take().context("server stdout")?);
    let _server = ChildGuard::new(child);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let port: u16 = line.trim().parse().context("server port")?;

    // SAFETY: this file's only test sets the variable before spawning the
    // tracer and no other thread of this binary reads the environment.
    unsafe {
        std::env::set_var(SEND_HOOK_ENV, hook);
        std::env::set_var(EVENT_HOOK_ENV, event_hook);
    }
    // `--sched exact`: the event hook's log line then names the hook the
    // socket lengths and the switch program share (the sampled default
    // attaches no switch program); the default path's sends are the
    // requests and stacks tests'.
    let tracer = Tracer::start(
        &[
            "--pid".into(),
            pid.to_string(),
            "--interval".into(),
            "60".into(),
            "--sched".into(),
            "exact".into(),
        ],
        0,
    );
    // SAFETY: as above.
    unsafe {
        std::env::remove_var(SEND_HOOK_ENV);
        std::env::remove_var(EVENT_HOOK_ENV);
    }
    let mut tracer = tracer?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;

    let mut client = TcpStream::connect(("127.0.0.1", port))?;
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    client.set_nodelay(true)?;
    let mut stamps = Vec::new();
    for shape in 0..SHAPES {
        // One write: a request in pieces would be several receives.
        client.write_all(format!("GET /{shape} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes())?;
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        while !got.ends_with(b"0\r\n\r\n") {
            let n = client.read(&mut buf)?;
            if n == 0 {
                bail!("server closed during shape {shape}");
            }
            got.extend_from_slice(&buf[..n]);
        }
        line.clear();
        out.read_line(&mut line)?;
        stamps.push(serde_json::from_str(&line)?);
    }
    drop(client);
    // Let the close reach the tracer, then stop it.
    std::thread::sleep(Duration::from_millis(300));
    let trace = tracer.interrupt(Duration::from_secs(30))?;
    assert!(trace.success, "{}", trace.stderr);
    let mut requests: Vec<Value> = trace
        .lines
        .into_iter()
        .filter(|l| l["type"] == "request")
        .collect();
    requests.sort_by_key(|r| r["request_index"].as_u64());
    Ok(Run {
        requests,
        stamps,
        stderr: trace.stderr,
    })
}

fn ns(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} missing in {v}"))
}

fn check(hook: &str, run: &Run) {
    let expected = if hook == "syscalls" {
        "send hook: syscall tracepoints"
    } else {
        "send hook: raw tracepoints tcp:tcp_sendmsg_locked and tcp:tcp_rcv_space_adjust"
    };
    assert!(run.stderr.contains(expected), "{hook}: {}", run.stderr);
    assert_eq!(
        run.requests.len() as u64,
        SHAPES,
        "{hook}: {:#?}",
        run.requests
    );
    for (i, (r, stamp)) in run.requests.iter().zip(&run.stamps).enumerate() {
        let what = format!("{hook}, shape {i}: {r}");
        assert_eq!(r["outcome"], "ok", "{what}");
        assert_eq!(r["http_status"], 200, "{what}");
        assert_eq!(r["framing"], "http1", "{what}");
        let first_byte = ns(r, "t_first_byte_ns");
        let first_token = ns(r, "t_first_token_ns");
        let within = |t: u64, call: &Value| {
            let (before, after) = (call[0].as_u64(), call[1].as_u64());
            before.is_some_and(|b| t >= b) && after.is_some_and(|a| t < a + STAMP_SLACK_NS)
        };
        assert!(
            within(first_byte, &stamp["first"]),
            "{what}: first byte {first_byte} not in the server's first send {}",
            stamp["first"]
        );
        assert!(
            within(first_token, &stamp["body"]),
            "{what}: first token {first_token} not in the server's first body send {}",
            stamp["body"]
        );
        if i == HYPER_SHAPE {
            // Read across the buffers of each writev: the stream's
            // protocol, its last finish reason and its `[DONE]`.
            let end = &r["stalls"];
            assert_eq!(end["finish_reason"], "length", "{what}");
            assert!(end["truncated"].is_null(), "{what}");
        }
        if i < 3 || i == HYPER_SHAPE {
            assert!(
                first_token - first_byte >= BODY_DELAY_NS,
                "{what}: headers taken for the first token"
            );
        }
    }
}

#[test]
fn both_send_hooks_read_every_send_shape_exactly() -> Result<()> {
    let Some(_guard) = root_test("both_send_hooks_read_every_send_shape_exactly") else {
        return Ok(());
    };
    let default = run("tcp", "btf")?;
    check("tcp", &default);
    assert!(
        default.stderr.contains("event hook: BTF tracepoints"),
        "{}",
        default.stderr
    );
    let fallback = run("syscalls", "btf")?;
    check("syscalls", &fallback);
    let classic = run("tcp", "tracepoints")?;
    check("classic event tracepoints", &classic);
    assert!(
        classic.stderr.contains("event hook: classic tracepoints"),
        "{}",
        classic.stderr
    );
    // The last shape's partial sends were written by the server in several
    // calls: the syscall hook sees each as a send (a chunk each), the TCP
    // hook the bytes once, where the first call started.
    let partial = (SHAPES - 1) as usize;
    let calls = default.stamps[partial]["partial_sends"].as_u64();
    assert!(
        calls > Some(1),
        "shape {partial} sent in one call: {calls:?}"
    );
    for (hook, other) in [("syscalls", &fallback), ("tcp", &classic)] {
        for (i, (a, b)) in default.requests.iter().zip(&other.requests).enumerate() {
            for field in ["chunks", "bytes_out", "bytes_in"] {
                if field == "chunks" && i == partial && hook == "syscalls" {
                    continue;
                }
                assert_eq!(a[field], b[field], "shape {i}, {field}: {a} vs {b}");
            }
        }
    }
    Ok(())
}
