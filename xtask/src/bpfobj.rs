//! The host's BPF links and programs, read with the bpf() syscall: which
//! links exist, which a process holds, what each attaches (type, program,
//! tracepoint), and a program's type, name and run count. The hook-toggle
//! bench finds the tracer's own links with these.

use std::{
    collections::BTreeSet,
    os::fd::{AsRawFd as _, OwnedFd},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use crate::rawfloor::{ATTR_SIZE, bpf, call, put};

pub(crate) const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
pub(crate) const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
pub(crate) const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
pub(crate) const BPF_LINK_GET_NEXT_ID: libc::c_long = 31;
pub(crate) const BPF_LINK_TYPE_RAW_TRACEPOINT: u32 = 1;
pub(crate) const BPF_LINK_TYPE_CGROUP: u32 = 3;
pub(crate) const BPF_LINK_TYPE_PERF_EVENT: u32 = 7;
pub(crate) const BPF_PROG_TYPE_TRACING: u32 = 26;

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Whether a bpf() error says the object is gone (ENOENT).
pub(crate) fn gone(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::raw_os_error)
        == Some(libc::ENOENT)
}

/// The ids of the host's BPF links now.
pub(crate) fn link_ids() -> Result<BTreeSet<u32>> {
    let mut ids = BTreeSet::new();
    let mut id = 0u32;
    loop {
        let mut attr = [0u8; ATTR_SIZE];
        put(&mut attr, 0, &id.to_ne_bytes());
        match call(BPF_LINK_GET_NEXT_ID, &mut attr) {
            Ok(_) => id = u32_at(&attr, 4),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(ids),
            Err(e) => return Err(e).context("BPF_LINK_GET_NEXT_ID"),
        }
        ids.insert(id);
    }
}

/// The object of `id` (`cmd`: a `*_GET_FD_BY_ID`), `None` when it is gone.
pub(crate) fn open_id(cmd: libc::c_long, id: u32) -> Result<Option<OwnedFd>> {
    let mut attr = [0u8; ATTR_SIZE];
    put(&mut attr, 0, &id.to_ne_bytes());
    match bpf(cmd, &attr) {
        Ok(fd) => Ok(Some(fd)),
        Err(e) if gone(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `BPF_OBJ_GET_INFO_BY_FD` into `info` (zeroed but for the input fields
/// the caller set, pointers to buffers alive meanwhile).
pub(crate) fn info(fd: &OwnedFd, info: &mut [u8]) -> Result<()> {
    let mut attr = [0u8; ATTR_SIZE];
    put(&mut attr, 0, &(fd.as_raw_fd() as u32).to_ne_bytes());
    put(&mut attr, 4, &(info.len() as u32).to_ne_bytes());
    put(&mut attr, 8, &(info.as_mut_ptr() as u64).to_ne_bytes());
    call(BPF_OBJ_GET_INFO_BY_FD, &mut attr).context("BPF_OBJ_GET_INFO_BY_FD")?;
    Ok(())
}

/// A link: its type, program, and name (raw tracepoint: the tracepoint;
/// perf event: the classic tracepoint or the uprobe's file), and for a perf
/// event its kind (`enum bpf_perf_event_type`).
pub(crate) struct Link {
    pub(crate) kind: u32,
    pub(crate) prog_id: u32,
    pub(crate) name: String,
    pub(crate) perf_kind: u32,
}

pub(crate) fn link(id: u32) -> Result<Option<Link>> {
    let Some(fd) = open_id(BPF_LINK_GET_FD_BY_ID, id)? else {
        return Ok(None);
    };
    // struct bpf_link_info: type, id, prog_id, then the per-type union at
    // 16. The name is asked for only where the type has one: the union's
    // other members would read the pointer as something else.
    let mut buf = [0u8; ATTR_SIZE];
    info(&fd, &mut buf)?;
    let kind = u32_at(&buf, 0);
    let name_at = match kind {
        BPF_LINK_TYPE_RAW_TRACEPOINT => Some(16),
        // perf_event: its type, 4 bytes of padding, then the name pointer
        // and length of both the uprobe and the tracepoint members.
        BPF_LINK_TYPE_PERF_EVENT => Some(24),
        _ => None,
    };
    let mut name = vec![0u8; 4096];
    if let Some(at) = name_at {
        buf = [0u8; ATTR_SIZE];
        put(&mut buf, at, &(name.as_mut_ptr() as u64).to_ne_bytes());
        put(&mut buf, at + 8, &(name.len() as u32).to_ne_bytes());
        info(&fd, &mut buf)?;
    }
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(Some(Link {
        kind,
        prog_id: u32_at(&buf, 8),
        name: String::from_utf8_lossy(&name[..end]).into_owned(),
        perf_kind: u32_at(&buf, 16),
    }))
}

/// A program's type, name and run count (counted while the kernel's
/// statistics are on).
pub(crate) fn prog_info(fd: &OwnedFd) -> Result<(u32, String, u64)> {
    // struct bpf_prog_info: type at 0, name[16] at 64, run_cnt at 200.
    let mut buf = [0u8; 256];
    info(fd, &mut buf)?;
    let name = buf[64..80].split(|&b| b == 0).next().unwrap_or_default();
    let run_cnt = u64::from_ne_bytes(buf[200..208].try_into()?);
    Ok((
        u32_at(&buf, 0),
        String::from_utf8_lossy(name).into_owned(),
        run_cnt,
    ))
}

/// The ids of the BPF links process `pid` holds open (its fdinfo says).
pub(crate) fn held_links(pid: u32) -> Result<BTreeSet<u32>> {
    let mut ids = BTreeSet::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))?.flatten() {
        // A file closed meanwhile is no link of the tracer's.
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let id = text
            .lines()
            .find_map(|l| l.strip_prefix("link_id:"))
            .and_then(|v| v.trim().parse::<u32>().ok());
        ids.extend(id);
    }
    Ok(ids)
}

/// The link ids once no new one has come for 300 ms (the tracer says it
/// is attached before its last links are made, at most 5 s).
pub(crate) fn settled_link_ids() -> Result<BTreeSet<u32>> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut ids = link_ids()?;
    loop {
        thread::sleep(Duration::from_millis(300));
        let now = link_ids()?;
        if now == ids || Instant::now() > deadline {
            return Ok(now);
        }
        ids = now;
    }
}
