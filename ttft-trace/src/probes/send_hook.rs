//! The send hook: where the sends and receives on followed connections are
//! seen, and the user buffer of each send read (the head of each response).
//! The raw tracepoints `tcp:tcp_sendmsg_locked` and `tcp:tcp_rcv_space_adjust`
//! (offsets from the kernel's BTF) by default: they run for TCP only. The
//! send syscalls' tracepoints with `sock:sock_send_length` and
//! `sock_recv_length` (every socket call) where they cannot be had.

use aya::{
    Ebpf,
    maps::ProgramArray,
    programs::{Program, ProgramError, RawTracePoint, raw_trace_point::RawTracePointLinkId},
};

use super::ProbeError;

/// Where sends and receives on followed connections are seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendHook {
    /// The raw tracepoints `tcp:tcp_sendmsg_locked` and
    /// `tcp:tcp_rcv_space_adjust`: run for TCP sends and receives only and
    /// read on only for followed connections; other syscalls and sockets
    /// pay nothing.
    Tcp,
    /// `syscalls:sys_{enter,exit}_{write,sendto,writev,sendmsg}` note the
    /// buffer and `sock:sock_send_length` / `sock_recv_length` time each
    /// send and receive of any socket: while attached, every syscall of
    /// every task on the host takes the kernel's slow syscall path
    /// (hundreds of ns each). The fallback.
    Syscalls,
}

impl SendHook {
    pub fn describe(self) -> &'static str {
        match self {
            SendHook::Tcp => {
                "raw tracepoints tcp:tcp_sendmsg_locked and tcp:tcp_rcv_space_adjust (TCP sends \
                 and receives only; no syscall or socket-wide tracepoint)"
            }
            SendHook::Syscalls => {
                "syscall tracepoints sys_enter/sys_exit of write, sendto, writev, sendmsg, and \
                 sock_send_length, sock_recv_length (fallback: every syscall of every task on \
                 the host pays the slow syscall path, every socket call a program run)"
            }
        }
    }
}

/// Forces the send hook, for comparing the two (`cargo xtask bench`) and
/// testing the fallback: `syscalls` or `tcp` (the default).
pub const SEND_HOOK_ENV: &str = "TTFT_TRACE_SEND_HOOK";

/// Programs of the syscall send hook: (program, tracepoint in `syscalls`).
pub(super) const SYSCALL_SEND_TRACEPOINTS: &[(&str, &str)] = &[
    ("sys_enter_write", "sys_enter_write"),
    ("sys_enter_sendto", "sys_enter_sendto"),
    ("sys_enter_writev", "sys_enter_writev"),
    ("sys_enter_sendmsg", "sys_enter_sendmsg"),
    ("sys_exit_send", "sys_exit_write"),
    ("sys_exit_send", "sys_exit_sendto"),
    ("sys_exit_send", "sys_exit_writev"),
    ("sys_exit_send", "sys_exit_sendmsg"),
];

/// The programs of the default send hook, each on the raw tracepoint of
/// its name.
pub(super) const TCP_PROGRAMS: &[&str] = &["tcp_sendmsg_locked", "tcp_rcv_space_adjust"];

/// The socket-length programs: the syscall hook's (classic or raw, see
/// [`super::EventHook`]); the TCP hook does without them.
pub(super) fn is_socket_length(program: &str) -> bool {
    matches!(program, "sock_send_length" | "sock_recv_length")
}

/// Loads and attaches the raw tracepoints of the default send hook, both or
/// neither: on a failure the one attached is detached again, so that the
/// syscall hook can take over without a send counted twice. Returns how
/// many it attached.
pub(super) fn attach_tcp(ebpf: &mut Ebpf) -> Result<usize, ProbeError> {
    let mut links: Vec<(&'static str, RawTracePointLinkId)> = Vec::new();
    for &name in TCP_PROGRAMS {
        match attach_raw(ebpf, name) {
            Ok(link) => links.push((name, link)),
            Err(e) => {
                for (name, link) in links {
                    if let Some(Ok(prog)) =
                        ebpf.program_mut(name).map(<&mut RawTracePoint>::try_from)
                    {
                        let _ = prog.detach(link);
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(TCP_PROGRAMS.len())
}

fn attach_raw(ebpf: &mut Ebpf, name: &'static str) -> Result<RawTracePointLinkId, ProbeError> {
    let prog: &mut RawTracePoint = ebpf
        .program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|e| ProbeError::Program(name, e))?;
    prog.load().map_err(|e| ProbeError::Program(name, e))?;
    prog.attach(name).map_err(|e| ProbeError::Program(name, e))
}

/// The program a send outside any TLS call is handed to where it may carry
/// records a memory BIO held (the eBPF side's `tls_records::hand_over`),
/// and the map that holds it: one per program type, for the raw
/// tracepoints' hooks and for the classic `sock_send_length`.
const HELD_SEND_RAW: (&str, &str) = ("held_send_raw", "HELD_SEND_RAW");
const HELD_SEND_TP: (&str, &str) = ("held_send_tp", "HELD_SEND_TP");

/// Loads the held-send program of the hook that reports sends (`classic`:
/// the classic `sock_send_length`) into its map; the other is never
/// called, so never verified. Where it fails, a memory BIO's records are
/// not bound (its `SSL_write` calls show as held, never sent) and
/// everything else is traced as before.
pub(super) fn load_held_sends(ebpf: &mut Ebpf, classic: bool) -> Result<(), ProbeError> {
    let (name, map) = if classic { HELD_SEND_TP } else { HELD_SEND_RAW };
    let prog = ebpf.program_mut(name).ok_or(ProbeError::Missing(name))?;
    let loaded = match prog {
        Program::TracePoint(p) => p.load(),
        Program::RawTracePoint(p) => p.load(),
        _ => return Err(ProbeError::Missing(name)),
    };
    loaded.map_err(|e| ProbeError::Program(name, e))?;
    let fd = prog
        .fd()
        .and_then(|fd| fd.try_clone().map_err(ProgramError::IOError))
        .map_err(|e| ProbeError::Program(name, e))?;
    let data = ebpf.map_mut(map).ok_or(ProbeError::Missing(map))?;
    let mut slots = ProgramArray::try_from(data).map_err(|e| ProbeError::Map(map, e))?;
    slots.set(0, &fd, 0).map_err(|e| ProbeError::Map(map, e))
}
