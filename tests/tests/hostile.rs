//! Root-only: containers whose files are hostile do not turn the daemon.
//! Each container is a fixture workload in a mount namespace, root and
//! `kubepods/pod<uid>/<id>` cgroup made by the test, with no downward-API
//! variables, so the daemon reads the pod's claimed namespace from the
//! service-account file (a claim only: the labels are the host's record of
//! the pod UID, a pod log directory made by the test), which is:
//! - an absolute symlink to a file of the host (a canary);
//! - a FIFO (reading it would block the daemon);
//! - absent, while `/var/run -> /run` and the daemon's own root has the
//!   file (the daemon's own namespace must not be taken);
//! - `/dev/zero` (reading it never ends);
//! - a 1 GiB sparse file;
//! - and, as a control, a plain file naming a namespace.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use ttft_trace_tests::{
    container::{Container, ContainerRoot, PodCgroup, PodLogDir, View},
    fixtures::{self, Style, Variant, Workload, read_truth},
    tracer::{Tracer, http_get, root_test},
};

const NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
/// The daemon's own namespace file: absent on this host, made by the test.
const DAEMON_NAMESPACE_FILE: &str = "/run/secrets/kubernetes.io/serviceaccount/namespace";
const HOST_CANARY: &str = "canary-host-file";
const DAEMON_CANARY: &str = "canary-daemon-namespace";
const BIG_CANARY: &str = "canary-big-file";
const EPISODES: u32 = 30;

/// A file the test puts in the daemon's (the host's) root, removed on drop.
struct HostFile {
    path: PathBuf,
    /// The directories it created, innermost first.
    created: Vec<PathBuf>,
}

impl HostFile {
    fn create(path: &Path, content: &str) -> Result<Self> {
        if path.exists() {
            bail!("{} exists already; not touching it", path.display());
        }
        let mut created = Vec::new();
        let mut dir = path.parent();
        while let Some(d) = dir.filter(|d| !d.exists()) {
            created.push(d.to_path_buf());
            dir = d.parent();
        }
        std::fs::create_dir_all(path.parent().context("no parent")?)?;
        std::fs::write(path, content)?;
        Ok(Self {
            path: path.to_path_buf(),
            created,
        })
    }
}

impl Drop for HostFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        for d in &self.created {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// The namespace the host records for every pod of the test.
const HOST_NAMESPACE: &str = "serving";

/// One container of the test: its pod name (its hostname, and the host's
/// record), the namespace it must be read to claim ("": none), and the
/// container.
struct Case {
    pod: &'static str,
    namespace: &'static str,
    container: Container,
}

fn free_addr() -> Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// A container named `pod` (its /etc/hostname), its namespace file made by
/// `hostile`, running a workload stopped before its first CUDA call.
fn container(
    pod: &'static str,
    hostile: impl FnOnce(&mut ContainerRoot) -> Result<()>,
) -> Result<Container> {
    let mut root = ContainerRoot::new(pod, View::Bind)?;
    root.write("/etc/hostname", format!("{pod}\n"))?;
    hostile(&mut root)?;
    let w = Workload::new(Style::Sync)
        .variant(Variant::Linked)
        .episodes(EPISODES)
        .gap_us(5_000)
        .stop_before_work(true)
        .truth("/truth.jsonl");
    let c = root.spawn(&w, PodCgroup::new()?)?;
    fixtures::wait_stopped(c.pid).with_context(|| format!("container {pod}"))?;
    Ok(c)
}

#[test]
fn hostile_container_files_do_not_turn_the_daemon() -> Result<()> {
    let Some(_g) = root_test("hostile_container_files_do_not_turn_the_daemon") else {
        return Ok(());
    };
    let canary_path = fixtures::temp_path("canary", "txt");
    let _canary = HostFile::create(&canary_path, HOST_CANARY)?;
    let _daemon_ns = HostFile::create(Path::new(DAEMON_NAMESPACE_FILE), DAEMON_CANARY)?;
    let canary = canary_path.display().to_string();

    let mut cases = vec![
        Case {
            pod: "pod-symlink",
            namespace: "",
            container: container("pod-symlink", |r| r.symlink(&canary, NAMESPACE_FILE))?,
        },
        Case {
            pod: "pod-fifo",
            namespace: "",
            container: container("pod-fifo", |r| r.fifo(NAMESPACE_FILE))?,
        },
        Case {
            pod: "pod-varrun",
            namespace: "",
            container: container("pod-varrun", |r| {
                std::fs::create_dir_all(r.path("/run"))?;
                r.symlink("/run", "/var/run")
            })?,
        },
        Case {
            pod: "pod-zero",
            namespace: "",
            container: container("pod-zero", |r| {
                r.mount(
                    Path::new("/dev/zero"),
                    Path::new(NAMESPACE_FILE),
                    View::Bind,
                )
            })?,
        },
        Case {
            pod: "pod-big",
            namespace: "",
            container: container("pod-big", |r| {
                let p = r.write(NAMESPACE_FILE, BIG_CANARY)?;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)?
                    .set_len(1 << 30)?;
                Ok(())
            })?,
        },
        Case {
            pod: "pod-plain",
            namespace: "serving",
            container: container("pod-plain", |r| {
                r.write(NAMESPACE_FILE, "serving\n").map(drop)
            })?,
        },
    ];

    let logs = PodLogDir::new()?;
    for case in &cases {
        logs.add(HOST_NAMESPACE, case.pod, &case.container.cgroup.pod_uid)?;
    }
    let addr = free_addr()?;
    let args = logs.daemon_args(addr);
    let mut tracer = Tracer::start_daemon(&args)?;
    // Every container is found while stopped, before its first CUDA call.
    for case in &cases {
        tracer
            .wait_for_workload(case.container.pid)
            .with_context(|| format!("container {}", case.pod))?;
    }
    let before = http_get(addr, "/metrics")?;
    for case in &cases {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(case.container.pid as i32, libc::SIGCONT) };
    }
    for case in &mut cases {
        let st = case.container.wait(Duration::from_secs(60))?;
        assert!(st.success(), "container {} failed: {st}", case.pod);
    }
    tracer.wait_for_stderr("has exited", cases.len(), Duration::from_secs(10))?;
    let interrupted = Instant::now();
    let out = tracer.interrupt(Duration::from_secs(10))?;
    let exit_after = out.exited_at.duration_since(interrupted);
    assert!(out.success, "{}", out.stderr);
    // Detaching is the kernel's (about 100 ms per uprobe on 6.18): a child
    // holds the uprobes past the daemon's exit (tests/shutdown.rs checks it
    // ends), so the daemon itself exits within 2 s.
    let allowed = Duration::from_secs(2);
    eprintln!("daemon exited {exit_after:?} after SIGINT (allowed {allowed:?})");
    assert!(exit_after < allowed, "SIGINT took {exit_after:?}");

    let jsonl: String = out.lines.iter().map(|l| format!("{l}\n")).collect();
    for (what, text) in [
        ("/metrics", before.as_str()),
        ("the JSONL", jsonl.as_str()),
        ("the log", out.stderr.as_str()),
    ] {
        for needle in [HOST_CANARY, DAEMON_CANARY, BIG_CANARY] {
            assert!(!text.contains(needle), "{needle} in {what}:\n{text}");
        }
    }

    let episodes = out.episodes();
    let workloads = out.workload_lines();
    for case in &cases {
        let c = &case.container;
        // Read as the claim, and judged against the host's record.
        let w = workloads
            .iter()
            .find(|w| w.workload_pid == c.pid)
            .with_context(|| format!("no workload line of {}", case.pod))?;
        let claimed_namespace = (!case.namespace.is_empty()).then_some(case.namespace);
        assert_eq!(w.claimed_pod.as_deref(), Some(case.pod), "{w:?}");
        assert_eq!(w.claimed_namespace.as_deref(), claimed_namespace, "{w:?}");
        assert_eq!(w.claim_verdict.as_deref(), Some("matches"), "{w:?}");
        let line = before
            .lines()
            .find(|l| {
                l.starts_with("ttft_trace_cuda_kernel_launches_total{")
                    && l.contains(&format!("pod=\"{}\"", case.pod))
            })
            .with_context(|| format!("no series of {}:\n{before}", case.pod))?;
        assert!(
            line.contains(&format!("container=\"{}\"", &c.cgroup.container_id[..12])),
            "{line}"
        );
        assert!(
            line.contains(&format!("namespace=\"{HOST_NAMESPACE}\"")),
            "{line}"
        );
        let truth = read_truth(c.root.path("/truth.jsonl"))?;
        assert_eq!(truth.len(), EPISODES as usize, "{}", case.pod);
        let traced = episodes.iter().filter(|e| e.pid == c.pid).count();
        assert_eq!(
            traced,
            truth.len(),
            "every GPU episode of {} traced",
            case.pod
        );
    }
    Ok(())
}

/// A workload in a container whose fixture directory (the stub runtime
/// and driver) is shown as `view`, stopped before its first CUDA call.
fn viewing(name: &str, view: View) -> Result<Container> {
    let root = ContainerRoot::new(name, view)?;
    let w = Workload::new(Style::Sync)
        .variant(Variant::Linked)
        .episodes(EPISODES)
        .launches(3)
        .gap_us(5_000)
        .stop_before_work(true)
        .truth("/truth.jsonl");
    let c = root.spawn(&w, PodCgroup::new()?)?;
    fixtures::wait_stopped(c.pid).with_context(|| format!("container {name}"))?;
    Ok(c)
}

#[test]
fn one_set_of_probes_per_library_through_any_mount_namespace() -> Result<()> {
    let Some(_g) = root_test("one_set_of_probes_per_library_through_any_mount_namespace") else {
        return Ok(());
    };
    // The same two libraries through two overlays (each its own device
    // number, as container images show them) and a bind mount, each in its
    // own mount namespace.
    let mut containers = vec![
        viewing("overlay-a", View::Overlay)?,
        viewing("overlay-b", View::Overlay)?,
        viewing("bind", View::Bind)?,
    ];
    let mut tracer = Tracer::start_daemon(&[
        "--rescan-ms".into(),
        "200".into(),
        "--no-nvml".into(),
        "--interval".into(),
        "60".into(),
        "--comm".into(),
        "^workload$".into(),
    ])?;
    for c in &containers {
        tracer.wait_for_stderr(
            &format!("tracing workload pid {} ", c.pid),
            1,
            Duration::from_secs(20),
        )?;
    }
    for c in &containers {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(c.pid as i32, libc::SIGCONT) };
    }
    for c in &mut containers {
        let st = c.wait(Duration::from_secs(60))?;
        assert!(st.success(), "{st}");
    }
    tracer.wait_for_stderr("has exited", containers.len(), Duration::from_secs(10))?;
    let out = tracer.interrupt(Duration::from_secs(30))?;
    assert!(out.success, "{}", out.stderr);

    let attached: Vec<String> = out
        .attach_lines()
        .iter()
        .map(|a| a.library.display().to_string())
        .collect();
    for lib in [fixtures::STUB_CUDART, "libcuda.so.1"] {
        assert_eq!(
            attached.iter().filter(|p| p.ends_with(lib)).count(),
            1,
            "one set of probes on {lib}: {attached:?}"
        );
    }
    let episodes = out.episodes();
    for c in &containers {
        let truth = read_truth(c.root.path("/truth.jsonl"))?;
        let traced: Vec<_> = episodes.iter().filter(|e| e.pid == c.pid).collect();
        assert_eq!(traced.len(), truth.len(), "episodes of {}", c.pid);
        for (t, e) in truth.iter().zip(&traced) {
            assert_eq!(
                u64::from(e.kernel_launches),
                t.kernel_launches,
                "one event per call: {e:?}"
            );
        }
    }
    Ok(())
}
