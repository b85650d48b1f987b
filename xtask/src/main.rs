//! Project tasks: `cargo xtask setup | demo | test | bench | fuzz | soak`.

mod attachtime;
mod bench;
mod bounds;
mod bpfobj;
mod bpfprogs;
mod cgroup2;
mod demo;
mod fuzz;
mod grpcdemo;
mod h2scale;
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
mod tlscost;
mod togglehooks;
mod togglephases;
mod tracercpu;
mod tracerprogs;

use clap::{Parser, Subcommand};
use setup::{Purpose, setup};

#[derive(Parser)]
#[command(about = "ttft-trace project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what `test` needs (idempotent; one line per step with its
    /// time, each step's output in ~/.cache/ttft-trace/logs/setup-STEP.log):
    /// the nightly's rust-src and bpf-linker built against the nightly's
    /// LLVM (what building needs), the real libcudart.so.12 and
    /// libnvidia-ml.so.1, the Python venvs of the deploy/ validators and
    /// the HTTP stacks, and, as root, Debian's nftables, prometheus,
    /// nginx-light, libmicrohttpd-dev, systemd-analyze, bpftool and
    /// chromium, with none of their services started or enabled at boot.
    /// With --all, also what bench and fuzz add (bpftrace, cargo-fuzz).
    Setup {
        /// Everything any task uses, not only the tests' tools.
        #[arg(long)]
        all: bool,
    },
    /// Build (installing only rust-src and bpf-linker when missing) and
    /// trace the bundled GPU-free workload; show the summary and what
    /// /metrics serves.
    Demo {
        /// A gRPC streaming service (grpcio) under `attach` instead of the
        /// HTTP/1.1 demo server under the daemon; sets up the gRPC venv.
        #[arg(long)]
        grpc: bool,
    },
    /// Set up what the tests use, then run every test (root-only tests need
    /// root).
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
        Task::Setup { all } => setup(if all { Purpose::All } else { Purpose::Test }),
        Task::Demo { grpc: false } => {
            setup(Purpose::Build)?;
            demo::demo()
        }
        Task::Demo { grpc: true } => {
            setup(Purpose::GrpcDemo)?;
            grpcdemo::demo_grpc()
        }
        Task::Test { args } => {
            setup(Purpose::Test)?;
            run::test(&args)
        }
        Task::LintEbpf => {
            setup(Purpose::Build)?;
            run::lint_ebpf()
        }
        Task::Fuzz { seconds, targets } => {
            setup(Purpose::Fuzz)?;
            fuzz::fuzz(seconds, &targets)
        }
        Task::Soak { minutes, restart_s } => {
            setup(Purpose::Soak)?;
            soak::soak(minutes, restart_s)
        }
        Task::Bench { quick, only } => {
            setup(Purpose::Bench)?;
            bench::bench(quick, only)
        }
    }
}
