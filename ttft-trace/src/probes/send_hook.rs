//! The send hook: where the user buffer of a send on a followed connection
//! is noted, so that the head of each response can be read. The raw
//! tracepoint `tcp:tcp_sendmsg_locked` (offsets from the kernel's BTF) by
//! default, the send syscalls' tracepoints where it cannot be had.

use aya::{Ebpf, programs::RawTracePoint};
use ttft_trace_common::{SendOffsets, TracepointOffsets};

use super::{ProbeError, btf};
use crate::tracefs::{self, Format, TracefsError};

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

/// The program and raw tracepoint of the default send hook.
pub(super) const SENDMSG_PROGRAM: &str = "tcp_sendmsg_locked";

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

/// Loads and attaches the raw tracepoint of the default send hook.
pub(super) fn attach_sendmsg(ebpf: &mut Ebpf) -> Result<(), ProbeError> {
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
