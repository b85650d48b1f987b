//! Root-only: labels a tenant cannot forge. Each container is a fixture
//! workload in a mount namespace and a pod cgroup made by the test (the
//! kubelet's cgroupfs and systemd naming), whose environment claims a pod
//! (`POD_NAME`/`POD_NAMESPACE`). The host's record of each pod UID is a pod
//! log directory made by the test. The daemon's series must carry the
//! host's names whatever the claim; the claim appears only in the JSONL
//! workload line, with its verdict, and one that differs is counted.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use ttft_trace_tests::{
    container::{Container, ContainerRoot, PodCgroup, PodLogDir, View},
    fixtures::{self, Style, Variant, Workload, read_truth},
    tracer::{Tracer, http_get, metric_total, root_test},
};

const EPISODES: u32 = 20;
/// Every forged name holds this: no series may.
const FORGED: &str = "payments";

/// One container: the names it claims, and what its series must carry.
struct Case {
    what: &'static str,
    container: Container,
    /// (namespace, pod) its series must carry; pod None: the pod UID.
    labels: (&'static str, Option<&'static str>),
    claim: (Option<&'static str>, Option<&'static str>),
    verdict: &'static str,
}

/// A container in `cgroup` whose environment holds `env`, running a
/// workload stopped before its first CUDA call.
fn container(name: &str, cgroup: PodCgroup, env: &[(&str, &str)]) -> Result<Container> {
    let mut root = ContainerRoot::new(name, View::Bind)?;
    for (k, v) in env {
        root.env(k, v);
    }
    let w = Workload::new(Style::Sync)
        .variant(Variant::Linked)
        .episodes(EPISODES)
        .gap_us(2_000)
        .stop_before_work(true)
        .truth("/truth.jsonl");
    let c = root.spawn(&w, cgroup)?;
    fixtures::wait_stopped(c.pid).with_context(|| format!("container {name}"))?;
    Ok(c)
}

fn free_addr() -> Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

#[test]
fn labels_come_from_the_host_and_claims_only_beside_them() -> Result<()> {
    let Some(_g) = root_test("labels_come_from_the_host_and_claims_only_beside_them") else {
        return Ok(());
    };
    let logs = PodLogDir::new()?;
    let forged = [("POD_NAME", "payments-api"), ("POD_NAMESPACE", "payments")];

    let cgroupfs = PodCgroup::new()?;
    logs.add("serving", "vllm-a", &cgroupfs.pod_uid)?;
    let systemd = PodCgroup::systemd()?;
    logs.add("serving", "vllm-b", &systemd.pod_uid)?;
    let honest = PodCgroup::systemd()?;
    logs.add("serving", "vllm-c", &honest.pod_uid)?;
    // Listed under two names: neither is believed.
    let ambiguous = PodCgroup::new()?;
    logs.add("serving", "vllm-d", &ambiguous.pod_uid)?;
    logs.add("payments", "vllm-d", &ambiguous.pod_uid)?;

    let mut cases = vec![
        Case {
            what: "cgroupfs driver, forged claim",
            container: container("labels-a", cgroupfs, &forged)?,
            labels: ("serving", Some("vllm-a")),
            claim: (Some("payments-api"), Some("payments")),
            verdict: "differs",
        },
        Case {
            what: "systemd driver, forged pod name",
            container: container("labels-b", systemd, &[("POD_NAME", "payments-db")])?,
            labels: ("serving", Some("vllm-b")),
            claim: (Some("payments-db"), None),
            verdict: "differs",
        },
        Case {
            what: "systemd driver, honest claim",
            container: container(
                "labels-c",
                honest,
                &[("POD_NAME", "vllm-c"), ("POD_NAMESPACE", "serving")],
            )?,
            labels: ("serving", Some("vllm-c")),
            claim: (Some("vllm-c"), Some("serving")),
            verdict: "matches",
        },
        Case {
            what: "ambiguous host record, forged claim",
            container: container("labels-d", ambiguous, &forged)?,
            labels: ("", None),
            claim: (Some("payments-api"), Some("payments")),
            verdict: "unverified",
        },
    ];

    let addr = free_addr()?;
    let args = logs.daemon_args(addr);
    let started = Instant::now();
    let mut tracer = Tracer::start_daemon(&args)?;
    for case in &cases {
        tracer
            .wait_for_workload(case.container.pid)
            .with_context(|| case.what)?;
    }
    eprintln!(
        "{} workloads named {:?} after the daemon started",
        cases.len(),
        started.elapsed()
    );
    for case in &cases {
        fixtures::cont(case.container.pid)?;
    }
    for case in &mut cases {
        let st = case.container.wait(Duration::from_secs(60))?;
        ensure!(st.success(), "{}: {st}", case.what);
    }
    tracer.wait_for_stderr("has exited", cases.len(), Duration::from_secs(10))?;
    let metrics = http_get(addr, "/metrics")?;
    let out = tracer.interrupt(Duration::from_secs(10))?;
    ensure!(out.success, "{}", out.stderr);

    // No series carries a forged name, whatever its family.
    let forged_lines: Vec<&str> = metrics
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(FORGED))
        .collect();
    ensure!(
        forged_lines.is_empty(),
        "series carry a claimed name: {forged_lines:#?}"
    );
    let rejected = metric_total(&metrics, "ttft_trace_label_claims_rejected_total");
    eprintln!("ttft_trace_label_claims_rejected_total {rejected}");
    ensure!(rejected == 2, "{rejected} claims rejected, not 2");

    let workloads = out.workload_lines();
    let episodes = out.episodes();
    for case in &cases {
        let c = &case.container;
        let (namespace, pod) = case.labels;
        let pod = pod.unwrap_or(&c.cgroup.pod_uid);
        // One series of the pod (each pod here has one container).
        let line = metrics
            .lines()
            .find(|l| {
                l.starts_with("ttft_trace_cuda_kernel_launches_total{")
                    && l.contains(&format!("pod=\"{pod}\""))
            })
            .with_context(|| format!("{}: no series of pod {pod}:\n{metrics}", case.what))?;
        ensure!(
            line.contains(&format!("namespace=\"{namespace}\""))
                && line.contains(&format!("container=\"{}\"", &c.cgroup.container_id[..12])),
            "{}: {line}",
            case.what
        );
        let launches: f64 = line
            .rsplit_once(' ')
            .and_then(|(_, v)| v.parse().ok())
            .context("value")?;
        ensure!(launches > 0.0, "{}: no launches counted: {line}", case.what);

        let w = workloads
            .iter()
            .find(|w| w.workload_pid == c.pid)
            .with_context(|| format!("no workload line of {}", case.what))?;
        eprintln!(
            "{}: labels {}/{}, claim {:?}/{:?} {:?}",
            case.what,
            w.workload.namespace,
            w.workload.pod,
            w.claimed_namespace,
            w.claimed_pod,
            w.claim_verdict
        );
        ensure!(
            (w.workload.namespace.as_str(), w.workload.pod.as_str()) == (namespace, pod),
            "{}: workload line labels {:?}",
            case.what,
            w.workload
        );
        ensure!(
            w.pod_uid.as_deref() == Some(c.cgroup.pod_uid.as_str()),
            "{}: pod UID {:?}",
            case.what,
            w.pod_uid
        );
        ensure!(
            (w.claimed_pod.as_deref(), w.claimed_namespace.as_deref()) == case.claim,
            "{}: claim {:?}/{:?}",
            case.what,
            w.claimed_pod,
            w.claimed_namespace
        );
        ensure!(
            w.claim_verdict.as_deref() == Some(case.verdict),
            "{}: verdict {:?}",
            case.what,
            w.claim_verdict
        );

        let truth = read_truth(c.root.path("/truth.jsonl"))?;
        let traced = episodes.iter().filter(|e| e.pid == c.pid).count();
        ensure!(
            traced == truth.len() && traced == EPISODES as usize,
            "{}: {traced} of {} episodes traced",
            case.what,
            truth.len()
        );
    }
    Ok(())
}

/// Host capacity shared by quota (issue 28 item 3): a pod whose containers
/// want more label sets than its share (`--max-label-sets-per-pod 2`, three
/// containers) reports the third under its own `comm="_other"` set, its pod
/// and namespace kept, counted once; another pod beside it keeps its own
/// set, and every episode of all four is still counted.
#[test]
fn a_pod_past_its_share_of_label_sets_is_degraded_alone() -> Result<()> {
    let Some(_g) = root_test("a_pod_past_its_share_of_label_sets_is_degraded_alone") else {
        return Ok(());
    };
    let logs = PodLogDir::new()?;
    let greedy = PodCgroup::new()?;
    logs.add("serving", "greedy", &greedy.pod_uid)?;
    let (greedy_2, greedy_3) = (greedy.sibling()?, greedy.sibling()?);
    let quiet = PodCgroup::systemd()?;
    logs.add("serving", "quiet", &quiet.pod_uid)?;
    let mut containers = Vec::new();
    for (name, cgroup) in [
        ("share-greedy-1", greedy),
        ("share-greedy-2", greedy_2),
        ("share-greedy-3", greedy_3),
        ("share-quiet", quiet),
    ] {
        containers.push(container(name, cgroup, &[])?);
    }
    let addr = free_addr()?;
    let mut args = logs.daemon_args(addr);
    args.extend(["--max-label-sets-per-pod".into(), "2".into()]);
    let mut tracer = Tracer::start_daemon(&args)?;
    for c in &containers {
        tracer.wait_for_workload(c.pid)?;
    }
    for c in &containers {
        fixtures::cont(c.pid)?;
    }
    for c in &mut containers {
        let st = c.wait(Duration::from_secs(60))?;
        ensure!(st.success(), "{st}");
    }
    tracer.wait_for_stderr("has exited", containers.len(), Duration::from_secs(10))?;
    let metrics = http_get(addr, "/metrics")?;
    let out = tracer.interrupt(Duration::from_secs(10))?;
    ensure!(out.success, "{}", out.stderr);

    let launches = |pod: &str| -> Vec<&str> {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("ttft_trace_cuda_kernel_launches_total{")
                    && l.contains(&format!("pod=\"{pod}\""))
            })
            .collect()
    };
    let greedy_sets = launches("greedy");
    eprintln!("greedy's series: {greedy_sets:#?}");
    let own: Vec<&&str> = greedy_sets
        .iter()
        .filter(|l| l.contains("comm=\"workload\""))
        .collect();
    let shared: Vec<&&str> = greedy_sets
        .iter()
        .filter(|l| l.contains("comm=\"_other\""))
        .collect();
    ensure!(
        own.len() == 2 && shared.len() == 1 && greedy_sets.len() == 3,
        "greedy: two own sets and its overflow set: {greedy_sets:#?}"
    );
    ensure!(
        shared[0].contains("namespace=\"serving\"") && shared[0].contains("container=\"\""),
        "{}",
        shared[0]
    );
    let quiet_sets = launches("quiet");
    ensure!(
        quiet_sets.len() == 1 && quiet_sets[0].contains("comm=\"workload\""),
        "quiet keeps its own set: {quiet_sets:#?}"
    );
    let exceeded = metric_total(
        &metrics,
        "ttft_trace_quota_exceeded_total{resource=\"label_sets\"}",
    );
    let overflowed = metric_total(&metrics, "ttft_trace_workload_label_overflows_total");
    ensure!(
        (exceeded, overflowed) == (1, 0),
        "quota exceeded {exceeded} (1), host cap overflows {overflowed} (0)"
    );
    let episodes = out.episodes();
    for c in &containers {
        let traced = episodes.iter().filter(|e| e.pid == c.pid).count();
        ensure!(
            traced == EPISODES as usize,
            "{traced} of {EPISODES} episodes"
        );
    }
    Ok(())
}
