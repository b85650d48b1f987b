//! What the tests of real server stacks share (`tests/tests/stacks.rs`,
//! `tests/tests/grpc.rs`): where the stacks' programs are, waiting for a
//! server to listen, and how late a client's read of a first token may come.

use std::{
    net::TcpStream,
    path::PathBuf,
    process::ExitStatus,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Result, bail, ensure};

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
