//! Root-only: listening ports are followed in the traced server's own
//! network namespace. Another namespace's server on the same port number
//! (another container's) is not followed: its connections send the daemon
//! nothing. A `--port` of the user's is followed in every namespace, which
//! shows the same traffic does reach the daemon when the port is followed.

use std::{process::Command, time::Duration};

use anyhow::{Context as _, Result, ensure};
use ttft_trace_tests::{
    demo::{DemoServer, loadgen},
    tracer::{Tracer, root_test},
};

/// Requests the other namespace's client sends on one keep-alive
/// connection: each is a data segment the daemon would get if the
/// connection were followed (the first 16 of an unowned connection are
/// held, the rest counted as `unrouted_events`).
const OTHER_REQUESTS: usize = 60;

/// A server and a client in a new network namespace (`unshare --net`), the
/// server on `port`: one connection, `OTHER_REQUESTS` request/response
/// round trips. Neither process maps CUDA: neither is traced.
fn other_namespace_traffic(port: u16) -> Result<()> {
    let script = format!(
        r#"
import socket, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", {port})); srv.listen(1)
def serve():
    c, _ = srv.accept()
    while True:
        data = c.recv(4096)
        if not data:
            break
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
threading.Thread(target=serve, daemon=True).start()
cl = socket.create_connection(("127.0.0.1", {port}))
for i in range({OTHER_REQUESTS}):
    cl.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    got = b""
    while not got.endswith(b"ok"):
        got += cl.recv(4096)
cl.close()
"#
    );
    let status = Command::new("unshare")
        .args(["--net", "sh", "-c"])
        .arg(format!("ip link set lo up && exec python3 -c '{script}'"))
        .status()
        .context("unshare")?;
    ensure!(status.success(), "the other namespace's traffic: {status}");
    Ok(())
}

/// One daemon run: the traced demo server on `port` in this namespace, 8
/// requests to it, the other namespace's traffic on the same port; returns
/// (requests traced, unrouted events).
fn run(extra: &[&str]) -> Result<(usize, u64)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let port_s = port.to_string();
    let mut args = vec!["--no-nvml", "--rescan-ms", "200", "--only-port", &port_s];
    args.extend_from_slice(extra);
    let args: Vec<String> = args.iter().map(|s| s.replace("PORT", &port_s)).collect();
    let mut tracer = Tracer::start_daemon(&args)?;
    let server = DemoServer::start(&["--output-tokens", "4", "--port", &port_s])?;
    tracer.wait_for_stderr("tracing workload pid", 1, Duration::from_secs(30))?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    let clients = loadgen(
        port,
        &[
            "--concurrency",
            "1",
            "--requests",
            "8",
            "--output-tokens",
            "4",
        ],
    )?;
    other_namespace_traffic(port)?;
    std::thread::sleep(Duration::from_millis(300));
    server.stop()?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    ensure!(out.success, "{}", out.stderr);
    let traced = out.lines.iter().filter(|l| l["type"] == "request").count();
    ensure!(
        traced == clients.len(),
        "{traced} of {} traced",
        clients.len()
    );
    let unrouted = out.totals().map(|t| t.unrouted_events).context("totals")?;
    Ok((traced, unrouted))
}

#[test]
fn another_namespaces_server_on_the_same_port_is_not_followed() -> Result<()> {
    let Some(_g) = root_test("another_namespaces_server_on_the_same_port_is_not_followed") else {
        return Ok(());
    };
    let (traced, unrouted) = run(&[])?;
    eprintln!(
        "port found in the server's namespace: {traced} requests traced, {unrouted} unrouted events"
    );
    ensure!(
        unrouted == 0,
        "the other namespace's connection was followed"
    );
    // The same with the port given by the user, followed in every
    // namespace: the other namespace's requests reach the daemon.
    let (traced, unrouted) = run(&["--port", "PORT"])?;
    eprintln!("--port (every namespace): {traced} requests traced, {unrouted} unrouted events");
    ensure!(
        unrouted >= (OTHER_REQUESTS - 16) as u64,
        "with --port the other namespace's requests are followed: {unrouted} unrouted"
    );
    Ok(())
}
