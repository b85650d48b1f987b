//! A tenant that takes more than its share of the host
//! (`fixtures/greedy_tenant.py`): traced by the daemon (it maps the stub
//! CUDA runtime), it opens listening sockets or starts threads when told.

use std::{
    io::{BufRead, BufReader, Lines, Write},
    process::{ChildStdin, ChildStdout, Command, Stdio},
};

use anyhow::{Context as _, Result, ensure};

use crate::{
    container::PodCgroup,
    demo::{ClientRequest, DemoServer, loadgen_in},
    fixtures::{self, ChildGuard},
    tracer::{TraceOutput, Tracer},
};

/// Eight requests (16 connections' worth, as `loadgen.py` counts them)
/// to `server` in its network namespace, then 300 ms for the daemon to
/// read their last events.
pub fn eight_requests_in(server: &DemoServer) -> Result<Vec<ClientRequest>> {
    let clients = loadgen_in(
        server.pid,
        server.port,
        &["--requests", "8", "--output-tokens", "4"],
    )?;
    std::thread::sleep(std::time::Duration::from_millis(300));
    Ok(clients)
}

/// Stops `server`, then the daemon (`tracer`, by SIGINT, which must end
/// well): what it wrote, and how many requests it traced on the server's
/// port.
pub fn stop_server_and_daemon(server: DemoServer, tracer: Tracer) -> Result<(TraceOutput, usize)> {
    let port = server.port;
    server.stop()?;
    let out = tracer.interrupt(std::time::Duration::from_secs(30))?;
    ensure!(out.success, "{}", out.stderr);
    let traced = out
        .lines
        .iter()
        .filter(|l| l["type"] == "request" && l["server_port"] == port)
        .count();
    Ok((out, traced))
}

pub struct GreedyTenant {
    pub pid: u32,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    /// Killed before its cgroup is removed (fields drop in order).
    _child: ChildGuard,
    _cgroup: PodCgroup,
}

impl GreedyTenant {
    /// Starts it in `cgroup`, from its first instruction; returns once it
    /// has mapped the runtime.
    pub fn start(cgroup: PodCgroup) -> Result<Self> {
        let mut cmd = Command::new("python3");
        cmd.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/greedy_tenant.py"
        ))
        .arg(fixtures::existing_fixture(fixtures::STUB_CUDART)?)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        cgroup.place(&mut cmd)?;
        let mut child = cmd.spawn().context("starting greedy_tenant.py")?;
        let stdin = child.stdin.take().context("its stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("its stdout")?).lines();
        let mut tenant = Self {
            pid: child.id(),
            stdin,
            stdout,
            _child: ChildGuard::new(child),
            _cgroup: cgroup,
        };
        tenant.answer("ready")?;
        Ok(tenant)
    }

    /// The UID of its pod.
    pub fn pod_uid(&self) -> &str {
        &self._cgroup.pod_uid
    }

    /// Sends `command` (`listen N`, `threads N`, `close`) and waits until
    /// it is done.
    pub fn order(&mut self, command: &str) -> Result<()> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        self.answer(command.split(' ').next().unwrap_or(command))
    }

    fn answer(&mut self, word: &str) -> Result<()> {
        let line = self.stdout.next().context("greedy_tenant.py ended")??;
        ensure!(line.starts_with(word), "greedy_tenant.py said {line:?}");
        Ok(())
    }
}
