//! Builds the eBPF object (ttft-trace-ebpf) with the nightly toolchain and
//! bpf-linker through aya-build, for `include_bytes!` in the loader.

use std::{env, path::PathBuf};

use anyhow::{Context as _, bail};

/// Where `cargo xtask setup` installs bpf-linker (built against the
/// nightly's own LLVM). Must match xtask.
fn tool_cache() -> PathBuf {
    if let Some(dir) = env::var_os("TTFT_TRACE_CACHE") {
        return PathBuf::from(dir);
    }
    let home = env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/ttft-trace")
}

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=TTFT_TRACE_CACHE");
    println!("cargo:rerun-if-changed=../ttft-trace-common/src");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let object = out_dir.join("ttft-trace-probes");

    if env::var_os("AYA_BUILD_SKIP").is_some_and(|v| v == "1" || v == "true") {
        // Host-only builds (clippy, docs): an empty object; the loader says
        // so at run time instead of failing obscurely.
        if !object.exists() {
            std::fs::write(&object, b"")?;
        }
    }

    let linker_dir = tool_cache().join("bpf-linker/bin");
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = env::split_paths(&path).collect();
    dirs.insert(0, linker_dir.clone());
    if env::var_os("AYA_BUILD_SKIP").is_none()
        && !dirs.iter().any(|d| d.join("bpf-linker").is_file())
    {
        bail!(
            "bpf-linker not found in {} or PATH: run `cargo xtask setup` first",
            linker_dir.display()
        );
    }
    // SAFETY: build scripts are single-threaded here; aya-build's child
    // cargo inherits this PATH so rustc finds bpf-linker.
    unsafe { env::set_var("PATH", env::join_paths(dirs)?) };

    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("no manifest dir")?);
    let root = manifest.join("../ttft-trace-ebpf");
    let root = root.to_str().context("non-UTF-8 path to ttft-trace-ebpf")?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "ttft-trace-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
