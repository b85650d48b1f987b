//! Ending without waiting for the kernel to take the probes out.
//!
//! Closing a uprobe perf event waits for a grace period under the kernel's
//! `event_mutex` (Linux 6.18: 68–124 ms each, serialised), and a process's
//! exit does those closes before its parent sees it exit: with the stub
//! runtime and driver (64 perf events) the daemon took 6.4 s to exit after
//! SIGINT. `uprobe_multi` links would detach with one grace period, but
//! aya 0.14 cannot load a program for them. A classic tracepoint's perf
//! event is as slow to close (64–84 ms each here: the seven of them made
//! `attach` take 535 ms to exit); the raw and BTF tracepoints' links close
//! at once.
//!
//! So at the end a child process is forked that holds only the perf-event
//! links (aya attaches a perf event through a BPF link, which holds it) of
//! the uprobes and the classic tracepoints; every other descriptor is
//! closed: the raw and BTF tracepoints detach, and the /metrics port, the
//! JSONL file and the ring buffer are free at once. When this process
//! exits, its own closes are cheap (the child still holds each perf event);
//! the child then exits and the kernel detaches in its exit. Until it has,
//! the programs still run on the probed functions and tracepoints (and
//! write to a ring buffer no one reads). The child is in its own session,
//! ignores the signals a terminal or service manager sends, and is named
//! `ttft-detach`.

use std::{ffi::CString, fs, io, os::fd::RawFd};

/// What `readlink /proc/self/fd/N` says of a BPF link and a perf event.
const BPF_LINK: &[u8] = b"anon_inode:bpf_link";
const PERF_EVENT: &[u8] = b"anon_inode:[perf_event]";

/// `bpf(2)` command, link type and perf event types (uapi `linux/bpf.h`).
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_TYPE_PERF_EVENT: u32 = 7;
const BPF_PERF_EVENT_UPROBE: u32 = 1;
const BPF_PERF_EVENT_URETPROBE: u32 = 2;
const BPF_PERF_EVENT_TRACEPOINT: u32 = 5;

/// A descriptor to hand to the child, with its `/proc/self/fd` path made
/// before the fork (the child may not allocate).
struct Held {
    fd: RawFd,
    path: CString,
}

/// Forks the child that holds this process's perf events past its exit.
/// Returns its pid and how many it holds, or None when there are none.
pub fn detach_in_background() -> io::Result<Option<(i32, usize)>> {
    // The pipe first: a descriptor listed below may be closed meanwhile by
    // a thread detaching a library's probes, and its number taken by the
    // next open. Made after the listing, the pipe's write end could take
    // such a number, and the child would keep it and wait for itself.
    let mut pipe = [0; 2];
    // SAFETY: a two-element array for pipe2 to fill.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let [read_end, write_end] = pipe;
    let close_pipe = || {
        // SAFETY: both ends are ours, closed once.
        unsafe {
            libc::close(read_end);
            libc::close(write_end);
        }
    };
    let keep = match perf_event_fds() {
        Ok(fds) => fds
            .into_iter()
            .filter(|h| h.fd != read_end && h.fd != write_end)
            .collect::<Vec<_>>(),
        Err(e) => {
            close_pipe();
            return Err(e);
        }
    };
    if keep.is_empty() {
        close_pipe();
        return Ok(None);
    }
    // SAFETY: the child runs only async-signal-safe system calls (no
    // allocation, no locks) before `_exit`, as a fork of a threaded
    // process must.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = io::Error::last_os_error();
        close_pipe();
        return Err(e);
    }
    if pid == 0 {
        hold_until_parent_exits(&keep, read_end);
    }
    // The write end stays open until this process exits: its close is the
    // child's cue. The read end is the child's alone.
    // SAFETY: ours, closed once.
    unsafe { libc::close(read_end) };
    Ok(Some((pid, keep.len())))
}

/// The child: keeps the descriptors of `keep` (ascending, none of them
/// `read_end`) that are still perf events (another thread may have closed
/// one after the listing and an open reused its number) and `read_end`,
/// closes every other, waits for the parent to be gone (end of file on the
/// pipe), then exits.
fn hold_until_parent_exits(keep: &[Held], read_end: RawFd) -> ! {
    // SAFETY: async-signal-safe system calls on values owned by this
    // process; `_exit` never returns.
    unsafe {
        libc::setsid();
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGPIPE] {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::prctl(libc::PR_SET_NAME, c"ttft-detach".as_ptr(), 0, 0, 0);
        let mut next: libc::c_uint = 0;
        // `read_end` among the kept, in order, with no allocation.
        let mut pipe_kept = false;
        let keep_fd = |fd: RawFd, next: &mut libc::c_uint| {
            let fd = fd as libc::c_uint;
            if fd > *next {
                libc::syscall(libc::SYS_close_range, *next, fd - 1, 0);
            }
            *next = fd + 1;
        };
        for held in keep {
            if !pipe_kept && read_end < held.fd {
                keep_fd(read_end, &mut next);
                pipe_kept = true;
            }
            keep_fd(held.fd, &mut next);
            if !slow_to_close(held) {
                libc::close(held.fd);
            }
        }
        if !pipe_kept {
            keep_fd(read_end, &mut next);
        }
        libc::syscall(libc::SYS_close_range, next, libc::c_uint::MAX, 0);
        let mut byte = 0u8;
        loop {
            let n = libc::read(read_end, (&raw mut byte).cast(), 1);
            if n == 0 || (n < 0 && *libc::__errno_location() != libc::EINTR) {
                break;
            }
        }
        libc::_exit(0)
    }
}

/// This process's perf-event descriptors slow to close (see
/// [`slow_to_close`]), in ascending order.
fn perf_event_fds() -> io::Result<Vec<Held>> {
    let mut fds = Vec::new();
    for entry in fs::read_dir("/proc/self/fd")? {
        let entry = entry?;
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(path) = CString::new(format!("/proc/self/fd/{fd}")) else {
            continue;
        };
        let held = Held { fd, path };
        if slow_to_close(&held) {
            fds.push(held);
        }
    }
    fds.sort_unstable_by_key(|h| h.fd);
    Ok(fds)
}

/// Whether a descriptor is one slow to close: a BPF link of a uprobe or
/// tracepoint perf event, or a bare perf event (only uprobes leave those
/// here). Async-signal-safe: the child checks again with it.
fn slow_to_close(held: &Held) -> bool {
    let mut target = [0u8; 64];
    // SAFETY: readlink(2) writes at most `target.len()` bytes into it.
    let n = unsafe { libc::readlink(held.path.as_ptr(), target.as_mut_ptr().cast(), target.len()) };
    let Ok(n) = usize::try_from(n) else {
        return false;
    };
    let target = &target[..n.min(target.len())];
    target == PERF_EVENT || (target == BPF_LINK && is_perf_event_link(held.fd))
}

/// Whether the BPF link `fd` attaches a program to a uprobe or tracepoint
/// perf event.
fn is_perf_event_link(fd: RawFd) -> bool {
    // `struct bpf_link_info`: type, id, prog_id, then (8-aligned, at 16)
    // the union whose `perf_event` member starts with its own type. Zeroed
    // and larger than read: the kernel fills what it has.
    let mut info = [0u64; 16];
    // `struct bpf_attr`'s `info`: bpf_fd, info_len, info (pointer).
    let mut attr = [0u64; 2];
    attr[0] = u64::from(fd as u32) | ((std::mem::size_of_val(&info) as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    // SAFETY: both buffers outlive the call and have the sizes given.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    let link_type = info[0] as u32;
    let perf_type = info[2] as u32;
    rc == 0
        && link_type == BPF_LINK_TYPE_PERF_EVENT
        && matches!(
            perf_type,
            BPF_PERF_EVENT_UPROBE | BPF_PERF_EVENT_URETPROBE | BPF_PERF_EVENT_TRACEPOINT
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_perf_events_are_held() {
        // A pipe (what the child's cue is) and a file: neither is kept,
        // whatever their numbers.
        let mut pipe = [0; 2];
        // SAFETY: a two-element array for pipe2 to fill.
        assert_eq!(
            unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) },
            0
        );
        let file = fs::File::open("/proc/self/status").expect("our own status");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        for fd in [pipe[0], pipe[1], fd] {
            let path = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
            assert!(!slow_to_close(&Held { fd, path }), "fd {fd}");
        }
        let held = perf_event_fds().expect("/proc/self/fd");
        assert!(held.iter().all(|h| ![pipe[0], pipe[1], fd].contains(&h.fd)));
        // A closed descriptor is not kept either.
        // SAFETY: ours, closed once.
        unsafe { libc::close(pipe[1]) };
        let path = CString::new(format!("/proc/self/fd/{}", pipe[1])).expect("no NUL");
        assert!(!slow_to_close(&Held { fd: pipe[1], path }));
        // SAFETY: ours, closed once.
        unsafe { libc::close(pipe[0]) };
    }
}
