//! Root-only: a full eBPF map is counted and warned about, never the end
//! of the daemon. `LISTEN_NETNS`, `TRACKED` and `CONNS` are made small
//! through the settings file and overfilled. (`LISTEN_PORTS` is an array
//! with room for every port: it cannot fill.)

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use ttft_trace_tests::{
    demo::{DemoServer, loadgen},
    fixtures::{Style, Variant, Workload, temp_path},
    tracer::{Tracer, http_get, root_test},
};

/// The daemon with the settings file `settings`, `extra` arguments and
/// its metrics on a free port, scanning every 200 ms: (the tracer, its
/// metrics address, the settings file to remove).
fn daemon_with(settings: &str, extra: &[&str]) -> Result<(Tracer, SocketAddr, PathBuf)> {
    let config = temp_path("maps-full-config", "toml");
    std::fs::write(&config, settings)?;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut args: Vec<String> = vec![
        "--listen".into(),
        addr.to_string(),
        "--config".into(),
        config.display().to_string(),
        "--rescan-ms".into(),
        "200".into(),
        "--no-nvml".into(),
        "--interval".into(),
        "60".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Ok((Tracer::start_daemon(&args)?, addr, config))
}

/// The value of the `ttft_trace_map_full_total` series of `map`.
fn map_full(metrics: &str, map: &str) -> f64 {
    let series = format!("ttft_trace_map_full_total{{map=\"{map}\"}}");
    metrics
        .lines()
        .find(|l| l.starts_with(&series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// `LISTEN_NETNS` sized to one entry (`[kernel_maps] listen_netns = 1`)
/// with two demo servers traced by the daemon: one server's port is held,
/// the other's is refused (a warning, and
/// `ttft_trace_map_full_total{map="LISTEN_NETNS"}` counts every refusal:
/// each scan tries again) and never said to be followed. The daemon goes on
/// and follows every request of the server it holds, and none of the other.
#[test]
fn a_full_listen_netns_map_is_counted_not_fatal() -> Result<()> {
    let Some(_g) = root_test("a_full_listen_netns_map_is_counted_not_fatal") else {
        return Ok(());
    };
    let (mut tracer, addr, config) = daemon_with("[kernel_maps]\nlisten_netns = 1\n", &[])?;
    let servers = [
        DemoServer::start(&["--output-tokens", "4"])?,
        DemoServer::start(&["--output-tokens", "4"])?,
    ];
    tracer.wait_for_stderr("eBPF map LISTEN_NETNS is full", 1, Duration::from_secs(30))?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    // Refused again at each 200 ms scan.
    std::thread::sleep(Duration::from_secs(1));
    let refused = map_full(&http_get(addr, "/metrics")?, "LISTEN_NETNS");
    eprintln!("ttft_trace_map_full_total{{map=\"LISTEN_NETNS\"}} {refused}");
    assert!(refused >= 2.0, "refusals counted: {refused}");
    let mut sent = Vec::new();
    for server in &servers {
        let clients = loadgen(server.port, &["--requests", "4", "--output-tokens", "4"])?;
        assert!(clients.iter().all(|c| c.outcome == "ok"), "{clients:?}");
        sent.push(clients.len());
    }
    std::thread::sleep(Duration::from_millis(300));
    let out = tracer.interrupt(Duration::from_secs(30))?;
    let _ = std::fs::remove_file(&config);
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    for server in servers {
        server.stop()?;
    }
    assert!(out.success, "the daemon ended badly:\n{}", out.stderr);
    let followed = out
        .stderr
        .lines()
        .filter_map(|l| l.split("following requests on port(s) ").nth(1))
        .flat_map(|ports| ports.split(", "))
        .map(|p| p.trim().parse::<u16>().context("port"))
        .collect::<Result<Vec<_>>>()?;
    let requests_on = |port: u16| {
        out.lines
            .iter()
            .filter(|l| l["type"] == "request" && l["server_port"] == port)
            .count()
    };
    let per_server: Vec<(u16, bool, usize, usize)> = ports
        .iter()
        .zip(sent)
        .map(|(&port, sent)| (port, followed.contains(&port), sent, requests_on(port)))
        .collect();
    eprintln!("(port, held, requests sent, requests reported): {per_server:?}");
    assert_eq!(followed.len(), 1, "one port held:\n{}", out.stderr);
    for (port, held, sent, n) in per_server {
        assert!(sent > 0);
        let want = if held { sent } else { 0 };
        assert_eq!(n, want, "port {port}:\n{}", out.stderr);
    }
    Ok(())
}

/// `TRACKED` sized to 3 entries (`[kernel_maps] tracked = 3`): of five
/// workloads started at once, those that find it full are refused (a
/// warning, and `ttft_trace_map_full_total{map="TRACKED"}` counts every
/// refusal: each scan tries again) and not reported as traced; the daemon
/// goes on and traces every episode of the ones it holds (and, once those
/// have exited, the others: seen [10, 10, 10, 10, 9] of 10 each).
#[test]
fn a_full_tracked_map_is_counted_not_fatal() -> Result<()> {
    let Some(_g) = root_test("a_full_tracked_map_is_counted_not_fatal") else {
        return Ok(());
    };
    let (mut tracer, addr, config) =
        daemon_with("[kernel_maps]\ntracked = 3\n", &["--comm", "^workload$"])?;
    let mut children = Vec::new();
    for _ in 0..5 {
        let w = Workload::new(Style::Sync)
            .variant(Variant::Linked)
            .episodes(10)
            .gap_us(5_000)
            .stop_before_work(true);
        children.push(w.spawn_stopped()?);
    }
    tracer.wait_for_stderr("eBPF map TRACKED is full", 1, Duration::from_secs(20))?;
    tracer.wait_for_stderr("tracing workload pid", 3, Duration::from_secs(20))?;
    // Two processes refused, again at each 200 ms scan.
    std::thread::sleep(Duration::from_secs(1));
    let metrics = http_get(addr, "/metrics")?;
    let refused = map_full(&metrics, "TRACKED");
    eprintln!("ttft_trace_map_full_total{{map=\"TRACKED\"}} {refused}");
    assert!(refused >= 4.0, "refusals counted: {refused}");
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    for child in &mut children {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
        let st = child.wait_timeout(Duration::from_secs(30))?;
        assert!(st.success(), "{st}");
    }
    tracer.wait_for_stderr("has exited", 3, Duration::from_secs(10))?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    let _ = std::fs::remove_file(&config);
    assert!(out.success, "the daemon ended badly:\n{}", out.stderr);
    let episodes = out.episodes();
    let traced: Vec<usize> = pids
        .iter()
        .map(|&pid| episodes.iter().filter(|e| e.pid == pid).count())
        .collect();
    eprintln!("episodes traced per workload (10 each): {traced:?}");
    let whole = traced.iter().filter(|&&n| n == 10).count();
    assert!(
        whole >= 3,
        "the workloads held are traced whole: {traced:?}"
    );
    let claimed = out
        .stderr
        .lines()
        .filter(|l| l.contains("tracing workload pid"))
        .count();
    assert!(
        claimed <= 3 + 2,
        "a refused process is not reported as traced until it is:\n{}",
        out.stderr
    );
    Ok(())
}

/// `CONNS` sized to 4 entries with 8 keep-alive connections busy at once:
/// the kernel's LRU map evicts followed connections, each is adopted again
/// at its next request (its request in flight is cut), and the daemon
/// counts them in `ttft_trace_table_evictions_total{table="kernel_connections"}`
/// and goes on following requests.
#[test]
fn a_full_conns_map_is_counted_not_fatal() -> Result<()> {
    let Some(_g) = root_test("a_full_conns_map_is_counted_not_fatal") else {
        return Ok(());
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let (mut tracer, addr, config) =
        daemon_with("[kernel_maps]\nconns = 4\n", &["--only-port", &port])?;
    let server = DemoServer::start(&["--output-tokens", "4", "--port", &port])?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    let clients = loadgen(
        server.port,
        &[
            "--concurrency",
            "8",
            "--requests",
            "96",
            "--output-tokens",
            "4",
        ],
    )?;
    std::thread::sleep(Duration::from_millis(1500));
    let metrics = http_get(addr, "/metrics")?;
    server.stop()?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    let _ = std::fs::remove_file(&config);
    assert!(out.success, "the daemon ended badly:\n{}", out.stderr);
    let lost: f64 = metrics
        .lines()
        .find(|l| l.starts_with("ttft_trace_table_evictions_total{table=\"kernel_connections\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    let requests: Vec<&serde_json::Value> = out
        .lines
        .iter()
        .filter(|l| l["type"] == "request")
        .collect();
    let ok = requests.iter().filter(|r| r["outcome"] == "ok").count();
    eprintln!(
        "{} requests sent, {} traced, {ok} ok; connections lost in the kernel's map: {lost}",
        clients.len(),
        requests.len()
    );
    assert!(lost > 0.0, "the evictions are counted");
    assert!(ok > 0, "the daemon goes on following requests");
    Ok(())
}
