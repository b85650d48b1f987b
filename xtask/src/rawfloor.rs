//! The floor of the tracer's default hooks: empty programs (`r0 = 0;
//! exit`) on the raw tracepoints the tracer's default path puts a program
//! on for tasks and connections it does not trace. What they cost is what
//! any program there costs (the kernel's dispatch, and on this machine a
//! retpoline call into the program), against which the tracer's own are
//! judged. Loaded with the bpf() syscall directly, so that the bench needs
//! no compiler and no object file.

use std::os::fd::{FromRawFd as _, OwnedFd};

use anyhow::{Result, bail};

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
const BPF_PROG_TYPE_RAW_TRACEPOINT: u32 = 17;
/// `union bpf_attr` as passed: the kernel takes a shorter one than its
/// own, the rest zero.
const ATTR_SIZE: usize = 128;

/// The attached programs; dropping it detaches them (closing a raw
/// tracepoint's link is immediate).
pub struct Floor {
    _fds: Vec<OwnedFd>,
}

fn bpf(cmd: libc::c_long, attr: &[u8; ATTR_SIZE]) -> Result<OwnedFd> {
    // SAFETY: the attribute buffer is valid for its size, which is passed.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_ptr(), ATTR_SIZE) };
    if fd < 0 {
        bail!("bpf({cmd}): {}", std::io::Error::last_os_error());
    }
    // SAFETY: a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn put(attr: &mut [u8; ATTR_SIZE], at: usize, bytes: &[u8]) {
    attr[at..at + bytes.len()].copy_from_slice(bytes);
}

/// Loads one empty program and attaches it to each of [`TRACEPOINTS`].
pub fn attach() -> Result<Floor> {
    // mov r0, 0; exit
    let insns: [u64; 2] = [0x0000_0000_0000_00b7, 0x0000_0000_0000_0095];
    let license = c"GPL";
    let mut attr = [0u8; ATTR_SIZE];
    put(&mut attr, 0, &BPF_PROG_TYPE_RAW_TRACEPOINT.to_ne_bytes());
    put(&mut attr, 4, &(insns.len() as u32).to_ne_bytes());
    put(&mut attr, 8, &(insns.as_ptr() as u64).to_ne_bytes());
    put(&mut attr, 16, &(license.as_ptr() as u64).to_ne_bytes());
    // prog_name, after log_level, log_size, log_buf, kern_version and
    // prog_flags.
    put(&mut attr, 48, NAME.as_bytes());
    let prog = bpf(BPF_PROG_LOAD, &attr)?;
    let mut fds = Vec::new();
    for tp in TRACEPOINTS {
        let name = std::ffi::CString::new(*tp)?;
        let mut attr = [0u8; ATTR_SIZE];
        put(&mut attr, 0, &(name.as_ptr() as u64).to_ne_bytes());
        put(
            &mut attr,
            8,
            &(std::os::fd::AsRawFd::as_raw_fd(&prog) as u32).to_ne_bytes(),
        );
        fds.push(bpf(BPF_RAW_TRACEPOINT_OPEN, &attr)?);
    }
    fds.push(prog);
    Ok(Floor { _fds: fds })
}
