//! Loading the eBPF object, attaching its programs, and reading its maps.

//!
//! Loading goes in three steps, as the libbpf tools do: [`kernel`] reads
//! what the kernel offers, [`plan`] decides from that alone which hook
//! serves each job and why, and `load` carries the plan out.

pub mod btf;
mod byte_arrays;
mod detach;
mod event_hook;
pub mod kernel;
mod kernel_maps;
pub mod libraries;
mod load;
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
pub use plan::{Choice, Hooks, Overrides, Plan, PlanError, SegmentChoice};
pub use segment_scope::{SEGMENT_HOOK_ENV, SegmentHook, SegmentReach, attachable};
pub use send_hook::{SEND_HOOK_ENV, SendHook};

use std::{
    collections::{BTreeMap, HashMap},
    num::NonZeroU32,
    path::PathBuf,
};

use aya::{
    Ebpf,
    programs::{
        UProbe,
        uprobe::{UProbeLinkId, UProbeScope},
    },
};
use thiserror::Error;

use libraries::{CudaLibrary, FileId};
use symbols::Api;

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

/// What attaching one library did.
#[derive(Debug, Clone)]
pub struct Attached {
    pub path: PathBuf,
    pub apis: Vec<Api>,
    /// Symbols probed.
    pub symbols: usize,
    /// Symbols whose attach failed, with the reason.
    pub failed: Vec<(String, String)>,
    /// How long creating the uprobes took.
    pub attach_ms: f64,
}

/// Which processes a library's uprobes fire in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reach {
    /// Every process that maps the file (`daemon`: workloads are found by
    /// what they call).
    Host,
    /// One process (`attach`): the kernel plants the breakpoints in that
    /// process's memory only, so another process mapping the same file
    /// takes no trap at all.
    Process(NonZeroU32),
}

type Links = Vec<(&'static str, UProbeLinkId)>;

/// One file's probes: what was attached, and the links to detach them by,
/// per reach.
struct Probed {
    report: Attached,
    links: BTreeMap<Reach, Links>,
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

    /// Attaches the probes to one library for `reach`, once per file and
    /// reach. Returns the report the first time the file is probed, None
    /// after (another process, or the same again).
    pub fn attach_library(
        &mut self,
        lib: &CudaLibrary,
        reach: Reach,
    ) -> Result<Option<Attached>, ProbeError> {
        // The real file's identity: one set of probes per reach however
        // many mount namespaces or overlays show it.
        if self
            .attached
            .get(&lib.id)
            .is_some_and(|p| p.links.contains_key(&reach))
        {
            return Ok(None);
        }
        let started = std::time::Instant::now();
        let mut report = Attached {
            path: lib.path.clone(),
            apis: lib.apis.iter().copied().collect(),
            symbols: 0,
            failed: Vec::new(),
            attach_ms: 0.0,
        };
        let mut links = Vec::new();
        for (sym, offset) in &lib.symbols {
            match self.attach_symbol(sym, *offset, lib, reach) {
                Ok(mut attached) => {
                    report.symbols += 1;
                    links.append(&mut attached);
                }
                Err(e @ (ProbeError::UprobeDenied { .. } | ProbeError::ProcessGone(_))) => {
                    // Every other symbol would fail the same way: say why,
                    // once, and leave none of this attach's probes behind.
                    self.detach_links(links);
                    return Err(e);
                }
                Err(e) => report.failed.push((sym.name.to_string(), e.to_string())),
            }
        }
        report.attach_ms = started.elapsed().as_secs_f64() * 1e3;
        if let Some(probed) = self.attached.get_mut(&lib.id) {
            probed.links.insert(reach, links);
            log::debug!(
                "probes on {} for {reach:?} in {:.1} ms",
                lib.path.display(),
                report.attach_ms
            );
            return Ok(None);
        }
        let probed = Probed {
            report: report.clone(),
            links: BTreeMap::from([(reach, links)]),
        };
        self.attached.insert(lib.id.clone(), probed);
        Ok(Some(report))
    }

    /// Detaches the probes of one file (no traced process maps it any
    /// more). The kernel takes about 0.1 s per uprobe to remove it (see
    /// [`detach_in_background`]): the links are closed on a thread of their
    /// own, so the event loop does not wait.
    pub fn detach_library(&mut self, id: &FileId) -> Option<Attached> {
        let probed = self.attached.remove(id)?;
        self.detach_links(probed.links.into_values().flatten().collect());
        Some(probed.report)
    }

    /// Detaches the probes bound to processes `keep` rejects (they
    /// exited); returns the files left with no probes at all, detached.
    pub fn detach_processes(&mut self, keep: impl Fn(u32) -> bool) -> Vec<Attached> {
        let mut gone = Vec::new();
        let mut emptied = Vec::new();
        for (id, probed) in &mut self.attached {
            probed.links.retain(|reach, links| match reach {
                Reach::Process(pid) if !keep(pid.get()) => {
                    gone.append(links);
                    false
                }
                _ => true,
            });
            if probed.links.is_empty() {
                emptied.push(id.clone());
            }
        }
        self.detach_links(gone);
        emptied
            .iter()
            .filter_map(|id| self.attached.remove(id))
            .map(|p| p.report)
            .collect()
    }

    fn detach_links(&mut self, links: Links) {
        let owned: Vec<_> = links
            .into_iter()
            .filter_map(|(program, id)| uprobe(&mut self.ebpf, program).ok()?.take_link(id).ok())
            .collect();
        if owned.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("ttft-detach-lib".into())
            .spawn(move || drop(owned));
        if let Err(e) = spawned {
            log::warn!("detaching on the event loop's thread ({e})");
        }
    }

    /// Detaches the runtime's launch probes bound to `reach` (of one file,
    /// or of all), leaving those launches to the driver's probes: one trap
    /// per launch instead of two. Returns how many were detached. Entry
    /// probes only (runtime launches have no return probe), so a launch in
    /// flight meanwhile is counted once, at one layer or the other.
    pub fn drop_runtime_launches(&mut self, reach: Reach, file: Option<&FileId>) -> usize {
        let mut dropped = Vec::new();
        for (id, probed) in &mut self.attached {
            if file.is_some_and(|f| f != id) {
                continue;
            }
            if let Some(links) = probed.links.get_mut(&reach) {
                let (launches, rest): (Links, Links) = std::mem::take(links)
                    .into_iter()
                    .partition(|(program, _)| symbols::is_runtime_launch(program));
                *links = rest;
                dropped.extend(launches);
            }
        }
        let n = dropped.len();
        self.detach_links(dropped);
        n
    }

    /// The path a probed file was attached by.
    pub fn attached_path(&self, id: &FileId) -> Option<&std::path::Path> {
        self.attached.get(id).map(|p| p.report.path.as_path())
    }

    /// The files probed now.
    pub fn attached_files(&self) -> impl Iterator<Item = &FileId> {
        self.attached.keys()
    }

    /// Entry and (where needed) return probe of one symbol: both or neither,
    /// since the runtime nesting depth counts entries against returns. The
    /// return probe goes first: a call that enters between the two attaches
    /// then shows only its return, which the depth ignores, whereas an
    /// entry without its return would leave the thread's depth raised for
    /// good and every later runtime call taken for a nested one (attaching
    /// takes long while another tracer detaches: the kernel serialises it).
    fn attach_symbol(
        &mut self,
        sym: &symbols::ProbedSymbol,
        offset: u64,
        lib: &CudaLibrary,
        reach: Reach,
    ) -> Result<Links, ProbeError> {
        let scope = match reach {
            Reach::Host => UProbeScope::AllProcesses,
            Reach::Process(pid) => UProbeScope::OneProcess(pid),
        };
        let mut links = Vec::with_capacity(2);
        if sym.needs_return {
            let ret_name = sym.api.return_program();
            let ret = uprobe(&mut self.ebpf, ret_name)?;
            let link = ret
                .attach(offset, &lib.open_path, scope)
                .map_err(|e| uprobe_error(ret_name, &lib.path, reach, e))?;
            links.push((ret_name, link));
        }
        let entry = uprobe(&mut self.ebpf, sym.program)?;
        match entry.attach(offset, &lib.open_path, scope) {
            Ok(link) => links.push((sym.program, link)),
            Err(e) => {
                self.detach_links(links);
                return Err(uprobe_error(sym.program, &lib.path, reach, e));
            }
        }
        Ok(links)
    }

    pub fn attached(&self) -> impl Iterator<Item = &Attached> {
        self.attached.values().map(|p| &p.report)
    }
}

/// A uprobe attach error; a permission error of perf_event_open names the
/// capability the kernel wants.
fn uprobe_error(
    program: &'static str,
    path: &std::path::Path,
    reach: Reach,
    e: aya::programs::ProgramError,
) -> ProbeError {
    if let aya::programs::ProgramError::SyscallError(aya::sys::SyscallError { call, io_error }) = &e
        && *call == "perf_event_open"
        && let (Reach::Process(pid), Some(libc::ESRCH)) = (reach, io_error.raw_os_error())
    {
        return ProbeError::ProcessGone(pid.get());
    }
    if let aya::programs::ProgramError::SyscallError(aya::sys::SyscallError { call, io_error }) = &e
        && *call == "perf_event_open"
        && matches!(io_error.raw_os_error(), Some(libc::EACCES | libc::EPERM))
    {
        return ProbeError::UprobeDenied {
            path: path.to_path_buf(),
            caps: crate::host::caps::CapSet::effective().unwrap_or_default(),
            source: std::io::Error::from_raw_os_error(io_error.raw_os_error().unwrap_or(0)),
        };
    }
    ProbeError::Program(program, e)
}

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut UProbe, ProbeError> {
    ebpf.program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|e| ProbeError::Program(name, e))
}
