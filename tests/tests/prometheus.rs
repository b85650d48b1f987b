//! Root-only: a real Prometheus (Debian's package) scrapes `ttft-trace daemon` every
//! second while the demo server is under load, with deploy/prometheus's rules
//! loaded. Prometheus' `histogram_quantile(0.99, ...)` over the tracer's
//! buckets is held against the exact P99 of the same requests (the tracer's
//! JSONL lines); `promtool check metrics` reads a raw scrape; every panel
//! query of the Grafana dashboard and every rule is evaluated by the server.

use std::{process::Command, time::Duration};

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;
use ttft_trace_tests::{
    demo::{DemoServer, loadgen},
    prometheus::{
        Prometheus, RATE_INTERVAL, dashboard, dashboard_queries, deploy_dir, free_port,
        http_get_body, require_tool,
    },
    tracer::{Tracer, root_test},
};

/// The daemon's arguments for metrics on `listen`, limited to the workload
/// that listens on `port` (the demo server: other CUDA processes on the host
/// stay out of the figures). The SLO is lowered to 100 ms so that this short
/// load has slow requests (causes, violations) to show; the TTFT
/// histogram's buckets do not depend on it.
fn daemon_args(port: u16, listen: &str) -> Vec<String> {
    let args = [
        "--only-port",
        &port.to_string(),
        "--listen",
        listen,
        "--interval",
        "60",
        "--slo-ms",
        "100",
    ];
    args.iter().map(|s| s.to_string()).collect()
}

/// Index of the bucket holding `x`: the first bound `>= x`.
fn bucket(bounds: &[f64], x: f64) -> usize {
    bounds.iter().position(|b| x <= *b).unwrap_or(bounds.len())
}

fn le(labels: &Value) -> f64 {
    match labels["le"].as_str() {
        Some("+Inf") => f64::INFINITY,
        Some(s) => s.parse().unwrap_or(f64::NAN),
        None => f64::NAN,
    }
}

#[test]
fn prometheus_agrees_with_the_tracer_and_evaluates_the_deploy_files() -> Result<()> {
    let test = "prometheus_agrees_with_the_tracer_and_evaluates_the_deploy_files";
    let Some(_g) = root_test(test) else {
        return Ok(());
    };
    let (Some(prom_bin), Some(promtool)) = (
        require_tool("prometheus", test),
        require_tool("promtool", test),
    ) else {
        return Ok(());
    };
    let server = DemoServer::start(&["--output-tokens", "32"])?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let mut tracer = Tracer::start_daemon(&daemon_args(server.port, &listen))?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    let rules = deploy_dir().join("prometheus/rules.yml");
    let prom = Prometheus::start(&prom_bin, listen.parse()?, &[rules])?;
    prom.wait_scrapes(1, Duration::from_secs(30))?;

    let clients = loadgen(
        server.port,
        &[
            "--concurrency",
            "1,4,8",
            "--requests",
            "16",
            "--output-tokens",
            "32",
        ],
    )?;
    ensure!(clients.iter().all(|c| c.outcome == "ok"));
    // The last responses' grace period, then two scrapes that began after it,
    // and a rule evaluation after those.
    std::thread::sleep(Duration::from_millis(300));
    prom.wait_scrapes(2, Duration::from_secs(30))?;
    std::thread::sleep(Duration::from_secs(2));

    // A raw scrape through promtool's linter.
    let (code, body) = http_get_body(listen.parse()?, "/metrics")?;
    ensure!(code == 200, "/metrics: HTTP {code}");
    let mut lint = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(lint.stdin.as_mut().context("stdin")?, body.as_bytes())?;
    drop(lint.stdin.take());
    let lint = lint.wait_with_output()?;
    let lint_text =
        String::from_utf8_lossy(&lint.stdout).into_owned() + &String::from_utf8_lossy(&lint.stderr);
    eprintln!(
        "promtool check metrics on a scrape of {} lines: {} {}",
        body.lines().count(),
        lint.status,
        lint_text.trim()
    );
    ensure!(lint.status.success(), "promtool check metrics: {lint_text}");

    // Prometheus' view of the tracer's TTFT histogram.
    let p99_expr =
        "histogram_quantile(0.99, sum by (le) (ttft_trace_time_to_first_token_seconds_bucket))";
    let prom_p99 = prom.query_scalar(p99_expr)?;
    let mut buckets: Vec<(f64, f64)> = prom
        .query_vector("sum by (le) (ttft_trace_time_to_first_token_seconds_bucket)")?
        .iter()
        .map(|(l, v)| (le(l), *v))
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let recorded_p99 = prom.query_scalar("fleet:ttft_trace_time_to_first_token_seconds:p99_5m")?;

    // Every panel of the dashboard, evaluated.
    let mut empty_ok = Vec::new();
    for q in dashboard_queries(&dashboard()?) {
        let samples = prom
            .query_vector(&q.expr)
            .with_context(|| format!("panel {:?} {}", q.panel, q.ref_id))?;
        let finite = samples.iter().filter(|(_, v)| v.is_finite()).count();
        let positive = samples
            .iter()
            .filter(|(_, v)| v.is_finite() && *v > 0.0)
            .count();
        eprintln!(
            "panel {:?} {}: {} series ({finite} finite, {positive} above 0)",
            q.panel,
            q.ref_id,
            samples.len()
        );
        let must_have_data = [
            "ttft_trace_time_to_first_token_seconds",
            "ttft_trace_request_queue_seconds",
            "ttft_trace_request_gpu_seconds",
            "ttft_trace_request_egress_seconds",
            "ttft_trace_slow_requests_total",
            "ttft_trace_slo_violations_total",
        ]
        .iter()
        .any(|m| q.expr.contains(m));
        if must_have_data {
            ensure!(
                finite > 0,
                "panel {:?} {}: no data: {}",
                q.panel,
                q.ref_id,
                q.expr
            );
        } else if finite == 0 {
            empty_ok.push(q.panel.clone());
        }
    }
    eprintln!(
        "panels without data here (no GPU, so no NVML series), allowed: {empty_ok:?} \
         ($__rate_interval = {RATE_INTERVAL})"
    );

    // Every rule loaded and evaluated without error.
    let groups = prom.query_rules()?;
    let mut n_rules = 0;
    for g in groups.as_array().context("groups")? {
        for r in g["rules"].as_array().context("rules")? {
            n_rules += 1;
            ensure!(
                r["health"] == "ok",
                "rule {} unhealthy: {}",
                r["name"],
                r["lastError"]
            );
        }
    }
    ensure!(n_rules >= 20, "{n_rules} rules loaded");

    drop(prom);
    let out = tracer.interrupt(Duration::from_secs(30))?;
    server.stop()?;
    ensure!(out.success, "{}", out.stderr);

    // The same requests, exactly, from the tracer's JSONL.
    let mut ttft: Vec<f64> = out
        .lines
        .iter()
        .filter(|l| l["type"] == "request")
        .filter_map(|l| l["ttft_ns"].as_u64())
        .map(|ns| ns as f64 / 1e9)
        .collect();
    ttft.sort_by(f64::total_cmp);
    ensure!(
        ttft.len() == clients.len(),
        "{} traced, {} sent",
        ttft.len(),
        clients.len()
    );
    // Nearest rank: the smallest value with at least 99 % of requests <= it.
    let rank = (0.99 * ttft.len() as f64).ceil() as usize;
    let exact_p99 = ttft[rank - 1];

    // Each bucket Prometheus stored holds exactly the requests of the JSONL.
    for (bound, count) in &buckets {
        let n = ttft.iter().filter(|t| **t <= *bound).count();
        ensure!(
            n as f64 == *count,
            "bucket le={bound}: Prometheus {count}, JSONL {n}"
        );
    }
    let bounds: Vec<f64> = buckets.iter().map(|(b, _)| *b).collect();
    let (bp, be, br) = (
        bucket(&bounds, prom_p99),
        bucket(&bounds, exact_p99),
        bucket(&bounds, recorded_p99),
    );
    let range = |i: usize| {
        format!(
            "({}, {}]",
            if i == 0 { 0.0 } else { bounds[i - 1] },
            bounds[i]
        )
    };
    eprintln!(
        "P99 TTFT of {} requests: Prometheus {p99_expr} = {:.1} ms (bucket {bp}, {} s); \
         recording rule fleet:...:p99_5m = {:.1} ms (bucket {br}); exact from the JSONL \
         (nearest rank {rank}) = {:.1} ms (bucket {be}, {} s)",
        ttft.len(),
        prom_p99 * 1e3,
        range(bp),
        recorded_p99 * 1e3,
        exact_p99 * 1e3,
        range(be),
    );
    // Within one bucket: the bucket that holds Prometheus' estimate is the
    // one that holds the exact P99, or its neighbour.
    ensure!(
        bp.abs_diff(be) <= 1,
        "Prometheus P99 bucket {bp} vs exact {be}"
    );
    ensure!(
        br.abs_diff(be) <= 1,
        "recorded P99 bucket {br} vs exact {be}"
    );
    Ok(())
}
