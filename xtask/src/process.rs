//! Running commands from the tasks, the clocks they stamp with, and where
//! the repository is.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

/// Runs a command with inherited output; fails on a non-zero exit.
pub fn cmd(c: &mut Command) -> Result<()> {
    let status = c.status().with_context(|| format!("running {c:?}"))?;
    if !status.success() {
        bail!("{c:?} failed: {status}");
    }
    Ok(())
}

/// Runs a command and returns its stdout; stderr passes through.
pub fn output(c: &mut Command) -> Result<String> {
    let out = c
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {c:?}"))?;
    if !out.status.success() {
        bail!("{c:?} failed: {}", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn repo_root() -> Result<PathBuf> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(PathBuf::from)
        .context("xtask has no parent directory")
}

/// The clock `id` in ns (CLOCK_MONOTONIC: the fixtures' stamps).
pub(crate) fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec for the clock to fill.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
