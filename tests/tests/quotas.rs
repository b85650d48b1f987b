//! Root-only: host capacity shared by quota (issue 28). One workload (a pod
//! cgroup the test makes) past its share of a host-wide kernel map is
//! degraded alone: what it holds past its share is refused and counted in
//! `ttft_trace_quota_exceeded_total{resource}`, and the others are traced.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use ttft_trace_tests::{
    container::PodCgroup,
    demo::{DemoServer, loadgen},
    fixtures::temp_path,
    tenant::{GreedyTenant, eight_requests_in, stop_server_and_daemon},
    tracer::{Tracer, http_get, metric_total, pod_daemon_args, root_test},
};

/// The daemon with the settings `settings` and `extra` arguments, its
/// metrics on a free port, scanning every 200 ms, tracing only the pod
/// cgroups (the tests' own: not another test's servers on this host).
fn daemon(settings: &str, extra: &[&str]) -> Result<(Tracer, SocketAddr)> {
    let config = temp_path("quotas-config", "toml");
    std::fs::write(&config, settings)?;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut args = pod_daemon_args(addr, "/kubepods");
    args.extend(["--config".into(), config.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let tracer = Tracer::start_daemon(&args);
    let _ = std::fs::remove_file(&config);
    Ok((tracer?, addr))
}

/// Polls /metrics until `name` reads `want`; returns what it read last.
fn wait_for_metric(addr: SocketAddr, name: &str, want: u64, timeout: Duration) -> Result<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let got = metric_total(&http_get(addr, "/metrics")?, name);
        if got == want || Instant::now() >= deadline {
            return Ok(got);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The daemon with `settings` and a share of `share` (`flag`), and the
/// greedy workload in a pod of its own, traced, then ordered to take `n`
/// of `resource` (`listen`, `threads`): returned once the daemon warned
/// it is past its share.
fn greedy_past_share(
    settings: &str,
    flag: &str,
    share: u64,
    (order, resource, n): (&str, &str, u64),
) -> Result<(Tracer, SocketAddr, GreedyTenant)> {
    let (mut tracer, addr) = daemon(settings, &[flag, &share.to_string()])?;
    let mut greedy = GreedyTenant::start(PodCgroup::new()?)?;
    tracer.wait_for_workload(greedy.pid)?;
    let t0 = Instant::now();
    greedy.order(&format!("{order} {n}"))?;
    tracer.wait_for_stderr(
        &format!("has its share of {share} {resource}"),
        1,
        Duration::from_secs(10),
    )?;
    eprintln!("past its share {:?} after its {order} began", t0.elapsed());
    Ok((tracer, addr, greedy))
}

/// Stops `server` and the daemon, which must have traced every one of the
/// `sent` requests on the server's port.
fn all_traced(server: DemoServer, tracer: Tracer, sent: usize) -> Result<()> {
    let (_, traced) = stop_server_and_daemon(server, tracer)?;
    eprintln!("the new server: {traced} of {sent} requests traced");
    ensure!(sent > 0 && traced == sent, "{traced} of {sent} traced");
    Ok(())
}

/// From /metrics: what was refused past the shares of `resource`, and by
/// the full map `map`.
fn refusals(addr: SocketAddr, resource: &str, map: &str) -> Result<(u64, u64)> {
    let metrics = http_get(addr, "/metrics")?;
    let exceeded = format!("ttft_trace_quota_exceeded_total{{resource=\"{resource}\"}}");
    let full = format!("ttft_trace_map_full_total{{map=\"{map}\"}}");
    Ok((
        metric_total(&metrics, &exceeded),
        metric_total(&metrics, &full),
    ))
}

const LISTENERS: u64 = 3000;
const SHARE: u64 = 1000;

/// A workload listening on 3000 ports, with `LISTEN_NETNS` sized to 2048
/// pairs (its listen() calls alone would fill it) and a share of 1000: the
/// pairs past its share are taken out of the map at the next scan and
/// counted once each (2000); a new server in another network namespace,
/// another pod, started after, is followed and every request of it
/// traced. Once the workload closes its sockets, its pairs go, and ten
/// new listeners of it are followed: it is under its share again.
#[test]
fn thousands_of_listeners_leave_room_for_a_new_server_elsewhere() -> Result<()> {
    let Some(_g) = root_test("thousands_of_listeners_leave_room_for_a_new_server_elsewhere") else {
        return Ok(());
    };
    let started = Instant::now();
    let (mut tracer, addr, mut greedy) = greedy_past_share(
        "[kernel_maps]\nlisten_netns = 2048\n",
        "--max-listeners-per-workload",
        SHARE,
        ("listen", "listeners", LISTENERS),
    )?;
    let server = DemoServer::start_in_netns(
        &["--output-tokens", "4", "--load-gb", "1"],
        Some(PodCgroup::new()?),
    )?;
    tracer.wait_for_workload(server.pid)?;
    let followed = wait_for_metric(
        addr,
        "ttft_trace_listeners_followed",
        SHARE + 1,
        Duration::from_secs(5),
    )?;
    let clients = eight_requests_in(&server)?;
    let (refused, map_full) = refusals(addr, "listeners", "LISTEN_NETNS")?;
    greedy.order("close")?;
    let t_close = Instant::now();
    let after_close = wait_for_metric(
        addr,
        "ttft_trace_listeners_followed",
        1,
        Duration::from_secs(5),
    )?;
    eprintln!(
        "pairs followed: {followed} with the workload's {LISTENERS} listeners, {after_close} \
         {:?} after it closed them; refused past its share: {refused}; refused by the full map \
         (its burst before the first scan): {map_full}",
        t_close.elapsed()
    );
    // Under its share again: its new listeners are followed.
    greedy.order("listen 10")?;
    let again = wait_for_metric(
        addr,
        "ttft_trace_listeners_followed",
        11,
        Duration::from_secs(5),
    )?;
    eprintln!("pairs followed after it listened on 10 ports again: {again}");
    all_traced(server, tracer, clients.len())?;
    eprintln!("test {:?}", started.elapsed());
    ensure!(refused == LISTENERS - SHARE, "refused {refused}");
    ensure!(followed == SHARE + 1, "followed {followed}");
    ensure!(after_close == 1, "after close {after_close}");
    ensure!(again == 11, "listening again: {again}");
    Ok(())
}

const THREADS: u64 = 400;
const THREAD_SHARE: u64 = 64;

/// A workload starting 400 threads, with `TRACKED` sized to 256 ids (its
/// threads alone would fill it: the kernel adds each at its fork) and a
/// share of 64: its ids past its share are dropped at the next scan and
/// its later forks refused in the kernel; every one of its threads is
/// either kept (63, beside its process), refused or dropped past its share
/// (`ttft_trace_quota_exceeded_total{resource="threads"}`), or refused by
/// the full map before the first scan. A new server in another pod,
/// started after, is traced, every request of it.
#[test]
fn a_workload_with_more_threads_than_its_share_is_degraded_alone() -> Result<()> {
    let Some(_g) = root_test("a_workload_with_more_threads_than_its_share_is_degraded_alone")
    else {
        return Ok(());
    };
    let started = Instant::now();
    let (mut tracer, addr, greedy) = greedy_past_share(
        "[kernel_maps]\ntracked = 256\n",
        "--max-threads-per-workload",
        THREAD_SHARE,
        ("threads", "threads", THREADS),
    )?;
    // The next scan (250 ms) has dropped what is past its share.
    std::thread::sleep(Duration::from_millis(600));
    let (refused, map_full) = refusals(addr, "threads", "TRACKED")?;
    let server = DemoServer::start_in(
        &[
            "--output-tokens",
            "4",
            "--load-gb",
            "1",
            "--threads",
            "4",
            "--tokenizer-threads",
            "2",
        ],
        Some(PodCgroup::new()?),
    )?;
    tracer.wait_for_workload(server.pid)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(10))?;
    let clients = loadgen(server.port, &["--requests", "8", "--output-tokens", "4"])?;
    std::thread::sleep(Duration::from_millis(300));
    drop(greedy);
    eprintln!(
        "{THREADS} threads, share {THREAD_SHARE}: refused or dropped past the share {refused}, \
         refused by the full map {map_full}"
    );
    all_traced(server, tracer, clients.len())?;
    eprintln!("test {:?}", started.elapsed());
    ensure!(refused > 0, "nothing counted past the share");
    ensure!(
        refused + map_full == THREADS - (THREAD_SHARE - 1),
        "every thread past the share counted once: {refused} + {map_full}"
    );
    Ok(())
}

const SAMPLED_SHARE: u64 = 16;

/// The threads a process (`tgid`) has, and how many of them the daemon
/// (`daemon`) samples: the schedstat files of them it holds open.
fn sampled(daemon: u32, tgid: u32) -> Result<(usize, usize)> {
    let prefix = format!("/proc/{tgid}/task/");
    let open = std::fs::read_dir(format!("/proc/{daemon}/fd"))?
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|t| t.to_string_lossy().starts_with(&prefix))
        .count();
    Ok((std::fs::read_dir(&prefix)?.count(), open))
}

/// `--sched sampled` with a share of 16 sampled threads a workload: the
/// workload with 101 threads has 16 sampled (16 schedstat files open in
/// the daemon) and 85 refused, counted once each
/// (`ttft_trace_quota_exceeded_total{resource="sampled_threads"}`); a new
/// server in another pod has every thread sampled and every request
/// traced.
#[test]
fn a_workload_with_more_threads_than_its_sampling_share_is_degraded_alone() -> Result<()> {
    let Some(_g) =
        root_test("a_workload_with_more_threads_than_its_sampling_share_is_degraded_alone")
    else {
        return Ok(());
    };
    let started = Instant::now();
    let (mut tracer, addr, greedy) = greedy_past_share(
        "sched = \"sampled\"\n",
        "--max-sampled-threads-per-workload",
        SAMPLED_SHARE,
        ("threads", "sampled threads", THREADS / 4),
    )?;
    let daemon_pid = tracer.pid().context("the daemon's pid")?;
    // The next scan (250 ms) has listed them all.
    std::thread::sleep(Duration::from_millis(600));
    let (threads, open) = sampled(daemon_pid, greedy.pid)?;
    let (refused, _) = refusals(addr, "sampled_threads", "TRACKED")?;
    let server = DemoServer::start_in(
        &["--output-tokens", "4", "--load-gb", "1"],
        Some(PodCgroup::new()?),
    )?;
    tracer.wait_for_workload(server.pid)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(10))?;
    let clients = loadgen(server.port, &["--requests", "8", "--output-tokens", "4"])?;
    // Threads it started for the load are listed at the next scan.
    let deadline = Instant::now() + Duration::from_secs(3);
    let (server_threads, server_open) = loop {
        let (threads, open) = sampled(daemon_pid, server.pid)?;
        if threads == open || Instant::now() >= deadline {
            break (threads, open);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "the workload: {open} of its {threads} threads sampled, {refused} refused; the new \
         server: {server_open} of its {server_threads} threads sampled"
    );
    drop(greedy);
    all_traced(server, tracer, clients.len())?;
    eprintln!("test {:?}", started.elapsed());
    ensure!(open as u64 == SAMPLED_SHARE, "{open} sampled");
    ensure!(
        refused == threads as u64 - SAMPLED_SHARE,
        "{refused} refused of {threads}"
    );
    ensure!(
        server_open == server_threads,
        "the server's threads are all sampled"
    );
    Ok(())
}

/// `ttft-trace check` with the daemon's settings (`[quotas] threads = 64,
/// listeners = 10`) beside a workload in a pod holding 101 threads and 20
/// listening sockets: the shares are shown, and that pod named past its
/// threads, sampled-threads (at the default 4096: no) and listeners shares.
#[test]
fn check_names_a_workload_past_its_share() -> Result<()> {
    let Some(_g) = root_test("check_names_a_workload_past_its_share") else {
        return Ok(());
    };
    let mut greedy = GreedyTenant::start(PodCgroup::new()?)?;
    greedy.order("threads 100")?;
    greedy.order("listen 20")?;
    let config = temp_path("check-quotas", "toml");
    std::fs::write(&config, "[quotas]\nthreads = 64\nlisteners = 10\n")?;
    let out = std::process::Command::new(ttft_trace_tests::tracer::tracer_bin()?)
        .args(["check", "--json", "--config"])
        .arg(&config)
        .output()?;
    let _ = std::fs::remove_file(&config);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
    let items = report["items"].as_array().context("items")?;
    let detail = |name: &str| -> Vec<String> {
        items
            .iter()
            .filter(|i| i["name"] == name)
            .map(|i| format!("{} {}", i["verdict"], i["detail"]))
            .collect()
    };
    let pod = greedy.pod_uid().to_string();
    let (shares, threads, listeners, sampled) = (
        detail("quotas"),
        detail("quota threads"),
        detail("quota listeners"),
        detail("quota sampled_threads"),
    );
    eprintln!("{shares:?}\n{threads:?}\n{listeners:?}\n{sampled:?}");
    ensure!(
        shares.len() == 1 && shares[0].contains("10 listeners, 64 threads, 4096 sampled threads"),
        "{shares:?}"
    );
    let of_pod = |v: &[String]| v.iter().filter(|d| d.contains(&pod)).count();
    ensure!(
        of_pod(&threads) == 1
            && threads
                .iter()
                .any(|d| d.contains("holds 101 threads now, 37 past")),
        "{threads:?}"
    );
    ensure!(
        of_pod(&listeners) == 1
            && listeners
                .iter()
                .any(|d| d.contains("holds 20 listeners now, 10 past")),
        "{listeners:?}"
    );
    ensure!(of_pod(&sampled) == 0, "{sampled:?}");
    Ok(())
}
