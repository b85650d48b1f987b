//! Running the real `ttft-trace` binary against fixtures, for the root-only
//! tests: locating (or building) it, skipping when not root, and reading its
//! JSONL output (whose lines `ttft_trace::jsonl_schema` defines).

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Mutex, MutexGuard, mpsc},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::de::DeserializeOwned;
use ttft_trace::jsonl_schema::{Attach, Episode, Request, Totals, WorkloadLine, kind};

/// What the tracer's line for a library whose uprobes are in place holds
/// ("[INFO  ttft_trace::export] attached 11 probes to PATH"): the message
/// begins with it. A bare "attached" also matched other lines (the probe
/// log's "... are not attached" under `--sched sampled` did): a workload
/// continued on one ran before its uprobes, and its first episodes, or the
/// whole of a short one, were missed.
pub const ATTACHED: &str = "] attached ";

/// Tracer tests run one at a time: they measure timing on a 2-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the lock for one tracer test; None (with the reason printed) when
/// the test cannot run here because we are not root.
pub fn root_test(name: &str) -> Option<MutexGuard<'static, ()>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        crate::skip_or_fail(
            name,
            "needs root (loads eBPF programs and attaches uprobes)",
        );
        return None;
    }
    Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The `ttft-trace` binary of this build profile, built if missing.
pub fn tracer_bin() -> Result<PathBuf> {
    let target = crate::fixtures::fixture_dir()
        .parent()
        .map(PathBuf::from)
        .context("fixture dir has no parent")?;
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let bin = target.join(profile).join("ttft-trace");
    if !bin.is_file() {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut c = Command::new(cargo);
        c.args(["build", "-p", "ttft-trace"]);
        if profile == "release" {
            c.arg("--release");
        }
        let status = c.status().context("running cargo build -p ttft-trace")?;
        if !status.success() {
            bail!("cargo build -p ttft-trace failed");
        }
    }
    Ok(bin)
}

/// A running tracer; killed on drop if still running.
pub struct Tracer {
    child: Option<Child>,
    stderr: mpsc::Receiver<String>,
    pub stderr_lines: Vec<String>,
    pub jsonl: PathBuf,
}

/// What a finished tracer left.
#[derive(Debug)]
pub struct TraceOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    pub lines: Vec<serde_json::Value>,
    /// When the tracer process exited (its `ttft-detach` child, which holds
    /// the uprobes while the kernel removes them, was waited for after).
    pub exited_at: Instant,
}

impl TraceOutput {
    /// The lines of kind `k` (see `jsonl_schema::kind`) as the schema's
    /// type for them; a line of that kind that does not read as it fails
    /// the test.
    fn lines_of<T: DeserializeOwned>(&self, k: &str) -> Vec<T> {
        self.lines
            .iter()
            .filter(|l| l["type"] == k)
            .map(|l| T::deserialize(l).unwrap_or_else(|e| panic!("{k} line {l}: {e}")))
            .collect()
    }

    pub fn episodes(&self) -> Vec<Episode> {
        self.lines_of(kind::EPISODE)
    }

    pub fn requests(&self) -> Vec<Request> {
        self.lines_of(kind::REQUEST)
    }

    /// The first totals line.
    pub fn totals(&self) -> Option<Totals> {
        self.lines_of(kind::TOTALS).into_iter().next()
    }

    pub fn attach_lines(&self) -> Vec<Attach> {
        self.lines_of(kind::ATTACH)
    }

    /// The workloads followed: their labels and what they claim.
    pub fn workload_lines(&self) -> Vec<WorkloadLine> {
        self.lines_of(kind::WORKLOAD)
    }

    /// Panics unless a library whose path contains `name` was attached.
    pub fn assert_attached(&self, name: &str) {
        let libs: Vec<String> = self
            .attach_lines()
            .iter()
            .map(|a| a.library.display().to_string())
            .collect();
        assert!(
            libs.iter().any(|l| l.contains(name)),
            "{name} not in {libs:?}"
        );
    }
}

impl Tracer {
    /// Starts `ttft-trace attach` with `args` (plus --jsonl and --no-listen
    /// unless a --listen is given) and waits until it reports `ready_after`
    /// [`ATTACHED`] lines (0: do not wait): one per library, when its
    /// uprobes are in place.
    pub fn start(args: &[String], ready_after: usize) -> Result<Self> {
        Self::start_with_env(args, ready_after, &[])
    }

    /// As [`Tracer::start`], with `env` set for the tracer (its switches,
    /// such as `TTFT_TRACE_EVENT_HOOK`).
    pub fn start_with_env(
        args: &[String],
        ready_after: usize,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let mut t = Self::spawn("attach", args, env)?;
        if ready_after > 0 {
            t.wait_for_stderr(ATTACHED, ready_after, Duration::from_secs(30))?;
            // Attach lines are logged as each library is done; give the last
            // one's uprobes a moment to be installed in the target.
            thread::sleep(Duration::from_millis(50));
        }
        Ok(t)
    }

    /// Starts `ttft-trace daemon` with `args` (plus --jsonl and --no-listen
    /// unless a --listen is given) and waits until its first scan is done.
    pub fn start_daemon(args: &[String]) -> Result<Self> {
        Self::start_daemon_with_env(args, &[])
    }

    /// As [`Tracer::start_daemon`], with `env` set for the daemon.
    pub fn start_daemon_with_env(args: &[String], env: &[(&str, &str)]) -> Result<Self> {
        let mut t = Self::spawn("daemon", args, env)?;
        t.wait_for_stderr("daemon:", 1, Duration::from_secs(30))?;
        Ok(t)
    }

    fn spawn(subcommand: &str, args: &[String], env: &[(&str, &str)]) -> Result<Self> {
        let jsonl = crate::fixtures::temp_path("trace", "jsonl");
        let mut c = Command::new(tracer_bin()?);
        c.arg(subcommand).args(args).arg("--jsonl").arg(&jsonl);
        c.envs(env.iter().copied());
        if !args.iter().any(|a| a == "--listen") {
            c.arg(if subcommand == "daemon" {
                "--listen="
            } else {
                "--no-listen"
            });
        }
        let (child, rx) = spawn_piped(&mut c)?;
        Ok(Self {
            child: Some(child),
            stderr: rx,
            stderr_lines: Vec::new(),
            jsonl,
        })
    }

    /// Waits until the daemon says it traces the workload rooted at `pid`.
    pub fn wait_for_workload(&mut self, pid: u32) -> Result<()> {
        self.wait_for_stderr(
            &format!("tracing workload pid {pid} "),
            1,
            Duration::from_secs(20),
        )
    }

    /// Waits until `n` stderr lines contain `needle`.
    pub fn wait_for_stderr(&mut self, needle: &str, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self
                .stderr_lines
                .iter()
                .filter(|l| l.contains(needle))
                .count()
                >= n
            {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) => self.stderr_lines.push(line),
                Err(_) => bail!(
                    "tracer did not print {n} x {needle:?} in {timeout:?}; stderr so far:\n{}",
                    self.stderr_lines.join("\n")
                ),
            }
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Waits for the tracer to exit (it does when its target exits).
    pub fn finish(mut self, timeout: Duration) -> Result<TraceOutput> {
        let mut child = self.child.take().context("already finished")?;
        let deadline = Instant::now() + timeout;
        while child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                while let Ok(line) = self.stderr.recv_timeout(Duration::from_millis(200)) {
                    self.stderr_lines.push(line);
                }
                bail!(
                    "tracer did not exit within {timeout:?}; stderr:\n{}",
                    self.stderr_lines.join("\n")
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
        let exited_at = Instant::now();
        let out = child.wait_with_output()?;
        while let Ok(line) = self.stderr.recv_timeout(Duration::from_millis(200)) {
            self.stderr_lines.push(line);
        }
        // As a service manager waits for the unit's cgroup: the next test's
        // tracer would otherwise start while the kernel still removes these
        // uprobes (under the mutex that reading tracefs and creating uprobes
        // take), and miss the start of its workload.
        wait_for_detach(&self.stderr_lines)?;
        let text = std::fs::read_to_string(&self.jsonl).unwrap_or_default();
        let lines = text
            .lines()
            .map(|l| serde_json::from_str(l).with_context(|| format!("bad JSONL line {l:?}")))
            .collect::<Result<Vec<_>>>()?;
        let _ = std::fs::remove_file(&self.jsonl);
        Ok(TraceOutput {
            exited_at,
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: self.stderr_lines.join("\n"),
            lines,
        })
    }

    /// Sends SIGINT (as Ctrl-C would) and waits for the exit.
    pub fn interrupt(self, timeout: Duration) -> Result<TraceOutput> {
        if let Some(pid) = self.pid() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(pid as i32, libc::SIGINT) };
        }
        self.finish(timeout)
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Daemon arguments for the tests' pods: /metrics on `listen`, a scan
/// every 200 ms, no NVML, no interval report, and only the processes in
/// cgroups under `cgroup_prefix` (the test's pods: not another test's
/// servers on this host).
pub fn pod_daemon_args(listen: std::net::SocketAddr, cgroup_prefix: &str) -> Vec<String> {
    scan_args(listen, ["--cgroup-prefix", cgroup_prefix])
}

/// Daemon arguments for the fixture workloads: /metrics on `listen`, a
/// /proc scan every 200 ms, no NVML, no interval report, and only processes
/// named `workload` (other CUDA processes on the host stay out).
pub fn workload_daemon_args(listen: std::net::SocketAddr) -> Vec<String> {
    scan_args(listen, ["--comm", "^workload$"])
}

/// /metrics on `listen`, a scan every 200 ms, no NVML, no interval report,
/// and the `filter` flag with its value.
fn scan_args(listen: std::net::SocketAddr, filter: [&str; 2]) -> Vec<String> {
    let mut args: Vec<String> = ["--listen", &listen.to_string(), "--rescan-ms", "200"]
        .map(String::from)
        .into();
    args.extend(["--no-nvml", "--interval", "60"].map(String::from));
    args.extend(filter.map(String::from));
    args
}

/// Spawns `c` with stdout and stderr piped; its stderr lines arrive on the
/// receiver as they are written.
pub fn spawn_piped(c: &mut Command) -> Result<(Child, mpsc::Receiver<String>)> {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting ttft-trace")?;
    let err = child.stderr.take().context("stderr")?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok((child, rx))
}

/// Runs `ttft-trace` to completion with `args` and returns (success, stderr):
/// for the error cases.
pub fn run_tracer(args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new(tracer_bin()?)
        .args(args)
        .output()
        .context("running ttft-trace")?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// GET `path` over plain HTTP/1.1 (the tracer's /metrics).
/// The sum of the series of the metric `name` over their labels, in a
/// Prometheus text exposition.
pub fn metric_total(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Waits until the tracer serving /metrics on `listen` has judged at least
/// `n` requests (`ttft_trace_requests_total`).
pub fn wait_for_requests(listen: std::net::SocketAddr, n: usize, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = metric_total(&http_get(listen, "/metrics")?, "ttft_trace_requests_total");
        if seen >= n as u64 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the tracer judged {seen} of {n} requests in {timeout:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

pub fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

/// Waits until the `ttft-detach` child named in the tracer's log
/// (`… in the background (process P, …`) is gone; at most 60 s.
pub fn wait_for_detach(stderr_lines: &[String]) -> Result<()> {
    let Some(pid) = stderr_lines.iter().find_map(|l| {
        let rest = l.split("in the background (process ").nth(1)?;
        rest.split(',').next()?.parse::<u32>().ok()
    }) else {
        return Ok(());
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        if Instant::now() > deadline {
            bail!(
                "ttft-detach {pid} still there after 60 s\n{}",
                process_state(pid)
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// What the kernel says of a process that does not end: its state line,
/// where it sleeps, its kernel stack and how many descriptors it holds,
/// so a failure tells which wait it is stuck in.
fn process_state(pid: u32) -> String {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{f}"))
            .unwrap_or_else(|e| format!("({f}: {e})"))
    };
    let state = read("status")
        .lines()
        .filter(|l| l.starts_with("State:") || l.starts_with("PPid:"))
        .collect::<Vec<_>>()
        .join(", ");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    format!(
        "{state}, wchan {}, {fds} descriptors, kernel stack:\n{}",
        read("wchan"),
        read("stack")
    )
}

/// A uprobe program (kprobe type) a process holds, as the kernel's fdinfo
/// of its descriptor tells it.
pub struct UprobeProgram {
    pub id: u64,
    /// Runs counted while run statistics are on (`BPF_ENABLE_STATS`).
    pub run_cnt: u64,
}

/// The uprobe programs process `pid` holds.
pub fn uprobe_program_infos(pid: u32) -> Result<Vec<UprobeProgram>> {
    let mut progs = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let fd = fd?;
        let is_prog = std::fs::read_link(fd.path())
            .is_ok_and(|l| l.to_string_lossy() == "anon_inode:bpf-prog");
        if !is_prog {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ))?;
        let field = |name: &str| -> Option<u64> {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?
                .trim()
                .parse()
                .ok()
        };
        // BPF_PROG_TYPE_KPROBE, which uprobe programs are.
        if field("prog_type") == Some(2)
            && let Some(id) = field("prog_id")
        {
            progs.push(UprobeProgram {
                id,
                run_cnt: field("run_cnt").unwrap_or(0),
            });
        }
    }
    anyhow::ensure!(!progs.is_empty(), "process {pid} holds no uprobe program");
    Ok(progs)
}

/// The ids of the uprobe programs process `pid` holds.
pub fn uprobe_programs(pid: u32) -> Result<std::collections::BTreeSet<u64>> {
    Ok(uprobe_program_infos(pid)?.iter().map(|p| p.id).collect())
}

/// BPF links of the uprobes of `programs` (see [`uprobe_programs`]) on this
/// host, however their holder ended (a `ttft-detach` child holds them past
/// the tracer's exit): perf-event links with one of those programs, from
/// `bpftool` (installed by `cargo xtask setup`). Another tracer on the host
/// does not count.
pub fn uprobe_links(programs: &std::collections::BTreeSet<u64>) -> Result<usize> {
    let out = Command::new("bpftool")
        .args(["link", "show", "--json"])
        .output()
        .context("bpftool")?;
    anyhow::ensure!(out.status.success(), "bpftool link show failed");
    let links: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(links
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| l["type"] == "perf_event")
        .filter(|l| {
            l["prog_id"]
                .as_u64()
                .is_some_and(|id| programs.contains(&id))
        })
        .count())
}
