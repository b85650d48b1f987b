//! What the tests of real server stacks share (`tests/tests/stacks.rs`,
//! `tests/tests/grpc.rs`, `tests/tests/tls.rs`): where the stacks' programs
//! and their venv are, a server's process group, waiting for a server to
//! listen, and how late a client's read of a first token may come.

use std::{
    net::TcpStream,
    os::unix::process::CommandExt as _,
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::fixtures::cache_dir;

/// A client's read of the first token after the server's send of it, over
/// a stack's requests: at most this at the median and at P99 (the HTTP/1.1
/// matrix's bounds; why these, in `tests/tests/stacks.rs`).
pub const CLIENT_READ_P50_MS: f64 = 3.0;
pub const CLIENT_READ_P99_MS: f64 = 10.0;

/// `tests/stacks`: the stacks' apps, clients and requirements.
pub fn stacks_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("stacks")
}

/// Waits up to 30 s for something to listen on `port` of 127.0.0.1;
/// `exited` says whether the server ended first (an error then).
pub fn wait_listening(
    port: u16,
    mut exited: impl FnMut() -> std::io::Result<Option<ExitStatus>>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(st) = exited()? {
            bail!("the server exited before listening on {port}: {st}");
        }
        ensure!(Instant::now() < deadline, "nothing listens on {port}");
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The stacks' venv's Python (`cargo xtask setup` makes it).
pub fn venv_python() -> PathBuf {
    cache_dir().join("stacks-venv/bin/python")
}

/// Whether `cargo xtask setup` installed tests/stacks/requirements.txt.
pub fn venv_ready() -> Result<(), String> {
    let stamp = cache_dir().join("stacks-venv/requirements.installed");
    let want = std::fs::read_to_string(stacks_dir().join("requirements.txt"))
        .map_err(|e| format!("tests/stacks/requirements.txt: {e}"))?;
    match std::fs::read_to_string(&stamp) {
        Ok(have) if have == want => Ok(()),
        _ => Err(format!(
            "the stacks' venv ({}) is missing or stale: run `cargo xtask setup`",
            stamp.display()
        )),
    }
}

/// A server and all its processes (workers, nginx + the demo): one process
/// group, stopped as a whole on drop.
pub struct Group(pub Child);

impl Group {
    pub fn spawn(mut c: Command) -> Result<Self> {
        c.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        Ok(Self(c.spawn().with_context(|| format!("starting {c:?}"))?))
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let pgid = -(self.0.id() as i32);
        // SAFETY: kill(2) on the process group this test started.
        unsafe { libc::kill(pgid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above; whatever ignored SIGTERM.
        unsafe { libc::kill(pgid, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}
