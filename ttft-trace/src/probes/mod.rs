//! Loading the eBPF object, attaching its programs, and reading its maps.

pub mod btf;
pub mod libraries;
mod selftest;
pub mod symbols;

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{RawTracePoint, TracePoint, UProbe, uprobe::UProbeScope},
};
use thiserror::Error;
use ttft_trace_common::signals::{RUNQ_BUCKETS, RUNQ_SUM_SLOT, SchedTotals};
use ttft_trace_common::{
    GpuCounters, MAP_FULL_STATS, SendOffsets, Stat, TracepointOffsets, offsets::ABSENT,
};

use crate::tracefs::{self, Format, TracefsError};
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
        crate::caps::missing_message(*caps, &[crate::caps::UPROBES])
    )]
    UprobeDenied {
        path: PathBuf,
        caps: crate::caps::CapSet,
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
    #[error("cannot stat {0}: {1}")]
    Stat(PathBuf, std::io::Error),
}

/// Load-time settings of the probes.
#[derive(Debug, Clone, Copy)]
pub struct LoadConfig {
    /// Ring buffer size in bytes.
    pub ringbuf_bytes: u32,
    /// Scheduler intervals at least this long are sent as events.
    pub sched_min_ns: u64,
    /// Copy calls at least this large are sent as events.
    pub large_copy_bytes: u64,
    /// Daemon mode: announce untraced processes calling probed libraries.
    pub discover: bool,
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
}

/// Where the user buffer of a send on a followed connection is noted, so
/// that the head of each response can be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendHook {
    /// The raw tracepoint `tcp:tcp_sendmsg_locked`: runs for TCP sends only
    /// and reads on only for followed connections; other syscalls pay
    /// nothing.
    TcpSendmsgLocked,
    /// `syscalls:sys_{enter,exit}_{write,sendto,writev,sendmsg}`: while
    /// attached, every syscall of every task on the host takes the kernel's
    /// slow syscall path (hundreds of ns each). The fallback.
    Syscalls,
}

impl SendHook {
    pub fn describe(self) -> &'static str {
        match self {
            SendHook::TcpSendmsgLocked => {
                "raw tracepoint tcp:tcp_sendmsg_locked (TCP sends only; no syscall tracepoint)"
            }
            SendHook::Syscalls => {
                "syscall tracepoints sys_enter/sys_exit of write, sendto, writev, sendmsg \
                 (fallback: every syscall of every task on the host pays the slow syscall path)"
            }
        }
    }

    /// (programs loaded, tracepoints attached) for this hook.
    pub fn programs(self) -> (usize, usize) {
        match self {
            SendHook::TcpSendmsgLocked => (1, 1),
            SendHook::Syscalls => {
                let mut names: Vec<&str> =
                    SYSCALL_SEND_TRACEPOINTS.iter().map(|(p, _)| *p).collect();
                names.sort_unstable();
                names.dedup();
                (names.len(), SYSCALL_SEND_TRACEPOINTS.len())
            }
        }
    }
}

/// Forces the send hook, for comparing the two (`cargo xtask bench`) and
/// testing the fallback: `syscalls` or `tcp_sendmsg_locked`.
pub const SEND_HOOK_ENV: &str = "TTFT_TRACE_SEND_HOOK";

/// The send hook this host gets, with the BTF offsets it needs, or why the
/// fallback is used.
pub fn send_hook_plan() -> Result<SendOffsets, String> {
    match std::env::var(SEND_HOOK_ENV).as_deref() {
        Ok("syscalls") => return Err(format!("{SEND_HOOK_ENV}=syscalls")),
        Ok("tcp_sendmsg_locked") | Err(_) => {}
        Ok(other) => log::warn!("{SEND_HOOK_ENV}={other} is not a send hook; ignored"),
    }
    let btf = btf::Btf::vmlinux().map_err(|e| e.to_string())?;
    btf::send_offsets(&btf).map_err(|e| e.to_string())
}

/// Programs of the syscall send hook: (program, tracepoint in `syscalls`).
const SYSCALL_SEND_TRACEPOINTS: &[(&str, &str)] = &[
    ("sys_enter_write", "sys_enter_write"),
    ("sys_enter_sendto", "sys_enter_sendto"),
    ("sys_enter_writev", "sys_enter_writev"),
    ("sys_enter_sendmsg", "sys_enter_sendmsg"),
    ("sys_exit_send", "sys_exit_write"),
    ("sys_exit_send", "sys_exit_sendto"),
    ("sys_exit_send", "sys_exit_writev"),
    ("sys_exit_send", "sys_exit_sendmsg"),
];

/// The program and raw tracepoint of the default send hook.
const SENDMSG_PROGRAM: &str = "tcp_sendmsg_locked";

/// The loaded programs and the libraries they are attached to.
pub struct Probes {
    ebpf: Ebpf,
    send_hook: SendHook,
    /// Libraries attached, by the file they land on: uprobes attach to a
    /// file, and fire in every process that maps it.
    attached: HashMap<FileId, Attached>,
    /// Inserts refused from userspace because the map was full, by map.
    map_full: BTreeMap<&'static str, u64>,
}

/// Tracepoints and the programs attached to them: (program, category, name).
/// The send hook's come on top (see [`SendHook`]).
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

/// Reads the syscall send hook's fields into `offsets`: only that hook
/// needs them (CONFIG_FTRACE_SYSCALLS may be off where the default works).
pub fn syscall_offsets(offsets: &mut TracepointOffsets) -> Result<(), TracefsError> {
    let root = tracefs::root()?;
    let write = Format::read(&root, "syscalls", "sys_enter_write")?;
    let sendto = Format::read(&root, "syscalls", "sys_enter_sendto")?;
    let writev = Format::read(&root, "syscalls", "sys_enter_writev")?;
    let sendmsg = Format::read(&root, "syscalls", "sys_enter_sendmsg")?;
    offsets.write_buf = write.offset("buf")?;
    offsets.sendto_buf = sendto.offset("buff")?;
    offsets.writev_vec = writev.offset("vec")?;
    offsets.writev_vlen = writev.offset("vlen")?;
    offsets.sendmsg_msg = sendmsg.offset("msg")?;
    Ok(())
}

impl Probes {
    /// Loads every program, attaches the process-tree tracepoints. Uprobes
    /// wait for [`Probes::attach_library`].
    pub fn load(cfg: &LoadConfig) -> Result<Self, ProbeError> {
        let ringbuf_bytes = cfg.ringbuf_bytes;
        if OBJECT.is_empty() {
            return Err(ProbeError::NoObject);
        }
        let caps = crate::caps::CapSet::effective().unwrap_or_default();
        let missing = crate::caps::missing(caps, crate::caps::LOAD);
        if !missing.is_empty() {
            return Err(ProbeError::Capabilities(crate::caps::missing_message(
                caps, &missing,
            )));
        }
        let mut offsets = tracepoint_offsets()?;
        let send_offsets = send_hook_plan();
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
        let mut ebpf = EbpfLoader::new()
            .override_global("OFFSETS", &offsets, true)
            .override_global(
                "SEND_OFFSETS",
                send_offsets.as_ref().unwrap_or(&SendOffsets::default()),
                true,
            )
            .override_global("WAKEUP_BYTES", &wakeup_bytes, true)
            .override_global("SCHED_MIN_NS", &cfg.sched_min_ns, true)
            .override_global("LARGE_COPY_BYTES", &cfg.large_copy_bytes, true)
            .override_global("DISCOVER", &u32::from(cfg.discover), true)
            .map_max_entries("EVENTS", ringbuf_bytes)
            .load(OBJECT)
            .map_err(ProbeError::Load)?;
        for name in symbols::program_names() {
            let prog: &mut UProbe = ebpf
                .program_mut(name)
                .ok_or(ProbeError::Missing(name))?
                .try_into()
                .map_err(|e| ProbeError::Program(name, e))?;
            prog.load().map_err(|e| ProbeError::Program(name, e))?;
        }
        for &(name, category, tracepoint) in TRACEPOINTS {
            attach_tracepoint(&mut ebpf, name, category, tracepoint)?;
        }
        let send_hook = match send_offsets {
            Ok(_) => match attach_sendmsg(&mut ebpf) {
                Ok(()) => SendHook::TcpSendmsgLocked,
                Err(e) if syscalls_ready => {
                    log::warn!("send hook: {e}; using the syscall tracepoints instead");
                    SendHook::Syscalls
                }
                Err(e) => return Err(e),
            },
            Err(_) => SendHook::Syscalls,
        };
        if send_hook == SendHook::Syscalls {
            for &(name, tracepoint) in SYSCALL_SEND_TRACEPOINTS {
                attach_tracepoint(&mut ebpf, name, "syscalls", tracepoint)?;
            }
        }
        log::info!("send hook: {}", send_hook.describe());
        Ok(Self {
            ebpf,
            send_hook,
            attached: HashMap::new(),
            map_full: BTreeMap::new(),
        })
    }

    /// Which send hook is attached.
    pub fn send_hook(&self) -> SendHook {
        self.send_hook
    }

    /// Attaches the probes to one library, once per file. Returns None when
    /// the file was attached before.
    pub fn attach_library(&mut self, lib: &CudaLibrary) -> Result<Option<Attached>, ProbeError> {
        // The real file's identity: one set of probes however many mount
        // namespaces or overlays show it.
        let key = lib.id.clone();
        if self.attached.contains_key(&key) {
            return Ok(None);
        }
        let mut report = Attached {
            path: lib.path.clone(),
            apis: lib.apis.iter().copied().collect(),
            symbols: 0,
            failed: Vec::new(),
        };
        for (sym, offset) in &lib.symbols {
            match self.attach_symbol(sym, *offset, lib) {
                Ok(()) => report.symbols += 1,
                // Every other symbol would fail the same way: say why, once.
                Err(e @ ProbeError::UprobeDenied { .. }) => return Err(e),
                Err(e) => report.failed.push((sym.name.to_string(), e.to_string())),
            }
        }
        self.attached.insert(key, report.clone());
        Ok(Some(report))
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
    ) -> Result<(), ProbeError> {
        let ret_link = if sym.needs_return {
            let ret_name = sym.api.return_program();
            let ret = uprobe(&mut self.ebpf, ret_name)?;
            let link = ret
                .attach(offset, &lib.open_path, UProbeScope::AllProcesses)
                .map_err(|e| uprobe_error(ret_name, &lib.path, e))?;
            Some((ret_name, link))
        } else {
            None
        };
        let entry = uprobe(&mut self.ebpf, sym.program)?;
        if let Err(e) = entry.attach(offset, &lib.open_path, UProbeScope::AllProcesses) {
            if let Some((ret_name, link)) = ret_link {
                let ret = uprobe(&mut self.ebpf, ret_name)?;
                let _ = ret.detach(link);
            }
            return Err(uprobe_error(sym.program, &lib.path, e));
        }
        Ok(())
    }

    pub fn attached(&self) -> impl Iterator<Item = &Attached> {
        self.attached.values()
    }

    /// Starts tracing a process as part of `workload` (the root's tgid);
    /// its children are added by the kernel, in the same workload. A full
    /// map is counted and warned about, not an error: the process is then
    /// not traced, everything else is.
    pub fn track(&mut self, pid: u32, workload: u32) -> Result<(), ProbeError> {
        let mut map: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(
            self.ebpf
                .map_mut("TRACKED")
                .ok_or(ProbeError::Missing("TRACKED"))?,
        )
        .map_err(|e| ProbeError::Map("TRACKED", e))?;
        let result = map.insert(pid, workload, 0);
        self.full_unless_stored("TRACKED", result, || format!("process {pid}"))
    }

    /// Counts an insert refused because its map is full (E2BIG; ENOMEM for
    /// maps allocated as they fill), with a warning; other errors are errors.
    fn full_unless_stored(
        &mut self,
        name: &'static str,
        result: Result<(), aya::maps::MapError>,
        what: impl FnOnce() -> String,
    ) -> Result<(), ProbeError> {
        match result {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e))
                if matches!(e.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOMEM)) =>
            {
                *self.map_full.entry(name).or_default() += 1;
                log::warn!("eBPF map {name} is full: {} not stored", what());
                Ok(())
            }
            Err(e) => Err(ProbeError::Map(name, e)),
        }
    }

    /// Inserts refused because the map was full, by map, since the start:
    /// in the kernel (the [`MAP_FULL_STATS`]) and from here.
    pub fn map_full(&self) -> Result<Vec<(&'static str, u64)>, ProbeError> {
        MAP_FULL_STATS
            .iter()
            .map(|&(stat, name)| {
                let here = self.map_full.get(name).copied().unwrap_or(0);
                Ok((name, self.stat(stat)?.wrapping_add(here)))
            })
            .collect()
    }

    /// Lets the kernel announce `tgid` again (its pid may be reused).
    pub fn forget_announced(&mut self, tgid: u32) -> Result<(), ProbeError> {
        remove_key::<u64>(&mut self.ebpf, "ANNOUNCED", tgid)
    }

    /// Marks a TCP port as a listening port of the traced tree: connections
    /// accepted on it are followed as server connections.
    pub fn add_listen_port(&mut self, port: u16) -> Result<(), ProbeError> {
        let mut map: BpfHashMap<_, u16, u32> = BpfHashMap::try_from(
            self.ebpf
                .map_mut("LISTEN_PORTS")
                .ok_or(ProbeError::Missing("LISTEN_PORTS"))?,
        )
        .map_err(|e| ProbeError::Map("LISTEN_PORTS", e))?;
        let result = map.insert(port, 1, 0);
        self.full_unless_stored("LISTEN_PORTS", result, || format!("port {port}"))
    }

    /// Stops tracing an id (a process that exited, or a thread's id).
    pub fn untrack(&mut self, pid: u32) -> Result<(), ProbeError> {
        remove_key::<u32>(&mut self.ebpf, "TRACKED", pid)
    }

    /// Ids in the tracked map (processes and, transiently, threads), each
    /// with its workload id.
    pub fn tracked(&self) -> Result<Vec<(u32, u32)>, ProbeError> {
        let map: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(
            self.ebpf
                .map("TRACKED")
                .ok_or(ProbeError::Missing("TRACKED"))?,
        )
        .map_err(|e| ProbeError::Map("TRACKED", e))?;
        Ok(map.iter().filter_map(Result::ok).collect())
    }

    /// The workload of a tracked id, if it is tracked now.
    pub fn tracked_workload(&self, id: u32) -> Result<Option<u32>, ProbeError> {
        self.lookup_workload("TRACKED", id)
    }

    /// The workload an event's process belongs to: tracked now, or a traced
    /// process that has exited (its last events may still be in the ring
    /// buffer when its exit removed it from TRACKED).
    pub fn workload_of(&self, id: u32) -> Result<Option<u32>, ProbeError> {
        match self.lookup_workload("TRACKED", id)? {
            Some(w) => Ok(Some(w)),
            None => self.lookup_workload("EXITED", id),
        }
    }

    fn lookup_workload(&self, name: &'static str, id: u32) -> Result<Option<u32>, ProbeError> {
        let map: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(self.ebpf.map(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        match map.get(&id, 0) {
            Ok(w) => Ok(Some(w)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(ProbeError::Map(name, e)),
        }
    }

    /// Per-process counters, summed over CPUs.
    pub fn counters(&self) -> Result<BTreeMap<u32, GpuCounters>, ProbeError> {
        self.per_process("COUNTERS", GpuCounters::add)
    }

    /// Reads a per-CPU map keyed by tgid, summing each value over CPUs.
    fn per_process<V: aya::Pod + Default>(
        &self,
        name: &'static str,
        add: fn(&mut V, &V),
    ) -> Result<BTreeMap<u32, V>, ProbeError> {
        let map: PerCpuHashMap<_, u32, V> =
            PerCpuHashMap::try_from(self.ebpf.map(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        let mut out = BTreeMap::new();
        for entry in map.iter() {
            let (tgid, per_cpu) = entry.map_err(|e| ProbeError::Map(name, e))?;
            let mut sum = V::default();
            for c in per_cpu.iter() {
                add(&mut sum, c);
            }
            out.insert(tgid, sum);
        }
        Ok(out)
    }

    /// Forgets a process's counters once they have been read for the last time.
    pub fn drop_counters(&mut self, tgid: u32) -> Result<(), ProbeError> {
        self.drop_per_cpu::<GpuCounters>("COUNTERS", tgid)
    }

    /// Forgets a process's scheduler totals once they have been read for
    /// the last time.
    pub fn drop_sched_totals(&mut self, tgid: u32) -> Result<(), ProbeError> {
        self.drop_per_cpu::<SchedTotals>("SCHED_TOTALS", tgid)
    }

    fn drop_per_cpu<V: aya::Pod>(
        &mut self,
        name: &'static str,
        tgid: u32,
    ) -> Result<(), ProbeError> {
        let mut map: PerCpuHashMap<_, u32, V> =
            PerCpuHashMap::try_from(self.ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?)
                .map_err(|e| ProbeError::Map(name, e))?;
        match map.remove(&tgid) {
            // An LRU map may have evicted it already.
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(e) => Err(ProbeError::Map(name, e)),
        }
    }

    /// Exited processes whose workload the kernel still keeps (EXITED),
    /// for events read after their exit.
    pub fn exited(&self) -> Result<Vec<u32>, ProbeError> {
        let map: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(
            self.ebpf
                .map("EXITED")
                .ok_or(ProbeError::Missing("EXITED"))?,
        )
        .map_err(|e| ProbeError::Map("EXITED", e))?;
        Ok(map.keys().filter_map(Result::ok).collect())
    }

    /// Forgets an exited process's workload, its last events read.
    pub fn forget_exited(&mut self, tgid: u32) -> Result<(), ProbeError> {
        remove_key::<u32>(&mut self.ebpf, "EXITED", tgid)
    }

    /// Per-process scheduler totals, summed over CPUs.
    pub fn sched_totals(&self) -> Result<BTreeMap<u32, SchedTotals>, ProbeError> {
        self.per_process("SCHED_TOTALS", SchedTotals::add)
    }

    /// The run-queue delay histogram (bucket counts, sum in ns), summed over CPUs.
    pub fn runq_histogram(&self) -> Result<(Vec<u64>, u64), ProbeError> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("RUNQ_HIST")
                .ok_or(ProbeError::Missing("RUNQ_HIST"))?,
        )
        .map_err(|e| ProbeError::Map("RUNQ_HIST", e))?;
        let slot = |i: u32| -> Result<u64, ProbeError> {
            let v = map
                .get(&i, 0)
                .map_err(|e| ProbeError::Map("RUNQ_HIST", e))?;
            Ok(v.iter().copied().fold(0u64, u64::wrapping_add))
        };
        let buckets = (0..RUNQ_BUCKETS).map(slot).collect::<Result<Vec<_>, _>>()?;
        Ok((buckets, slot(RUNQ_SUM_SLOT)?))
    }

    /// A kernel statistic, summed over CPUs.
    pub fn stat(&self, stat: Stat) -> Result<u64, ProbeError> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("STATS_MAP")
                .ok_or(ProbeError::Missing("STATS_MAP"))?,
        )
        .map_err(|e| ProbeError::Map("STATS_MAP", e))?;
        let values = map
            .get(&(stat as u32), 0)
            .map_err(|e| ProbeError::Map("STATS_MAP", e))?;
        Ok(values.iter().copied().fold(0u64, u64::wrapping_add))
    }

    /// Takes the ring buffer out, for the event loop to own.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .ok_or(ProbeError::Missing("EVENTS"))?;
        RingBuf::try_from(map).map_err(|e| ProbeError::Map("EVENTS", e))
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

/// Loads and attaches the raw tracepoint of the default send hook.
fn attach_sendmsg(ebpf: &mut Ebpf) -> Result<(), ProbeError> {
    let prog: &mut RawTracePoint = ebpf
        .program_mut(SENDMSG_PROGRAM)
        .ok_or(ProbeError::Missing(SENDMSG_PROGRAM))?
        .try_into()
        .map_err(|e| ProbeError::Program(SENDMSG_PROGRAM, e))?;
    prog.load()
        .map_err(|e| ProbeError::Program(SENDMSG_PROGRAM, e))?;
    prog.attach(SENDMSG_PROGRAM)
        .map_err(|e| ProbeError::Program(SENDMSG_PROGRAM, e))?;
    Ok(())
}

/// Removes a key from a hash map keyed by tgid; a missing key is fine.
fn remove_key<V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    key: u32,
) -> Result<(), ProbeError> {
    let map = ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
    match BpfHashMap::<_, u32, V>::try_from(map).and_then(|mut m| m.remove(&key)) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        Err(e) => Err(ProbeError::Map(name, e)),
    }
}

/// A uprobe attach error; a permission error of perf_event_open names the
/// capability the kernel wants.
fn uprobe_error(
    program: &'static str,
    path: &std::path::Path,
    e: aya::programs::ProgramError,
) -> ProbeError {
    if let aya::programs::ProgramError::SyscallError(aya::sys::SyscallError { call, io_error }) = &e
        && *call == "perf_event_open"
        && matches!(io_error.raw_os_error(), Some(libc::EACCES | libc::EPERM))
    {
        return ProbeError::UprobeDenied {
            path: path.to_path_buf(),
            caps: crate::caps::CapSet::effective().unwrap_or_default(),
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
