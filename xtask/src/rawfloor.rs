//! The floor of the tracer's default hooks: empty programs (`r0 = 0;
//! exit`) on the raw tracepoints the tracer's default path puts a program
//! on for tasks and connections it does not trace. What they cost is what
//! any program there costs (the kernel's dispatch, and on this machine a
//! retpoline call into the program), against which the tracer's own are
//! judged. Loaded with the bpf() syscall directly, so that the bench needs
//! no compiler and no object file. The hook-toggling bench
//! (`hooktoggle.rs`) loads the same program and attaches it by itself, and
//! uses the syscall helpers here for its own bpf() calls.

use std::{
    ffi::CStr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use anyhow::{Context as _, Result};

/// The raw tracepoints of the tracer's default hooks (scheduler, segments,
/// TCP sends and receives).
pub const TRACEPOINTS: &[&str] = &[
    "sched_switch",
    "tcp_probe",
    "tcp_sendmsg_locked",
    "tcp_rcv_space_adjust",
];

/// The programs' name, as bpftool and the run-time statistics show it.
pub const NAME: &str = "empty_raw";

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_RAW_TRACEPOINT_OPEN: libc::c_long = 17;
pub(crate) const BPF_PROG_TYPE_RAW_TRACEPOINT: u32 = 17;
/// `union bpf_attr` as passed: the kernel takes a shorter one than its
/// own, the rest zero.
pub(crate) const ATTR_SIZE: usize = 128;

/// The attached programs; dropping it detaches them (closing a raw
/// tracepoint's link is immediate).
pub struct Floor {
    _fds: Vec<OwnedFd>,
}

/// bpf(`cmd`) on `attr`, which the kernel may write back into (the
/// `*_GET_NEXT_ID` commands do); returns what the syscall returns.
pub(crate) fn call(cmd: libc::c_long, attr: &mut [u8; ATTR_SIZE]) -> std::io::Result<libc::c_long> {
    // SAFETY: the attribute buffer is valid and writable for its size,
    // which is passed; the pointers that callers put inside it are to
    // buffers alive for the call, which the kernel writes only within the
    // lengths given beside them.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), ATTR_SIZE) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// bpf(`cmd`) for a command that returns a new file descriptor.
pub(crate) fn bpf(cmd: libc::c_long, attr: &[u8; ATTR_SIZE]) -> Result<OwnedFd> {
    let fd = call(cmd, &mut { *attr }).with_context(|| format!("bpf({cmd})"))?;
    // SAFETY: a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

pub(crate) fn put(attr: &mut [u8; ATTR_SIZE], at: usize, bytes: &[u8]) {
    attr[at..at + bytes.len()].copy_from_slice(bytes);
}

/// Attaches `prog` to the raw tracepoint `tp` (`BPF_RAW_TRACEPOINT_OPEN`);
/// `None` for a BTF-typed (`tp_btf`) program, which names its tracepoint
/// itself. Closing the returned link detaches it.
pub(crate) fn raw_tp_open(prog: &OwnedFd, tp: Option<&CStr>) -> Result<OwnedFd> {
    let mut attr = [0u8; ATTR_SIZE];
    let name = tp.map_or(0, |n| n.as_ptr() as u64);
    put(&mut attr, 0, &name.to_ne_bytes());
    put(&mut attr, 8, &(prog.as_raw_fd() as u32).to_ne_bytes());
    bpf(BPF_RAW_TRACEPOINT_OPEN, &attr)
}

/// Loads the empty program (`r0 = 0; exit`), unattached.
pub(crate) fn load() -> Result<OwnedFd> {
    // mov r0, 0; exit
    load_insns(
        BPF_PROG_TYPE_RAW_TRACEPOINT,
        &[0x0000_0000_0000_00b7, 0x0000_0000_0000_0095],
        NAME,
    )
}

/// Loads the program `insns` of type `prog_type` under `name` (at most 15
/// bytes), GPL-licensed, unattached.
pub(crate) fn load_insns(prog_type: u32, insns: &[u64], name: &str) -> Result<OwnedFd> {
    let license = c"GPL";
    let mut attr = [0u8; ATTR_SIZE];
    put(&mut attr, 0, &prog_type.to_ne_bytes());
    put(&mut attr, 4, &(insns.len() as u32).to_ne_bytes());
    put(&mut attr, 8, &(insns.as_ptr() as u64).to_ne_bytes());
    put(&mut attr, 16, &(license.as_ptr() as u64).to_ne_bytes());
    // prog_name, after log_level, log_size, log_buf, kern_version and
    // prog_flags.
    put(&mut attr, 48, &name.as_bytes()[..name.len().min(15)]);
    bpf(BPF_PROG_LOAD, &attr)
}

/// Loads one empty program and attaches it to each of [`TRACEPOINTS`].
pub fn attach() -> Result<Floor> {
    let prog = load()?;
    let mut fds = Vec::new();
    for tp in TRACEPOINTS {
        let name = std::ffi::CString::new(*tp)?;
        fds.push(raw_tp_open(&prog, Some(&name))?);
    }
    fds.push(prog);
    Ok(Floor { _fds: fds })
}
