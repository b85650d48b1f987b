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
    fixtures::{self, ChildGuard},
};

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
