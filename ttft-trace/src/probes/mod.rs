//! Loading the eBPF object, attaching its programs, and reading its maps.

pub mod btf;
mod byte_arrays;
pub mod cuda;
mod detach;
mod event_hook;
pub mod family;
mod kernel_maps;
pub mod libraries;
mod segment_scope;
mod selftest;
mod send_hook;
pub mod symbols;

pub use detach::detach_in_background;
pub use event_hook::{EVENT_HOOK_ENV, EventHook, event_hook_plan, segment_plan};
use libraries::Probed;
pub use libraries::{Attached, Reach};
pub use segment_scope::{SEGMENT_HOOK_ENV, SegmentHook, SegmentReach, attachable};
pub use send_hook::{SEND_HOOK_ENV, SendHook, send_hook_plan, syscall_offsets};
use send_hook::{SYSCALL_SEND_TRACEPOINTS, attach_tcp, is_socket_length};

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{TracePoint, UProbe},
};
use thiserror::Error;
use ttft_trace_common::{
    SendOffsets, TracepointOffsets,
    offsets::{ABSENT, SegmentOffsets, TaskOffsets},
};

use crate::host::tracefs::{self, Format, TracefsError};
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
    Tracefs(#[from] TracefsError),
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
    send_hook: SendHook,
    event_hook: EventHook,
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

/// Kernel struct offsets the socket probes read, from the kernel's BTF, or
/// why each cannot be had.
pub struct StructOffsets {
    /// Where `tcp_probe` finds a segment's own acknowledgment number (with
    /// its `skbaddr` field). Without it, what a segment acknowledged is seen
    /// at the next segment (and the last one's never).
    pub ack_seq: Result<u32, String>,
    /// A socket's network namespace: without it, listening ports are
    /// matched in every namespace.
    pub netns: Result<(u32, u32), String>,
}

impl StructOffsets {
    pub fn read(offsets: &TracepointOffsets) -> Self {
        let btf = match btf::Btf::vmlinux() {
            Ok(btf) => btf,
            Err(e) => {
                return Self {
                    ack_seq: Err(e.to_string()),
                    netns: Err(e.to_string()),
                };
            }
        };
        Self {
            ack_seq: if offsets.probe_skb == ABSENT {
                Err("tcp:tcp_probe has no skbaddr on this kernel".into())
            } else {
                btf::skb_ack_seq_offset(&btf).map_err(|e| e.to_string())
            },
            netns: btf::netns_offsets(&btf).map_err(|e| e.to_string()),
        }
    }
}

/// Reads the tracepoint offsets the probes need from tracefs.
pub fn tracepoint_offsets() -> Result<TracepointOffsets, TracefsError> {
    let root = tracefs::root()?;
    let fork = Format::read(&root, "sched", "sched_process_fork")?;
    let exit = Format::read(&root, "sched", "sched_process_exit")?;
    let state = Format::read(&root, "sock", "inet_sock_set_state")?;
    let len = Format::read(&root, "sock", "sock_send_length")?;
    let recv = Format::read(&root, "sock", "sock_recv_length")?;
    let switch = Format::read(&root, "sched", "sched_switch")?;
    let wakeup = Format::read(&root, "sched", "sched_wakeup")?;
    let wakeup_new = Format::read(&root, "sched", "sched_wakeup_new")?;
    let retransmit = Format::read(&root, "tcp", "tcp_retransmit_skb")?;
    let reset_received = Format::read(&root, "tcp", "tcp_receive_reset")?;
    let reset_sent = Format::read(&root, "tcp", "tcp_send_reset")?;
    let probe = Format::read(&root, "tcp", "tcp_probe")?;
    let offsets = TracepointOffsets {
        fork_child_pid: fork.offset("child_pid")?,
        exit_group_dead: exit.optional_offset("group_dead").unwrap_or(ABSENT),
        state_skaddr: state.offset("skaddr")?,
        state_oldstate: state.offset("oldstate")?,
        state_newstate: state.offset("newstate")?,
        state_sport: state.offset("sport")?,
        state_dport: state.offset("dport")?,
        state_family: state.offset("family")?,
        state_saddr: state.offset("saddr")?,
        state_daddr: state.offset("daddr")?,
        state_saddr_v6: state.offset("saddr_v6")?,
        state_daddr_v6: state.offset("daddr_v6")?,
        len_sk: len.offset("sk")?,
        len_ret: len.offset("ret")?,
        len_flags: len.offset("flags")?,
        // The syscall send hook's: see syscall_offsets.
        write_buf: ABSENT,
        sendto_buf: ABSENT,
        writev_vec: ABSENT,
        writev_vlen: ABSENT,
        sendmsg_msg: ABSENT,
        switch_prev_state: switch.offset("prev_state")?,
        switch_next_pid: switch.offset("next_pid")?,
        wakeup_pid: wakeup.offset("pid")?,
        retransmit_sk: retransmit.offset("skaddr")?,
        reset_received_sk: reset_received.offset("skaddr")?,
        reset_sent_sk: reset_sent.offset("skaddr")?,
        probe_sk: probe.offset("skaddr")?,
        probe_data_len: probe.offset("data_len")?,
        probe_snd_nxt: probe.offset("snd_nxt")?,
        probe_snd_una: probe.offset("snd_una")?,
        probe_srtt: probe.offset("srtt")?,
        probe_sport: probe.offset("sport")?,
        probe_dport: probe.offset("dport")?,
        probe_family: probe.offset("family")?,
        probe_saddr: probe.offset("saddr")?,
        probe_daddr: probe.offset("daddr")?,
        probe_skb: probe.optional_offset("skbaddr").unwrap_or(ABSENT),
        // From BTF: see StructOffsets.
        skb_ack_seq: ABSENT,
        sk_net: ABSENT,
        net_inum: ABSENT,
    };
    if wakeup_new.offset("pid")? != offsets.wakeup_pid {
        return Err(TracefsError::Parse(
            "sched:sched_wakeup_new".into(),
            "pid is not where sched_wakeup has it".into(),
        ));
    }
    // One set of offsets serves both length tracepoints: check they agree.
    for field in ["sk", "ret", "flags"] {
        if recv.offset(field)? != len.offset(field)? {
            return Err(TracefsError::Parse(
                "sock:sock_recv_length".into(),
                format!("field {field} is not where sock_send_length has it"),
            ));
        }
    }
    Ok(offsets)
}

impl Probes {
    /// Loads every program, attaches the process-tree tracepoints. Uprobes
    /// wait for [`Probes::attach_library`].
    pub fn load(cfg: &LoadConfig) -> Result<Self, ProbeError> {
        let ringbuf_bytes = cfg.ringbuf_bytes;
        if OBJECT.is_empty() {
            return Err(ProbeError::NoObject);
        }
        let caps = crate::host::caps::CapSet::effective().unwrap_or_default();
        let missing = crate::host::caps::missing(caps, crate::host::caps::LOAD);
        if !missing.is_empty() {
            return Err(ProbeError::Capabilities(
                crate::host::caps::missing_message(caps, &missing),
            ));
        }
        let started = std::time::Instant::now();
        let mut offsets = tracepoint_offsets()?;
        let structs = StructOffsets::read(&offsets);
        match structs.ack_seq {
            Ok(at) => offsets.skb_ack_seq = at,
            Err(why) => log::info!("ACK timing: at the next segment ({why})"),
        }
        match structs.netns {
            Ok((net, inum)) => (offsets.sk_net, offsets.net_inum) = (net, inum),
            Err(why) => log::info!("listening ports: matched in every network namespace ({why})"),
        }
        let send_offsets = send_hook_plan();
        let task_offsets = event_hook_plan();
        let segment_offsets = segment_plan();
        let syscalls_ready = match &send_offsets {
            Ok(_) => syscall_offsets(&mut offsets).is_ok(),
            Err(why) => {
                log::info!("send hook: syscall tracepoints ({why})");
                syscall_offsets(&mut offsets)?;
                true
            }
        };
        // Wake the reader early only when an eighth of the buffer is used;
        // otherwise it drains on its timer (see the probes' wakeup_flag).
        let wakeup_bytes = u64::from(ringbuf_bytes / 8);
        let no_send_offsets = SendOffsets::default();
        let no_task_offsets = TaskOffsets::default();
        let no_segment_offsets = SegmentOffsets::default();
        let discover = u32::from(cfg.discover);
        let mut loader = EbpfLoader::new();
        loader
            .override_global("OFFSETS", &offsets, true)
            .override_global(
                "SEND_OFFSETS",
                send_offsets.as_ref().unwrap_or(&no_send_offsets),
                true,
            )
            .override_global(
                "TASK_OFFSETS",
                task_offsets.as_ref().unwrap_or(&no_task_offsets),
                true,
            )
            .override_global(
                "SEGMENT_OFFSETS",
                segment_offsets.as_ref().unwrap_or(&no_segment_offsets),
                true,
            )
            .override_global("WAKEUP_BYTES", &wakeup_bytes, true)
            .override_global("SCHED_MIN_NS", &cfg.sched_min_ns, true)
            .override_global("LARGE_COPY_BYTES", &cfg.large_copy_bytes, true)
            .override_global("DISCOVER", &discover, true)
            .map_max_entries("EVENTS", ringbuf_bytes)
            .map_max_entries(byte_arrays::TRACED_IDS, byte_arrays::traced_id_slots());
        for &(map, entries) in &cfg.map_entries {
            loader.map_max_entries(map, entries);
        }
        let layouts = started.elapsed();
        let mut ebpf = loader.load(OBJECT).map_err(ProbeError::Load)?;
        for name in symbols::program_names() {
            let prog: &mut UProbe = ebpf
                .program_mut(name)
                .ok_or(ProbeError::Missing(name))?
                .try_into()
                .map_err(|e| ProbeError::Program(name, e))?;
            prog.load().map_err(|e| ProbeError::Program(name, e))?;
        }
        let verified = started.elapsed();
        // The send hook first: whether the socket lengths are needed
        // depends on it.
        // Tracepoints of any kind attached, for `check`.
        let mut tracepoints = 0;
        let send_hook = match send_offsets {
            Ok(_) => match attach_tcp(&mut ebpf) {
                Ok(n) => {
                    tracepoints += n;
                    SendHook::Tcp
                }
                Err(e) if syscalls_ready => {
                    log::warn!("send hook: {e}; using the syscall tracepoints instead");
                    SendHook::Syscalls
                }
                Err(e) => return Err(e),
            },
            Err(_) => SendHook::Syscalls,
        };
        let socket_lengths = send_hook == SendHook::Syscalls;
        // The cgroup segment program needs the raw one's offsets too: the
        // raw one is its fallback.
        let scope_plan = match &segment_offsets {
            Ok(_) => segment_scope::plan().and_then(|mount| {
                segment_scope::load(&mut ebpf)
                    .map(|()| mount)
                    .map_err(|e| e.to_string())
            }),
            Err(why) => Err(why.clone()),
        };
        let mut replaced = Vec::new();
        let event_hook = match task_offsets {
            Ok(task) => {
                let wanted = event_hook::Wanted {
                    socket_lengths,
                    switches: cfg.sched_programs,
                    wakeups: cfg.sched_programs && !task.has_sched_info(),
                    segments: segment_offsets.is_ok(),
                    scoped_segments: scope_plan.is_ok(),
                };
                match event_hook::attach_default(&mut ebpf, &wanted) {
                    Ok((attached, covered)) => {
                        tracepoints += attached;
                        replaced = covered;
                        log::info!(
                            "wakeups: {}",
                            if task.has_sched_info() {
                                "read from the woken task's sched_info where it switches in (no \
                             wakeup program)"
                            } else {
                                "BTF tracepoints sched_wakeup, sched_wakeup_new (no sched_info in \
                             this kernel's task_struct)"
                            }
                        );
                        EventHook::Raw
                    }
                    Err(e) => {
                        log::warn!("event hook: {e}; using the classic tracepoints instead");
                        EventHook::Tracepoints
                    }
                }
            }
            Err(why) => {
                log::info!("event hook: classic tracepoints ({why})");
                EventHook::Tracepoints
            }
        };
        let covered = replaced.contains(&"tcp_probe");
        let scope = segment_scope::Scope::new(match scope_plan {
            Ok(_) if !covered => Err("the raw tracepoints failed".into()),
            plan => plan,
        });
        let raw_segments = covered && !scope.scoped();
        match (&segment_offsets, covered) {
            (_, true) if scope.scoped() => log::info!(
                "segments: cgroup_skb ingress on the traced workloads' cgroups (tcp:tcp_probe \
                 host-wide where a workload has none of its own)"
            ),
            (_, true) => log::info!(
                "segments: raw tracepoint tcp:tcp_probe (the socket and segment, read only for \
                 followed connections)"
            ),
            (Err(why), false) => log::info!(
                "segments: classic tracepoint tcp:tcp_probe ({why}): the kernel fills a perf \
                 record of every TCP segment on the host first"
            ),
            (Ok(_), false) => log::info!("segments: classic tracepoint tcp:tcp_probe"),
        }
        for &(name, category, tracepoint) in TRACEPOINTS {
            if replaced.contains(&name)
                || (!socket_lengths && is_socket_length(name))
                || (!cfg.sched_programs && is_scheduler_program(name))
            {
                continue;
            }
            attach_tracepoint(&mut ebpf, name, category, tracepoint)?;
            tracepoints += 1;
        }
        if cfg.sched_programs {
            log::info!("event hook: {}", event_hook.describe());
        } else {
            log::info!(
                "event hook: no scheduler program (--sched sampled: sched_switch and the wakeups \
                 get none); the others as in: {}",
                event_hook.describe()
            );
        }
        if send_hook == SendHook::Syscalls {
            for &(name, tracepoint) in SYSCALL_SEND_TRACEPOINTS {
                attach_tracepoint(&mut ebpf, name, "syscalls", tracepoint)?;
                tracepoints += 1;
            }
        }
        log::info!("send hook: {}", send_hook.describe());
        let traced_ids = byte_arrays::SharedBytes::map(&ebpf, byte_arrays::TRACED_IDS)?;
        let listen_ports = byte_arrays::SharedBytes::map(&ebpf, byte_arrays::LISTEN_PORTS)?;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        log::info!(
            "probes loaded in {:.0} ms: kernel layouts (tracefs, BTF) {:.0} ms, maps and \
             programs loaded and verified {:.0} ms, tracepoint links {:.0} ms",
            ms(started.elapsed()),
            ms(layouts),
            ms(verified - layouts),
            ms(started.elapsed() - verified)
        );
        Ok(Self {
            ebpf,
            send_hook,
            event_hook,
            raw_segments,
            scope,
            tracepoints,
            traced_ids,
            listen_ports,
            netns_known: offsets.sk_net != ABSENT,
            attached: HashMap::new(),
            map_full: BTreeMap::new(),
        })
    }

    /// (programs loaded and accepted by the verifier, tracepoints attached).
    pub fn loaded(&self) -> (usize, usize) {
        let programs = self.ebpf.programs().filter(|(_, p)| p.fd().is_ok()).count();
        (programs, self.tracepoints)
    }

    /// Which send hook is attached.
    pub fn send_hook(&self) -> SendHook {
        self.send_hook
    }

    /// How the per-event (scheduler, socket length) programs are attached.
    pub fn event_hook(&self) -> EventHook {
        self.event_hook
    }
}

/// Loads a tracepoint program (once: several tracepoints may share one)
/// and attaches it.
fn attach_tracepoint(
    ebpf: &mut Ebpf,
    name: &'static str,
    category: &str,
    tracepoint: &str,
) -> Result<(), ProbeError> {
    let prog: &mut TracePoint = ebpf
        .program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|e| ProbeError::Program(name, e))?;
    if prog.fd().is_err() {
        prog.load().map_err(|e| ProbeError::Program(name, e))?;
    }
    prog.attach(category, tracepoint)
        .map_err(|e| ProbeError::Program(name, e))?;
    Ok(())
}
