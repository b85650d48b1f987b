//! `cargo xtask fuzz`: every fuzz target of `fuzz/` (cargo-fuzz, libFuzzer
//! with AddressSanitizer, on the nightly toolchain) for a given time each.
//! cargo-fuzz is installed into the tool cache on first use. Each target
//! starts from the seeds of `fuzz/corpus/TARGET/` (valid inputs, see
//! `fuzz/corpus/README.md`), copied into a working corpus under
//! `target/fuzz-corpus/`. A crash fails the task and names the input that
//! caused it (under `fuzz/artifacts/`).

use std::{path::Path, process::Command, time::Instant};

use anyhow::{Context as _, Result, bail};

use crate::{
    process::{cmd, repo_root},
    setup::cargo_fuzz_bin,
};

/// The targets, in `fuzz/Cargo.toml`.
pub const TARGETS: &[&str] = &[
    "http_responses",
    "ring_records",
    "proc_files",
    "elf_files",
    "config_files",
];

/// Runs `targets` (all when empty) for `seconds` each.
pub fn fuzz(seconds: u64, targets: &[String]) -> Result<()> {
    let root = repo_root()?;
    let bin = cargo_fuzz_bin();
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
        // The corpus grows under target/ (not committed), kept between
        // runs, and starts from the seeds kept in the repo.
        let corpus = root.join("target/fuzz-corpus").join(target);
        let seeds = copy_seeds(&root.join("fuzz/corpus").join(target), &corpus)?;
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
            "{target}: no crash in {:.0} s, from {seeds} seeds of fuzz/corpus/{target}, corpus {} inputs",
            started.elapsed().as_secs_f64(),
            count_files(&corpus)
        ));
    }
    for line in summary {
        println!("fuzz: {line}");
    }
    Ok(())
}

/// Copies the seeds of `seeds` (a directory of the repo) missing from the
/// working `corpus`, so that libFuzzer writes what it finds under target/
/// and never into the repo; returns how many seeds there are.
fn copy_seeds(seeds: &Path, corpus: &Path) -> Result<usize> {
    std::fs::create_dir_all(corpus)?;
    let mut count = 0;
    for entry in std::fs::read_dir(seeds).with_context(|| format!("reading {}", seeds.display()))? {
        let from = entry?.path();
        if !from.is_file() {
            continue;
        }
        count += 1;
        let to = corpus.join(from.file_name().context("a seed without a name")?);
        if !to.exists() {
            std::fs::copy(&from, &to).with_context(|| format!("seeding {}", to.display()))?;
        }
    }
    if count == 0 {
        bail!("no seeds in {}", seeds.display());
    }
    Ok(count)
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
