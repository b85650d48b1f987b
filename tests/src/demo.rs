//! The demo inference server (`tests/demo/server.py`) and its load generator
//! (`tests/demo/loadgen.py`), driven from Rust tests.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::{
    container::{self, PodCgroup},
    fixtures::{self, ChildGuard},
    server_clock::Stamps,
    tracer::Tracer,
};

/// One streamed completion request of `max_tokens` for a prompt of
/// `prompt_tokens`, with the demo's fault switch `fault` when given, on a
/// connection that closes after it.
pub fn streamed_completion(prompt_tokens: u32, max_tokens: u32, fault: Option<&str>) -> String {
    let body = format!(
        r#"{{"model":"ttft-demo","prompt":"x","max_tokens":{max_tokens},"stream":true,"demo_prompt_tokens":{prompt_tokens}}}"#
    );
    let fault = fault.map(|f| format!("X-Demo-Fault: {f}\r\n"));
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         {}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        fault.unwrap_or_default(),
        body.len()
    )
}

fn demo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("demo")
}

/// A running demo server; killed on drop.
pub struct DemoServer {
    pub child: ChildGuard,
    pub port: u16,
    pub pid: u32,
    pub truth: PathBuf,
    /// The cgroups it ran in, where it has ones of its own: removed after
    /// the server (fields drop in order).
    pub cgroups: Vec<PodCgroup>,
}

impl DemoServer {
    /// Starts the server on a free port with the stub runtime and `extra`
    /// arguments, and returns once it listens.
    pub fn start(extra: &[&str]) -> Result<Self> {
        Self::start_in(extra, None)
    }

    /// A server started with no extra arguments, and the tracer attached
    /// to it (`--pid`, summaries every 60 s) once it follows its requests.
    pub fn traced() -> Result<(Self, Tracer)> {
        let server = Self::start(&[])?;
        let args = vec![
            "--pid".to_string(),
            server.pid.to_string(),
            "--interval".into(),
            "60".into(),
        ];
        let mut tracer = Tracer::start(&args, 0)?;
        tracer.wait_for_stderr("following requests on port", 1, Duration::from_secs(30))?;
        Ok((server, tracer))
    }

    /// As [`DemoServer::start`], in `cgroup` (from its first instruction,
    /// so that its listening socket is that cgroup's, as under a container
    /// runtime or a systemd unit).
    pub fn start_in(extra: &[&str], cgroup: Option<PodCgroup>) -> Result<Self> {
        Self::spawn(extra, cgroup, Place::Cgroup)
    }

    /// As [`DemoServer::start`], in the root cgroup whatever the test's is
    /// (its listening socket is the root cgroup's).
    pub fn start_in_root(extra: &[&str]) -> Result<Self> {
        Self::spawn(extra, None, Place::RootCgroup)
    }

    /// As [`DemoServer::start_in`], in a network namespace of its own
    /// (`unshare --net`, its loopback up; the same pid): reach it with
    /// [`loadgen_in`].
    pub fn start_in_netns(extra: &[&str], cgroup: Option<PodCgroup>) -> Result<Self> {
        Self::spawn(extra, cgroup, Place::Netns)
    }

    fn spawn(extra: &[&str], cgroup: Option<PodCgroup>, place: Place) -> Result<Self> {
        let truth = fixtures::temp_path("server-truth", "jsonl");
        let mut cmd = match place {
            Place::Netns => {
                let mut c = Command::new("unshare");
                c.args([
                    "--net",
                    "sh",
                    "-c",
                    r#"ip link set lo up && exec "$0" "$@""#,
                ]);
                c.arg("python3");
                c
            }
            _ => Command::new("python3"),
        };
        cmd.arg(demo_dir().join("server.py"))
            .args(["--port", "0", "--cudart"])
            .arg(fixtures::existing_fixture(fixtures::STUB_CUDART)?)
            .arg("--truth")
            .arg(&truth)
            // A 1 GB "model" (0.2 s) rather than the demo's 24 GB (2.5 s of
            // copies before it listens, at every start of every test); a test
            // about the load names its own size in `extra` (the last wins).
            .args(["--load-gb", "1"])
            .args(extra)
            .env("PYTHONUNBUFFERED", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(cgroup) = &cgroup {
            cgroup.place(&mut cmd)?;
        }
        if place == Place::RootCgroup {
            container::place_in_root_cgroup(&mut cmd)?;
        }
        let mut child = cmd.spawn().context("starting tests/demo/server.py")?;
        let pid = child.id();
        let stdout = child.stdout.take().context("server stdout")?;
        let guard = ChildGuard::new(child);
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let port = line
            .split("://127.0.0.1:")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|p| p.parse().ok())
            .with_context(|| format!("server did not say where it listens: {line:?}"))?;
        Ok(Self {
            child: guard,
            port,
            pid,
            truth,
            cgroups: cgroup.into_iter().collect(),
        })
    }

    /// Stops the server (SIGTERM: it flushes its truth log).
    pub fn stop(mut self) -> Result<PathBuf> {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.pid as i32, libc::SIGTERM) };
        self.child.wait_timeout(Duration::from_secs(20))?;
        Ok(self.truth.clone())
    }
}

/// Where [`DemoServer::spawn`] starts it besides its cgroup.
#[derive(PartialEq, Eq)]
enum Place {
    Cgroup,
    RootCgroup,
    Netns,
}

/// One request as the load generator measured it.
#[derive(Debug, Clone, Deserialize)]
pub struct ClientRequest {
    pub id: String,
    #[serde(default)]
    pub client_port: u16,
    #[serde(default)]
    pub req_on_conn: u32,
    #[serde(default)]
    pub concurrency: u32,
    #[serde(default)]
    pub ttft_s: Option<f64>,
    #[serde(default)]
    pub t_send: Option<u64>,
    #[serde(default)]
    pub t_first_token: Option<u64>,
    /// The client thread's run-queue delay across the recv that read its
    /// first token (its own schedstat): client time no wire event shows.
    #[serde(default)]
    pub first_token_runq_ns: Option<u64>,
    /// When the data of the recv that read the first token reached the
    /// client's socket (the kernel's receive timestamp, CLOCK_MONOTONIC):
    /// its read less this is the client's own delay in reading.
    #[serde(default)]
    pub t_first_token_arrived: Option<u64>,
    #[serde(default)]
    pub chunks: u64,
    /// Fault switches the request asked the demo server for.
    #[serde(default)]
    pub faults: Vec<String>,
    pub outcome: String,
}

/// Runs the load generator against `port` with `args`; returns its records.
pub fn loadgen(port: u16, args: &[&str]) -> Result<Vec<ClientRequest>> {
    run_loadgen(Command::new("python3"), port, args)
}

/// As [`loadgen`], in the network namespace of process `pid` (a server
/// started by [`DemoServer::start_in_netns`]).
pub fn loadgen_in(pid: u32, port: u16, args: &[&str]) -> Result<Vec<ClientRequest>> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/proc/{pid}/ns/net")).arg("python3");
    run_loadgen(cmd, port, args)
}

fn run_loadgen(mut cmd: Command, port: u16, args: &[&str]) -> Result<Vec<ClientRequest>> {
    let out = fixtures::temp_path("loadgen", "jsonl");
    let status = cmd
        .arg(demo_dir().join("loadgen.py"))
        .args(["--port", &port.to_string()])
        .args(args)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .status()
        .context("running tests/demo/loadgen.py")?;
    if !status.success() {
        bail!("loadgen failed: {status}");
    }
    let records = read_jsonl(&out)?;
    let _ = std::fs::remove_file(&out);
    Ok(records)
}

pub fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("bad line {l:?}")))
        .collect()
}

/// The demo server's own CLOCK_MONOTONIC stamps of each request it answered
/// with body, from its truth log (`--truth`, tests/demo/README.md):
/// `t_arrive` (the return of the recv that brought its first bytes) and
/// `t_first_body_send_start` (just before the first send of body: the first
/// token, or the chat role chunk before it, as the tracer's first token).
pub fn server_stamps(truth: &Path) -> Result<Vec<Stamps>> {
    #[derive(Deserialize)]
    struct Truth {
        conn_port: u64,
        conn_seq: u64,
        t_arrive: u64,
        t_first_body_send_start: Option<u64>,
    }
    Ok(read_jsonl::<Truth>(truth)?
        .into_iter()
        .filter_map(|t| {
            Some(Stamps {
                key: (t.conn_port, t.conn_seq),
                read_ns: t.t_arrive,
                send_ns: t.t_first_body_send_start?,
            })
        })
        .collect())
}
