//! Idempotent set-up: what a task needs and the machine lacks, nothing
//! twice, nothing more. Each task asks for its own steps (`Purpose`); each
//! step prints one line with its time, and sends what its commands print to
//! a log of its own under the cache's `logs/` (see `step`).

mod apt;
mod downloads;
mod services;
mod step;
mod toolchain;

use std::path::PathBuf;

use anyhow::Result;

pub use downloads::real_cudart;
pub use toolchain::cargo_fuzz_bin;

use self::{
    apt::{
        BPFTOOL, BPFTRACE, CHROMIUM, HTTP_STACK_PACKAGES, NFTABLES, PROMETHEUS, SERVICES,
        SYSTEMD_ANALYZE,
    },
    downloads::{CUDART, GRPC, HTTP_STACKS, NVML, VALIDATORS},
    step::Step,
    toolchain::{BPF_LINKER, CARGO_FUZZ, RUST_SRC},
};

/// The tool cache shared with build.rs and the tests.
pub fn cache() -> PathBuf {
    if let Some(dir) = std::env::var_os("TTFT_TRACE_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/ttft-trace")
}

/// What a task sets up for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Building the daemon (the demo, lint-ebpf): rust-src and bpf-linker.
    Build,
    /// The gRPC demo: building, and the gRPC venv.
    GrpcDemo,
    /// `cargo xtask test` (and plain `cargo xtask setup`): building, the
    /// libraries, venvs and Debian packages the tests use.
    Test,
    /// The soak: building and bpftool.
    Soak,
    /// The cost bench: building, the real CUDA runtime, bpftool, bpftrace.
    Bench,
    /// The fuzzer: cargo-fuzz.
    Fuzz,
    /// Everything any task uses (`setup --all`).
    All,
}

/// The steps of `purpose`, in order; the services check comes last, after
/// every package install.
fn steps(purpose: Purpose) -> Vec<&'static Step> {
    let build = [&RUST_SRC, &BPF_LINKER];
    let test = [
        &CUDART,
        &NVML,
        &NFTABLES,
        &PROMETHEUS,
        &VALIDATORS,
        &HTTP_STACKS,
        &GRPC,
        &HTTP_STACK_PACKAGES,
        &SYSTEMD_ANALYZE,
        &BPFTOOL,
        &CHROMIUM,
    ];
    match purpose {
        Purpose::Build => build.to_vec(),
        Purpose::GrpcDemo => [&build[..], &[&GRPC]].concat(),
        Purpose::Test => [&build[..], &test, &[&SERVICES]].concat(),
        Purpose::Soak => [&build[..], &[&BPFTOOL, &SERVICES]].concat(),
        Purpose::Bench => [&build[..], &[&CUDART, &BPFTOOL, &BPFTRACE, &SERVICES]].concat(),
        Purpose::Fuzz => vec![&CARGO_FUZZ],
        Purpose::All => [&build[..], &test, &[&BPFTRACE, &CARGO_FUZZ, &SERVICES]].concat(),
    }
}

/// Runs the steps of `purpose`.
pub fn setup(purpose: Purpose) -> Result<()> {
    step::run_all(&steps(purpose), &cache().join("logs"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TASKS: [Purpose; 6] = [
        Purpose::Build,
        Purpose::GrpcDemo,
        Purpose::Test,
        Purpose::Soak,
        Purpose::Bench,
        Purpose::Fuzz,
    ];

    fn names(purpose: Purpose) -> Vec<&'static str> {
        steps(purpose).iter().map(|s| s.log).collect()
    }

    #[test]
    fn the_demo_builds_and_installs_nothing_else() {
        assert_eq!(names(Purpose::Build), ["rust-src", "bpf-linker"]);
    }

    #[test]
    fn all_is_every_tasks_steps_once() {
        let all = names(Purpose::All);
        for purpose in TASKS {
            for name in names(purpose) {
                assert!(all.contains(&name), "{name} of {purpose:?} missing");
            }
        }
        let mut unique = all.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), all.len(), "{all:?}");
    }

    #[test]
    fn the_services_check_follows_every_install() {
        for purpose in TASKS.into_iter().chain([Purpose::All]) {
            let names = names(purpose);
            if let Some(at) = names.iter().position(|n| *n == "services") {
                assert_eq!(at, names.len() - 1, "{purpose:?}: {names:?}");
            }
        }
        assert!(names(Purpose::Test).contains(&"services"));
    }

    #[test]
    fn each_step_has_its_own_log() {
        let all = steps(Purpose::All);
        let mut logs: Vec<_> = all.iter().map(|s| s.log).collect();
        logs.sort_unstable();
        logs.dedup();
        assert_eq!(logs.len(), all.len());
    }

    #[test]
    fn the_lines_name_the_pinned_versions() {
        assert!(BPF_LINKER.what.contains(toolchain::BPF_LINKER_VERSION));
        assert!(CARGO_FUZZ.what.contains(toolchain::CARGO_FUZZ_VERSION));
    }
}
