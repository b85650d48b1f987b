//! Project tasks: `cargo xtask setup | demo | test | bench | fuzz | soak`.

mod attachtime;
mod bench;
mod bpfobj;
mod bpfprogs;
mod cgroup2;
mod demo;
mod fuzz;
mod hooktoggle;
mod hosttax;
mod launchtrap;
mod neighbour;
mod placement;
mod process;
mod rawfloor;
mod run;
mod scale;
mod setup;
mod soak;
mod sockopscover;
mod taxsetups;
mod togglehooks;
mod togglephases;
mod tracercpu;
mod tracerprogs;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "ttft-trace project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (idempotent): the nightly's
    /// rust-src, bpf-linker built against the nightly's LLVM, the real
    /// libcudart.so.12 and libnvidia-ml.so.1 used by the tests, nftables,
    /// Debian's prometheus (server and promtool) and the deploy/ validators.
    Setup,
    /// Set up, build, and trace the bundled GPU-free workload; show the
    /// summary and what /metrics serves.
    Demo,
    /// Set up, then run every test (root-only tests need root).
    Test {
        /// Extra arguments for `cargo test`.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Clippy on the eBPF crate, which builds only for the BPF target.
    LintEbpf,
    /// Run every fuzz target (cargo-fuzz, installed on first use) for
    /// SECONDS each; a crash fails and names its input.
    Fuzz {
        #[arg(long, default_value_t = 30)]
        seconds: u64,
        /// Only these targets (default: all).
        targets: Vec<String>,
    },
    /// Leave the daemon running against the demo server, restarted every
    /// RESTART_S seconds under load with a 4 KiB ring buffer; fail if its
    /// RSS, open files, perf events or kernel map entries grow by more than
    /// 10 % after the warm-up.
    Soak {
        #[arg(long, default_value_t = 30.0)]
        minutes: f64,
        #[arg(long, default_value_t = 20)]
        restart_s: u64,
    },
    /// Measure what untraced processes pay while the tracer runs (the host
    /// tax and a neighbour mapping the same libraries, checked against
    /// +5 %), a traced launch against one empty uprobe (1.10 x), attach and
    /// detach times, the event rate the daemon keeps up with, and its RSS
    /// and CPU with 10 000 followed streaming connections (64 MiB, no event
    /// lost); writes target/bench/*.json.
    Bench {
        /// Host tax only, one round of short runs (for CI).
        #[arg(long)]
        quick: bool,
        /// Only this part, with its full rounds.
        #[arg(long, value_enum, conflicts_with = "quick")]
        only: Option<bench::Part>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::setup(),
        Task::Demo => {
            setup::setup()?;
            demo::demo()
        }
        Task::Test { args } => {
            setup::setup()?;
            run::test(&args)
        }
        Task::LintEbpf => {
            setup::setup()?;
            run::lint_ebpf()
        }
        Task::Fuzz { seconds, targets } => {
            setup::setup()?;
            fuzz::fuzz(seconds, &targets)
        }
        Task::Soak { minutes, restart_s } => {
            setup::setup()?;
            soak::soak(minutes, restart_s)
        }
        Task::Bench { quick, only } => {
            setup::setup()?;
            bench::bench(quick, only)
        }
    }
}
