//! Root-only: pod churn exhausts nothing (issue 28, "every per-target entry
//! goes when its target goes"). With the daemon running host-wide, the test
//! makes a couple of thousand short-lived pods the way the kubelet lays out
//! their cgroups (`kubepods/besteffort/pod<uid>/<container id>`, cgroup v2),
//! each a process in a network namespace of its own that maps the stub CUDA
//! runtime, runs a few GPU episodes while holding a listening socket, and
//! exits; each cgroup is removed once its process is gone. Then every table
//! the daemon keeps per target must be back at its baseline: the entries of
//! its hash kernel maps (`bpftool map dump`), its links (`bpftool link`),
//! its descriptors and threads, its gauges (workloads, processes, followed
//! listeners, targets set aside, `ttft_trace_table_entries{table}`), and the
//! cgroups the kernel keeps dying for it; nothing counted as refused,
//! evicted or lost; and a new server in a new pod is traced, every request.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    os::unix::process::CommandExt,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;
use ttft_trace_tests::{
    container::PodCgroup,
    demo::DemoServer,
    fixtures::{Style, Workload},
    tenant::{eight_requests_in, stop_server_and_daemon},
    tracer::{Tracer, http_get, metric_total, pod_daemon_args, root_test},
};

/// Pods made, and how many live at once.
const PODS: usize = 1500;
const AT_ONCE: usize = 64;
/// Where the churn's pods live: the daemon traces only these.
const PREFIX: &str = "/kubepods/besteffort";

/// A figure of the daemon's: name -> value. Names that start with `=`
/// must return to their baseline; the others are shown.
type Snapshot = BTreeMap<String, u64>;

fn bpftool(args: &[&str]) -> Result<Value> {
    let out = Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .context("running bpftool")?;
    ensure!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// What descriptor `fd` of `pid` is: its link target with every run of
/// digits as `N` (`socket:[N]`, `anon_inode:bpf-map`, a file's path).
fn descriptor_kind(pid: u32, fd: &str) -> String {
    let target = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
        .map_or("?".into(), |t| t.display().to_string());
    let mut kind = String::new();
    for c in target.chars() {
        if !c.is_ascii_digit() {
            kind.push(c);
        } else if !kind.ends_with('N') {
            kind.push('N');
        }
    }
    kind
}

/// A field of `/proc/PID/fdinfo/FD`.
fn fdinfo(pid: u32, fd: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// The daemon's descriptors by kind, the entries of every hash map (plain
/// or LRU) it holds, its BPF links by type, and its threads.
fn kernel_side(pid: u32, s: &mut Snapshot) -> Result<()> {
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    let mut maps = std::collections::BTreeSet::new();
    for fd in &fds {
        let kind = descriptor_kind(pid, fd);
        if kind == "anon_inode:bpf-map" {
            if let Some(id) = fdinfo(pid, fd, "map_id") {
                maps.insert(id);
            }
        } else if kind == "anon_inode:bpf_link" {
            let t = fdinfo(pid, fd, "link_type").unwrap_or_default();
            *s.entry(format!("=links {t}")).or_default() += 1;
        }
        *s.entry(format!("=descriptors {kind}")).or_default() += 1;
    }
    for id in maps {
        let map = bpftool(&["map", "show", "id", &id])?;
        let kind = map["type"].as_str().unwrap_or_default();
        if !kind.contains("hash") {
            continue;
        }
        let name = map["name"].as_str().unwrap_or("?");
        let n = bpftool(&["map", "dump", "id", &id])?
            .as_array()
            .map_or(0, Vec::len) as u64;
        // LRU maps are bounded by their eviction (they hold the recent
        // past, gone targets included): shown, not required back.
        let mark = if kind.starts_with("lru") { "" } else { "=" };
        s.insert(format!("{mark}map {name}"), n);
    }
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    s.insert("=threads".into(), threads as u64);
    Ok(())
}

/// Gauges of /metrics that count per-target entries, and the counters of
/// what was refused or dropped.
fn gauges(addr: SocketAddr, s: &mut Snapshot) -> Result<()> {
    let text = http_get(addr, "/metrics")?;
    for name in [
        "ttft_trace_workloads",
        "ttft_trace_traced_processes",
        "ttft_trace_listeners_followed",
        "ttft_trace_targets_set_aside",
        "ttft_trace_target_reads_stuck_threads",
    ] {
        s.insert(format!("={name}"), metric_total(&text, name));
    }
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value = value.parse::<f64>().unwrap_or(0.0) as u64;
        if series.starts_with("ttft_trace_table_entries{")
            || series.starts_with("ttft_trace_table_evictions_total{")
        {
            s.insert(format!("={series}"), value);
        }
        for dropped in [
            "ttft_trace_table_evictions_total",
            "ttft_trace_map_full_total",
            "ttft_trace_quota_exceeded_total",
            "ttft_trace_workload_label_overflows_total",
            "ttft_trace_events_lost_total",
            "ttft_trace_target_reads_overdue_total",
        ] {
            if series.starts_with(dropped) {
                *s.entry(format!("!{dropped}")).or_default() += value;
            }
        }
    }
    Ok(())
}

/// Cgroups removed whose memory the kernel still holds, below the churn's
/// parent (something holding a removed cgroup keeps it dying).
fn dying_cgroups(s: &mut Snapshot) -> Result<()> {
    let stat = ttft_trace_tests::container::cgroup2_root()?
        .join(PREFIX.trim_start_matches('/'))
        .join("cgroup.stat");
    let text = std::fs::read_to_string(&stat).unwrap_or_default();
    let n = text
        .lines()
        .find_map(|l| l.strip_prefix("nr_dying_descendants "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    s.insert("dying cgroups".into(), n);
    Ok(())
}

fn snapshot(pid: u32, addr: SocketAddr) -> Result<Snapshot> {
    let mut s = Snapshot::new();
    kernel_side(pid, &mut s)?;
    gauges(addr, &mut s)?;
    dying_cgroups(&mut s)?;
    Ok(s)
}

/// The figures that must return and are still above `base` (+`slack` for
/// descriptors and threads, which the daemon's workers open and end).
fn above(base: &Snapshot, now: &Snapshot) -> Vec<String> {
    now.iter()
        .filter(|(k, _)| k.starts_with('=') && !k.contains("library_files"))
        .filter_map(|(k, &v)| {
            let b = base.get(k).copied().unwrap_or(0);
            let slack = if k.starts_with("=descriptors") || k == "=threads" {
                4
            } else {
                0
            };
            (v > b + slack).then(|| format!("{k}: {b} -> {v}"))
        })
        .collect()
}

/// One pod: its cgroup, and its process (the stub runtime mapped, a few
/// episodes 100 ms apart, a listening socket of its own network namespace
/// held as descriptor 3).
struct Pod {
    child: Child,
    cgroup: PodCgroup,
}

fn start_pod() -> Result<Pod> {
    let cgroup = PodCgroup::besteffort()?;
    let mut cmd: Command = Workload::new(Style::Sync)
        .episodes(10)
        .launches(1)
        .kernel_us(10)
        .gap_us(100_000)
        .command();
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    cgroup.place(&mut cmd)?;
    // SAFETY: only system calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let s = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            let addr = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: 0,
                sin_addr: libc::in_addr { s_addr: 0 },
                sin_zero: [0; 8],
            };
            if s < 0
                || libc::bind(
                    s,
                    (&raw const addr).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as u32,
                ) != 0
                || libc::listen(s, 1) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().context("starting a pod's workload")?;
    Ok(Pod { child, cgroup })
}

/// Runs `PODS` pods, `AT_ONCE` at a time; returns their pod UIDs and the
/// daemon's figures taken halfway.
fn churn(pid: u32, addr: SocketAddr) -> Result<(Vec<String>, Snapshot)> {
    let mut live: Vec<Pod> = Vec::new();
    let (mut started, mut uids, mut halfway) = (0, Vec::new(), Snapshot::new());
    while started < PODS || !live.is_empty() {
        while started < PODS && live.len() < AT_ONCE {
            let pod = start_pod()?;
            uids.push(pod.cgroup.pod_uid.clone());
            live.push(pod);
            started += 1;
            if started == PODS / 2 {
                halfway = snapshot(pid, addr)?;
            }
        }
        let mut i = 0;
        while i < live.len() {
            if live[i].child.try_wait()?.is_some() {
                // Its cgroup removed on drop, the process gone.
                drop(live.swap_remove(i));
            } else {
                i += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok((uids, halfway))
}

#[test]
fn thousands_of_short_lived_pods_leave_nothing_behind() -> Result<()> {
    let Some(_g) = root_test("thousands_of_short_lived_pods_leave_nothing_behind") else {
        return Ok(());
    };
    let started = Instant::now();
    // Keeps the churn's parent cgroup while the test runs; the new server's.
    let keeper = PodCgroup::besteffort()?;
    ensure!(
        Path::new(&keeper.dir).exists(),
        "no pod cgroup {}",
        keeper.dir.display()
    );
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut args = pod_daemon_args(addr, PREFIX);
    args.extend(
        [
            // A day of churn in a minute: label sets retire after 1 s, not
            // 300 (those of 1500 pods within 300 s would be past the cap).
            "--retire-after",
            "1",
            // The probes of a library no traced process maps go after 1 s,
            // not 60.
            "--detach-unmapped",
            "1",
            // Live pods (64) and those ended within the grace: past 100
            // sets they would share comm="_other" (counted).
            "--max-label-sets",
            "400",
        ]
        .map(String::from),
    );
    let mut tracer = Tracer::start_daemon(&args)?;
    let pid = tracer.pid().context("the daemon's pid")?;
    std::thread::sleep(Duration::from_millis(500));
    let base = snapshot(pid, addr)?;

    let t0 = Instant::now();
    let (uids, halfway) = churn(pid, addr)?;
    let churned = t0.elapsed();
    let t_end = Instant::now();
    let mut now = snapshot(pid, addr)?;
    while !above(&base, &now).is_empty() && t_end.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(200));
        now = snapshot(pid, addr)?;
    }
    let recovered = t_end.elapsed();
    eprintln!("{PODS} pods ({AT_ONCE} at once) in {churned:?}; back {recovered:?} after the last");
    eprintln!(
        "{:<60} {:>9} {:>9} {:>9}",
        "figure", "baseline", "halfway", "after"
    );
    let keys: std::collections::BTreeSet<&String> = base
        .keys()
        .chain(halfway.keys())
        .chain(now.keys())
        .collect();
    for k in keys {
        let g = |s: &Snapshot| s.get(k).map_or("-".into(), u64::to_string);
        eprintln!("{k:<60} {:>9} {:>9} {:>9}", g(&base), g(&halfway), g(&now));
    }
    let left = above(&base, &now);
    if !left.is_empty() {
        for l in http_get(addr, "/metrics")?
            .lines()
            .filter(|l| l.starts_with("ttft_trace_gpu_episodes_total{"))
        {
            eprintln!("  left: {l}");
        }
    }
    // Label sets past the cap share comm="_other": what the cap says (the
    // sets of live pods and of those ended within the grace); the new
    // server below must get its own.
    let dropped: Vec<String> = now
        .iter()
        .filter(|(k, _)| !k.contains("label_overflows"))
        .filter(|(k, v)| k.starts_with('!') && **v > base.get(*k).copied().unwrap_or(0))
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let dying = now.get("dying cgroups").copied().unwrap_or(0);

    // A new server in a new pod, after all that: traced, every request.
    let keeper_uid = keeper.pod_uid.clone();
    let server =
        DemoServer::start_in_netns(&["--output-tokens", "4", "--load-gb", "1"], Some(keeper))?;
    tracer.wait_for_workload(server.pid)?;
    tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(10))?;
    let clients = eight_requests_in(&server)?;
    let server_pid = server.pid;
    let (out, traced) = stop_server_and_daemon(server, tracer)?;
    let workloads = out.workload_lines();
    let seen: std::collections::BTreeSet<&str> = workloads
        .iter()
        .filter_map(|w| w.pod_uid.as_deref())
        .filter(|p| uids.iter().any(|u| u == p))
        .collect();
    let announced = out.stderr.matches("tracing workload pid").count();
    let no_pod = workloads.iter().filter(|w| w.pod_uid.is_none()).count();
    eprintln!(
        "workloads traced {announced} ({no_pod} named without a pod: gone before it was \
         read); pods traced {} of {PODS}; the new server: {traced} of {} requests traced; \
         dying cgroups {dying}; test {:?}",
        seen.len(),
        clients.len(),
        started.elapsed()
    );
    let named = workloads
        .iter()
        .find(|w| w.workload_pid == server_pid)
        .map(|w| (w.workload.pod.clone(), w.workload.comm.clone()));
    eprintln!("the new server named {named:?}");
    ensure!(left.is_empty(), "not back to the baseline: {left:?}");
    ensure!(
        named
            .as_ref()
            .is_some_and(|(pod, comm)| *pod == keeper_uid && comm != "_other"),
        "the new server's labels: {named:?}"
    );
    ensure!(dropped.is_empty(), "counted as dropped: {dropped:?}");
    // Some exit before the daemon finds them (a 1 s life, a loaded host);
    // a quarter at least, or the churn did not reach the daemon.
    ensure!(
        seen.len() * 4 >= PODS,
        "only {} of {PODS} pods traced",
        seen.len()
    );
    ensure!(
        traced == clients.len() && traced == 16,
        "{traced} of {} traced",
        clients.len()
    );
    Ok(())
}
