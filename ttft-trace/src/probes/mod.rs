//! Loading the eBPF object, attaching its programs, and reading its maps.

//!
//! Loading goes in three steps, as the libbpf tools do: [`kernel`] reads
//! what the kernel offers, [`plan`] decides from that alone which hook
//! serves each job and why, and `load` carries the plan out.

pub mod btf;
mod byte_arrays;
pub mod cuda;
mod detach;
mod event_hook;
pub mod family;
pub mod kernel;
mod kernel_maps;
pub mod libraries;
mod load;
pub mod openssl;
pub mod plan;
#[cfg(test)]
pub(crate) mod recorded_kernels;
mod segment_scope;
mod selftest;
mod send_hook;
pub mod symbols;

pub use detach::detach_in_background;
pub use event_hook::{EVENT_HOOK_ENV, EventHook};
pub use kernel::KernelDescription;
use libraries::Probed;
pub use libraries::{Attached, Reach};
pub use plan::{Choice, Hooks, Overrides, Plan, PlanError, SegmentChoice};
pub use segment_scope::{SEGMENT_HOOK_ENV, SegmentHook, SegmentReach, attachable};
pub use send_hook::{SEND_HOOK_ENV, SendHook};

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
};

use aya::Ebpf;
use thiserror::Error;

use libraries::FileId;

/// The eBPF object built by build.rs (aya-build).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ttft-trace-probes"));

#[derive(Debug, Error)]
pub enum ProbeError {
    #[error(
        "this binary was built with AYA_BUILD_SKIP and carries no eBPF programs; \
         rebuild without it"
    )]
    NoObject,
    #[error("{0}")]
    Capabilities(String),
    #[error(
        "creating a uprobe on {path} was refused ({source}): {}",
        crate::host::caps::missing_message(*caps, &[crate::host::caps::UPROBES])
    )]
    UprobeDenied {
        path: PathBuf,
        caps: crate::host::caps::CapSet,
        source: std::io::Error,
    },
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("loading the eBPF programs into the kernel failed: {0}")]
    Load(#[source] aya::EbpfError),
    #[error("eBPF program {0}: {1}")]
    Program(&'static str, #[source] aya::programs::ProgramError),
    #[error("eBPF map {0}: {1}")]
    Map(&'static str, #[source] aya::maps::MapError),
    #[error("eBPF object lacks {0}")]
    Missing(&'static str),
    #[error("eBPF map {0}: cannot map it into memory: {1}")]
    Mmap(&'static str, std::io::Error),
    #[error("process {0} exited before its probes were attached")]
    ProcessGone(u32),
    #[error("cannot stat {0}: {1}")]
    Stat(PathBuf, std::io::Error),
}

/// Load-time settings of the probes.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Ring buffer size in bytes.
    pub ringbuf_bytes: u32,
    /// Scheduler intervals at least this long are sent as events.
    pub sched_min_ns: u64,
    /// Copy calls at least this large are sent as events.
    pub large_copy_bytes: u64,
    /// Daemon mode: announce untraced processes calling probed libraries.
    pub discover: bool,
    /// (map, entries) replacing the sizes compiled into the probes.
    pub map_entries: Vec<(&'static str, u32)>,
    /// Attach the scheduler programs (`sched_switch`, and the wakeups
    /// where they are needed); off with `--sched sampled`, where the
    /// intervals come from `/proc` and no context switch runs a program.
    pub sched_programs: bool,
}

/// The loaded programs and the libraries they are attached to.
pub struct Probes {
    ebpf: Ebpf,
    /// Each job's hook as attached, and why where not the default.
    hooks: Hooks,
    /// The raw `tcp_probe` program is attached (host-wide), where segments
    /// are not seen on cgroups nor by the classic tracepoint.
    raw_segments: bool,
    /// Where the cgroup segment program is attached.
    scope: segment_scope::Scope,
    /// Tracepoints attached (classic, raw and BTF).
    tracepoints: usize,
    /// Ids the per-event programs may look up (see `byte_arrays`).
    traced_ids: byte_arrays::SharedBytes,
    /// Followed listening ports (see `byte_arrays`).
    listen_ports: byte_arrays::SharedBytes,
    /// Libraries attached, by the file they land on: uprobes attach to a
    /// file, and fire in the processes of their [`Reach`] that map it.
    attached: HashMap<FileId, Probed>,
    /// Inserts refused from userspace because the map was full, by map.
    map_full: BTreeMap<&'static str, u64>,
    /// The probes read a socket's network namespace: listening ports are
    /// kept per namespace.
    netns_known: bool,
    /// The held-send program waits to be loaded (`Some(classic)`: the
    /// classic hook's), until a traced process maps OpenSSL's `libcrypto`
    /// ([`Probes::want_held_sends`]); None once tried.
    held_sends: Option<bool>,
}

/// Tracepoints and the programs attached to them: (program, category, name).
/// The send hook's come on top (see [`SendHook`]), and the socket lengths
/// are the syscall send hook's only; the per-event ones are raw
/// tracepoints instead where the kernel allows (see [`EventHook`]).
pub const TRACEPOINTS: &[(&str, &str, &str)] = &[
    ("sched_process_fork", "sched", "sched_process_fork"),
    ("sched_process_exit", "sched", "sched_process_exit"),
    ("inet_sock_set_state", "sock", "inet_sock_set_state"),
    ("sock_recv_length", "sock", "sock_recv_length"),
    ("sock_send_length", "sock", "sock_send_length"),
    ("sched_switch", "sched", "sched_switch"),
    ("sched_wakeup", "sched", "sched_wakeup"),
    ("sched_wakeup_new", "sched", "sched_wakeup_new"),
    ("tcp_retransmit_skb", "tcp", "tcp_retransmit_skb"),
    ("tcp_receive_reset", "tcp", "tcp_receive_reset"),
    ("tcp_send_reset", "tcp", "tcp_send_reset"),
    ("tcp_probe", "tcp", "tcp_probe"),
];

/// The programs that run for every context switch and wakeup of the host
/// (classic names), which `--sched sampled` leaves out.
fn is_scheduler_program(name: &str) -> bool {
    matches!(name, "sched_switch" | "sched_wakeup" | "sched_wakeup_new")
}

impl Probes {
    /// (programs loaded and accepted by the verifier, tracepoints attached).
    pub fn loaded(&self) -> (usize, usize) {
        let programs = self.ebpf.programs().filter(|(_, p)| p.fd().is_ok()).count();
        (programs, self.tracepoints)
    }

    /// Each job's hook as attached, and why where not the default.
    pub fn hooks(&self) -> &Hooks {
        &self.hooks
    }
}
