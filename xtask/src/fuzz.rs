//! `cargo xtask fuzz`: every fuzz target of `fuzz/` (cargo-fuzz, libFuzzer
//! with AddressSanitizer, on the nightly toolchain) for a given time each.
//! cargo-fuzz is installed into the tool cache on first use. A crash fails
//! the task and names the input that caused it (under `fuzz/artifacts/`).

use std::{path::Path, process::Command, time::Instant};

use anyhow::{Context as _, Result, bail};

use crate::{
    process::{cmd, output, repo_root},
    setup::cache,
};

const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// The targets, in `fuzz/Cargo.toml`.
pub const TARGETS: &[&str] = &[
    "http_responses",
    "ring_records",
    "proc_files",
    "elf_files",
    "config_files",
];

fn cargo_fuzz() -> Result<std::path::PathBuf> {
    let root = cache().join("cargo-fuzz");
    let bin = root.join("bin/cargo-fuzz");
    if bin.is_file()
        && output(Command::new(&bin).args(["fuzz", "--version"]))
            .is_ok_and(|v| v.contains(CARGO_FUZZ_VERSION))
    {
        return Ok(bin);
    }
    eprintln!("fuzz: installing cargo-fuzz {CARGO_FUZZ_VERSION}");
    cmd(Command::new("cargo")
        .args([
            "install",
            &format!("cargo-fuzz@{CARGO_FUZZ_VERSION}"),
            "--locked",
            "--root",
        ])
        .arg(&root))?;
    Ok(bin)
}

/// Runs `targets` (all when empty) for `seconds` each.
pub fn fuzz(seconds: u64, targets: &[String]) -> Result<()> {
    let root = repo_root()?;
    let bin = cargo_fuzz()?;
    let path = std::env::join_paths(
        std::iter::once(
            bin.parent()
                .context("cargo-fuzz has no directory")?
                .to_path_buf(),
        )
        .chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )),
    )?;
    let chosen: Vec<&str> = if targets.is_empty() {
        TARGETS.to_vec()
    } else {
        targets.iter().map(String::as_str).collect()
    };
    for target in &chosen {
        if !TARGETS.contains(target) {
            bail!(
                "no fuzz target {target:?}; there are {}",
                TARGETS.join(", ")
            );
        }
    }
    // One build of every target (with the sanitizer), then the runs.
    cmd(Command::new("cargo")
        .current_dir(&root)
        .args(["+nightly", "fuzz", "build"])
        .env("PATH", &path)
        // The fuzz build needs no eBPF object: the loader is never run.
        .env("AYA_BUILD_SKIP", "1"))?;
    let mut summary = Vec::new();
    for target in chosen {
        // The corpus grows under target/ (not committed), kept between runs.
        let corpus = root.join("target/fuzz-corpus").join(target);
        std::fs::create_dir_all(&corpus)?;
        if target == "elf_files" {
            seed_elf_files(&root, &corpus)?;
        }
        let started = Instant::now();
        let mut c = Command::new("cargo");
        c.current_dir(&root)
            .args(["+nightly", "fuzz", "run", target])
            .arg(&corpus)
            .args([
                "--",
                &format!("-max_total_time={seconds}"),
                "-rss_limit_mb=4096",
                "-print_final_stats=1",
            ])
            .env("PATH", &path)
            .env("AYA_BUILD_SKIP", "1");
        cmd(&mut c).with_context(|| {
            format!(
                "fuzz target {target} failed: the input is under {}",
                root.join("fuzz/artifacts").join(target).display()
            )
        })?;
        summary.push(format!(
            "{target}: no crash in {:.0} s, corpus {} inputs",
            started.elapsed().as_secs_f64(),
            count_files(&corpus)
        ));
    }
    for line in summary {
        println!("fuzz: {line}");
    }
    Ok(())
}

/// Real CUDA-like libraries to start the ELF corpus from (random bytes
/// rarely get past the ELF header): the stub runtime and driver built for
/// the tests, when present.
fn seed_elf_files(root: &Path, corpus: &Path) -> Result<()> {
    for name in ["libcudart.so.12", "libcuda.so.1"] {
        let from = root.join("target/fixtures").join(name);
        let to = corpus.join(format!("seed-{name}"));
        if from.is_file() && !to.exists() {
            std::fs::copy(&from, &to).with_context(|| format!("seeding {}", to.display()))?;
        }
    }
    Ok(())
}

fn count_files(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.filter_map(|e| e.ok()).count())
}
