//! What building needs (the nightly's rust-src, bpf-linker built against the
//! nightly's LLVM) and the fuzzer's cargo-fuzz, installed into the tool cache.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::{
    cache,
    step::{Log, Outcome, Step},
};

pub const BPF_LINKER_VERSION: &str = "0.13.0";
pub const CARGO_FUZZ_VERSION: &str = "0.13.2";

pub const RUST_SRC: Step = Step {
    what: "rust-src (nightly, for the eBPF crate's build-std)",
    log: "rust-src",
    run: rust_src,
};

pub const BPF_LINKER: Step = Step {
    what: "bpf-linker 0.13.0 (built against the nightly's LLVM)",
    log: "bpf-linker",
    run: bpf_linker,
};

pub const CARGO_FUZZ: Step = Step {
    what: "cargo-fuzz 0.13.2",
    log: "cargo-fuzz",
    run: cargo_fuzz,
};

fn rust_src(log: &mut Log) -> Result<Outcome> {
    let installed = log.output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?;
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        return Ok(Outcome::Found("present"));
    }
    log.run(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        "nightly",
    ]))?;
    Ok(Outcome::Changed("installed".into()))
}

/// Whether `bin --version` (a cargo subcommand: `bin SUB --version`) names
/// `version`.
fn reports_version(log: &mut Log, bin: &Path, sub: Option<&str>, version: &str) -> bool {
    bin.is_file()
        && log
            .output(Command::new(bin).args(sub).arg("--version"))
            .is_ok_and(|v| v.contains(version))
}

/// bpf-linker must use the nightly's own LLVM (same major version), so it
/// is built against the libLLVM shipped inside the nightly toolchain,
/// through a prefix made of symlinks.
fn bpf_linker(log: &mut Log) -> Result<Outcome> {
    let root = cache().join("bpf-linker");
    let bin = root.join("bin/bpf-linker");
    if reports_version(log, &bin, None, BPF_LINKER_VERSION) {
        return Ok(Outcome::Found("present"));
    }
    let (libllvm, major) = nightly_llvm(log)?;
    let prefix = cache().join("llvm-prefix");
    let lib64 = prefix.join("lib64");
    fs::create_dir_all(&lib64)?;
    for name in ["libLLVM.so".to_string(), file_name(&libllvm)?] {
        let link = lib64.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    log.run(
        Command::new("cargo")
            .args([
                "install",
                &format!("bpf-linker@{BPF_LINKER_VERSION}"),
                "--locked",
                "--no-default-features",
                "--features",
                &format!("llvm-{major}"),
                "--root",
            ])
            .arg(&root)
            .env("LLVM_PREFIX", &prefix),
    )?;
    let v = log.output(Command::new(&bin).arg("--version"))?;
    if !v.contains(BPF_LINKER_VERSION) {
        bail!("built bpf-linker reports {v:?}");
    }
    Ok(Outcome::Changed(format!("installed, LLVM {major}")))
}

/// The nightly's libLLVM and its major version.
fn nightly_llvm(log: &mut Log) -> Result<(PathBuf, String)> {
    let sysroot = log.output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let lib_dir = Path::new(sysroot.trim()).join("lib");
    let libllvm = fs::read_dir(&lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so.") || n.starts_with("libLLVM-"))
        })
        .with_context(|| {
            format!(
                "no libLLVM in the nightly toolchain at {}",
                lib_dir.display()
            )
        })?;
    let version = log.output(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("nightly rustc reports no LLVM version")?
        .to_string();
    Ok((libllvm, major))
}

fn file_name(p: &Path) -> Result<String> {
    p.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .with_context(|| format!("odd path {}", p.display()))
}

/// Where cargo-fuzz is installed (`cargo xtask fuzz` puts it on PATH).
pub fn cargo_fuzz_bin() -> PathBuf {
    cache().join("cargo-fuzz/bin/cargo-fuzz")
}

fn cargo_fuzz(log: &mut Log) -> Result<Outcome> {
    let bin = cargo_fuzz_bin();
    if reports_version(log, &bin, Some("fuzz"), CARGO_FUZZ_VERSION) {
        return Ok(Outcome::Found("present"));
    }
    log.run(
        Command::new("cargo")
            .args([
                "install",
                &format!("cargo-fuzz@{CARGO_FUZZ_VERSION}"),
                "--locked",
                "--root",
            ])
            .arg(cache().join("cargo-fuzz")),
    )?;
    Ok(Outcome::Changed("installed".into()))
}
