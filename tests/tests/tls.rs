//! Root-only: a server that terminates TLS itself (the demo with
//! `--tls-cert`: CPython's `ssl`, OpenSSL on the connection's socket) under
//! the tracer. Its connections carry TLS records, never HTTP: every request
//! on them is reported `tls_unsupported`, none is read as a response whose
//! first record would be a first token (before, each was `ok` with the
//! handshake flight as its "first token"). The tracer binary is
//! `target/debug/ttft-trace` as built: `cargo build -p ttft-trace` first
//! after a change.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result, ensure};
use ttft_trace_tests::{
    demo::DemoServer,
    fixtures::temp_path,
    tracer::{Tracer, root_test},
};

/// A self-signed certificate and its key, made by the `openssl` command.
fn certificate() -> Result<(String, String)> {
    let (cert, key) = (temp_path("tls-cert", "pem"), temp_path("tls-key", "pem"));
    let out = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .context("running openssl")?;
    ensure!(out.status.success(), "openssl: {out:?}");
    let s = |p: &Path| p.to_string_lossy().into_owned();
    Ok((s(&cert), s(&key)))
}

/// `urls` streamed completions, one connection (curl reuses it).
fn completions(port: u16, urls: usize) -> Result<String> {
    let url = format!("https://127.0.0.1:{port}/v1/completions");
    let mut c = Command::new("curl");
    c.args(["-sSk", "-N", "--fail-with-body"]);
    for i in 0..urls {
        if i > 0 {
            c.arg("--next").args(["-sSk", "-N"]);
        }
        c.args([
            "-d",
            r#"{"model":"m","prompt":"x","max_tokens":8,"stream":true}"#,
        ])
        .arg(&url);
    }
    let out = c.output().context("running curl")?;
    ensure!(out.status.success(), "curl: {out:?}");
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn requests_on_a_tls_connection_are_named_and_never_read_as_http() -> Result<()> {
    let Some(_g) = root_test("requests_on_a_tls_connection_are_named_and_never_read_as_http")
    else {
        return Ok(());
    };
    let (cert, key) = certificate()?;
    let server = DemoServer::start(&["--tls-cert", &cert, "--tls-key", &key])?;
    let args = vec!["--pid".to_string(), server.pid.to_string()];
    let mut tracer = Tracer::start(&args, 0)?;
    tracer.wait_for_stderr(
        "following requests on port",
        1,
        std::time::Duration::from_secs(30),
    )?;
    let mut sent = 0;
    for urls in [1, 1, 1, 3] {
        let body = completions(server.port, urls)?;
        assert_eq!(body.matches("data: [DONE]").count(), urls, "{body}");
        sent += urls;
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let out = tracer.interrupt(std::time::Duration::from_secs(30))?;
    server.stop()?;
    assert!(out.success, "{}", out.stderr);
    let requests = out.requests();
    eprintln!(
        "{sent} requests sent over TLS; traced: {:?}",
        requests.iter().map(|r| &r.outcome).collect::<Vec<_>>()
    );
    // One record per exchange the tracer can tell apart (the handshake's
    // and each request's): never fewer than the connections.
    assert!(requests.len() >= 4, "{requests:#?}");
    for r in &requests {
        assert_eq!(r.outcome, "tls_unsupported", "{r:?}");
        assert_eq!(r.ttft_ns, None, "no first token read from records: {r:?}");
    }
    Ok(())
}
