//! Root-only: NVML readings joined to GPU episodes by the running tracer,
//! through the scripted test NVML library (no GPU here), and the clean
//! no-NVML path.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use ttft_trace_tests::{
    fixtures::{self, Style, Workload},
    tracer::{Tracer, http_get, metric_total, root_test, wait_for_requests},
};

const GIB: u64 = 1 << 30;

#[test]
fn episodes_carry_the_readings_of_their_gpu() -> Result<()> {
    let Some(_g) = root_test("episodes_carry_the_readings_of_their_gpu") else {
        return Ok(());
    };
    // A private copy: the stub reads its script from `<its path>.script`.
    let lib = fixtures::temp_path("libnvidia-ml", "so");
    std::fs::copy(fixtures::existing_fixture("libnvidia-ml-stub.so")?, &lib)?;
    let script = format!("{}.script", lib.display());
    let mut child = Workload::new(Style::Stream)
        .episodes(20)
        .gap_us(20_000)
        .spawn_stopped()?;
    // Two GPUs; the workload runs on GPU 1, which is throttled and nearly full.
    std::fs::write(
        &script,
        format!(
            "gpus 2\nuuid 1 GPU-test-1\n\
             at 0 0 sm=1980 mem=2619 used={} total={} util=10 power=100000 temp=40 throttle=0\n\
             at 0 1 sm=1410 mem=2619 used={} total={} util=95 power=650000 temp=85 throttle=0x20\n\
             proc 1 compute {}\n",
            GIB,
            80 * GIB,
            76 * GIB,
            80 * GIB,
            child.id()
        ),
    )?;
    let args = vec![
        "--pid".to_string(),
        child.id().to_string(),
        "--nvml-lib".into(),
        lib.display().to_string(),
        "--nvml-period-ms".into(),
        "10".into(),
    ];
    let mut tracer = Tracer::start(&args, 2)?;
    tracer.wait_for_stderr("NVML: sampling", 1, Duration::from_secs(5))?;
    // The sampler has mapped the pid to its GPU (process lists refresh
    // every second).
    let mapped = format!("NVML: pid {} runs on GPU [1]", child.id());
    tracer.wait_for_stderr(&mapped, 1, Duration::from_secs(10))?;
    fixtures::cont(child.id())?;
    child.wait_timeout(Duration::from_secs(30))?;
    let out = tracer.finish(Duration::from_secs(20))?;
    assert!(out.success, "{}", out.stderr);
    let episodes: Vec<&serde_json::Value> = out
        .lines
        .iter()
        .filter(|l| l["type"] == "episode")
        .collect();
    assert_eq!(episodes.len(), 20);
    for ep in episodes {
        let gpu = &ep["gpu"];
        assert_eq!(
            gpu["gpus"],
            serde_json::json!([1]),
            "charged to its own GPU: {ep}"
        );
        assert_eq!(gpu["sm_clock_min_hz"], 1_410_000_000u64, "{ep}");
        assert_eq!(gpu["mem_used_max_bytes"], 76 * GIB, "{ep}");
        assert_eq!(
            gpu["throttle_reasons"],
            serde_json::json!(["sw_thermal_slowdown"]),
            "{ep}"
        );
    }
    let _ = std::fs::remove_file(&lib);
    let _ = std::fs::remove_file(&script);
    Ok(())
}

#[test]
fn without_nvml_everything_else_works() -> Result<()> {
    let Some(_g) = root_test("without_nvml_everything_else_works") else {
        return Ok(());
    };
    let mut child = Workload::new(Style::Sync)
        .episodes(100_000)
        .gap_us(2000)
        .spawn_stopped()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let args = vec![
        "--pid".to_string(),
        child.id().to_string(),
        "--listen".into(),
        port.to_string(),
        "--nvml-lib".into(),
        "/nonexistent/libnvidia-ml.so.1".into(),
    ];
    let mut tracer = Tracer::start(&args, 2)?;
    tracer.wait_for_stderr("GPU readings are off", 1, Duration::from_secs(5))?;
    fixtures::cont(child.id())?;
    // Until its first launches are counted.
    let deadline = Instant::now() + Duration::from_secs(10);
    let body = loop {
        let body = http_get(port, "/metrics")?;
        if metric_total(&body, "ttft_trace_cuda_kernel_launches_total") > 0 {
            break body;
        }
        ensure!(
            Instant::now() < deadline,
            "no launch counted in 10 s:\n{body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        !body.contains("ttft_trace_gpu_sm_clock_hertz"),
        "GPU series must be absent, not zero"
    );
    assert!(
        body.contains("ttft_trace_cuda_kernel_launches_total"),
        "{body}"
    );
    if let Some(c) = child.child_mut() {
        c.kill()?;
    }
    let out = tracer.finish(Duration::from_secs(20))?;
    assert!(out.success, "{}", out.stderr);
    assert!(
        out.stderr.contains("/nonexistent/libnvidia-ml.so.1"),
        "names what it tried: {}",
        out.stderr
    );
    assert!(
        out.lines
            .iter()
            .filter(|l| l["type"] == "episode")
            .all(|l| l.get("gpu").is_none())
    );
    Ok(())
}

#[test]
fn requests_carry_the_readings_of_the_gpu_that_served_them() -> Result<()> {
    let Some(_g) = root_test("requests_carry_the_readings_of_the_gpu_that_served_them") else {
        return Ok(());
    };
    let lib = fixtures::temp_path("libnvidia-ml", "so");
    std::fs::copy(fixtures::existing_fixture("libnvidia-ml-stub.so")?, &lib)?;
    let script = format!("{}.script", lib.display());
    let server = ttft_trace_tests::demo::DemoServer::start(&["--output-tokens", "16"])?;
    let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    std::fs::write(
        &script,
        format!(
            "gpus 1\nat 0 0 sm=1755 mem=2619 used={} total={} util=90 power=500000 temp=70 throttle=0\n\
             proc 0 compute {}\n",
            40 * GIB,
            80 * GIB,
            server.pid
        ),
    )?;
    let args = vec![
        "--pid".to_string(),
        server.pid.to_string(),
        "--nvml-lib".into(),
        lib.display().to_string(),
        "--nvml-period-ms".into(),
        "10".into(),
        "--listen".into(),
        listen.to_string(),
    ];
    let mut tracer = Tracer::start(&args, 0)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
    let mapped = format!("NVML: pid {} runs on GPU [0]", server.pid);
    tracer.wait_for_stderr(&mapped, 1, Duration::from_secs(10))?;
    let clients = ttft_trace_tests::demo::loadgen(
        server.port,
        &[
            "--concurrency",
            "1",
            "--requests",
            "3",
            "--output-tokens",
            "16",
        ],
    )?;
    wait_for_requests(listen, clients.len(), Duration::from_secs(20))?;
    let out = tracer.interrupt(Duration::from_secs(20))?;
    server.stop()?;
    assert!(out.success, "{}", out.stderr);
    let requests: Vec<&serde_json::Value> = out
        .lines
        .iter()
        .filter(|l| l["type"] == "request")
        .collect();
    assert_eq!(requests.len(), clients.len());
    for r in requests {
        assert_eq!(r["gpu"]["sm_clock_min_hz"], 1_755_000_000u64, "{r}");
        assert_eq!(r["gpu"]["mem_used_max_bytes"], 40 * GIB, "{r}");
    }
    let _ = std::fs::remove_file(&lib);
    let _ = std::fs::remove_file(&script);
    Ok(())
}
