//! Root-only: a full eBPF map is counted and warned about, never the end
//! of the daemon. `LISTEN_PORTS` holds 1024 ports; the daemon is asked to
//! follow more, and keeps tracing. `TRACKED` and `CONNS` are made small
//! through the settings file and overfilled.

use std::time::Duration;

use anyhow::Result;
use ttft_trace_tests::{
    demo::{DemoServer, loadgen},
    fixtures::{Style, Variant, Workload, temp_path},
    tracer::{Tracer, http_get, root_test},
};

/// Entries of `LISTEN_PORTS` (ttft-trace-ebpf/src/maps.rs).
const LISTEN_PORTS_MAX: u16 = 1024;
const EXTRA: u16 = 6;

#[test]
fn a_full_listen_ports_map_is_counted_not_fatal() -> Result<()> {
    let Some(_g) = root_test("a_full_listen_ports_map_is_counted_not_fatal") else {
        return Ok(());
    };
    let mut args: Vec<String> = [
        "--rescan-ms",
        "200",
        "--no-nvml",
        "--interval",
        "60",
        "--comm",
        "^workload$",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for port in 0..LISTEN_PORTS_MAX + EXTRA {
        args.push("--port".into());
        args.push((20_000 + port).to_string());
    }
    let mut tracer = Tracer::start_daemon(&args)?;
    let truth = temp_path("maps-full-truth", "jsonl");
    let w = Workload::new(Style::Sync)
        .variant(Variant::Linked)
        .episodes(20)
        .gap_us(5_000)
        .stop_before_work(true)
        .truth(&truth);
    let mut child = w.spawn_stopped()?;
    let pid = child.id();
    tracer.wait_for_stderr(
        &format!("tracing workload pid {pid} "),
        1,
        Duration::from_secs(20),
    )?;
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let st = child.wait_timeout(Duration::from_secs(30))?;
    assert!(st.success(), "{st}");
    tracer.wait_for_stderr("has exited", 1, Duration::from_secs(10))?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    let _ = std::fs::remove_file(&truth);
    assert!(out.success, "the daemon ended badly:\n{}", out.stderr);
    let refused = out
        .stderr
        .lines()
        .filter(|l| l.contains("eBPF map LISTEN_PORTS is full"))
        .count();
    assert_eq!(refused, usize::from(EXTRA), "{}", out.stderr);
    let traced = out.episodes().iter().filter(|e| e.pid == pid).count();
    assert_eq!(traced, 20, "the workload is traced all the same");
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
    let config = temp_path("maps-full-config", "toml");
    std::fs::write(&config, "[kernel_maps]\ntracked = 3\n")?;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let listen = addr.to_string();
    let args: Vec<String> = [
        "--listen",
        &listen,
        "--config",
        config.to_str().unwrap_or_default(),
        "--rescan-ms",
        "200",
        "--no-nvml",
        "--interval",
        "60",
        "--comm",
        "^workload$",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracer = Tracer::start_daemon(&args)?;
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
    let refused: f64 = metrics
        .lines()
        .find(|l| l.starts_with("ttft_trace_map_full_total{map=\"TRACKED\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
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
    let config = temp_path("maps-full-config", "toml");
    std::fs::write(&config, "[kernel_maps]\nconns = 4\n")?;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let listen = addr.to_string();
    let args: Vec<String> = [
        "--listen",
        &listen,
        "--config",
        config.to_str().unwrap_or_default(),
        "--rescan-ms",
        "200",
        "--no-nvml",
        "--only-port",
        &port,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut tracer = Tracer::start_daemon(&args)?;
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
