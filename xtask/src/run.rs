//! The `test` and `lint-ebpf` tasks.

use std::process::Command;

use anyhow::Result;

use crate::process::{cmd, repo_root};

/// Every test: the workspace's cargo tests (fixtures required, so that a
/// missing one fails instead of skipping) and the demo server's own tests.
pub fn test(extra: &[String]) -> Result<()> {
    let root = repo_root()?;
    cmd(Command::new("cargo")
        .current_dir(&root)
        .arg("test")
        .args(extra)
        .env("TTFT_TRACE_REQUIRE_FIXTURES", "1"))?;
    cmd(Command::new("cargo")
        .current_dir(&root)
        .args(["build", "-p", "ttft-trace-tests"]))?;
    cmd(Command::new("python3").current_dir(&root).args([
        "-m",
        "unittest",
        "discover",
        "-s",
        "tests/demo",
        "-p",
        "test_*.py",
        "-v",
    ]))
}

/// `cargo clippy` for the eBPF crate with the nightly, for the BPF target.
pub fn lint_ebpf() -> Result<()> {
    let root = repo_root()?;
    let linker = crate::setup::cache().join("bpf-linker/bin");
    let path = std::env::join_paths(std::iter::once(linker).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))?;
    cmd(Command::new("cargo")
        .current_dir(root.join("ttft-trace-ebpf"))
        .args([
            "+nightly",
            "clippy",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .arg("--target-dir")
        .arg(root.join("target/ebpf-lint"))
        .args(["--", "-D", "warnings"])
        .env("PATH", path)
        .env(
            "RUSTFLAGS",
            format!("--cfg bpf_target_arch=\"{}\"", std::env::consts::ARCH),
        ))
}
