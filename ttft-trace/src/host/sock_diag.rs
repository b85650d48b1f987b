//! The cgroups of listening TCP sockets, asked of the kernel through
//! sock_diag (`NETLINK_SOCK_DIAG`, each socket's `INET_DIAG_CGROUP_ID`).
//!
//! A connection accepted on a listener belongs to the listener's cgroup
//! (the kernel copies it to the new socket), not to that of the process
//! that accepts it: a server handed its listening socket by systemd
//! (socket activation), or moved after it listened, has its connections'
//! segments run the programs of the listener's cgroup. The segment program
//! goes there too ([`crate::tracking`]).
//!
//! A network namespace's sockets are asked of in that namespace: the
//! netlink socket is opened on a short-lived thread that joined it (a
//! thread's `setns` is its own).

use std::{
    fs::File,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

/// Netlink message types and flags (uapi `linux/netlink.h`,
/// `linux/sock_diag.h`).
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
/// `INET_DIAG_CGROUP_ID` (uapi `linux/inet_diag.h`): a u64, sent for
/// every socket by kernels 5.7 and later.
const INET_DIAG_CGROUP_ID: u16 = 21;
/// TCP_LISTEN in the kernel's TCP states.
const TCP_LISTEN: u32 = 10;
/// Sizes of `struct nlmsghdr`, `struct inet_diag_req_v2` and
/// `struct inet_diag_msg`.
const NLMSG_HDR: usize = 16;
const REQ_LEN: usize = 56;
const MSG_LEN: usize = 72;
/// Most listeners read of one namespace and family (a namespace's sockets
/// are its tenants' to open), and the longest a dump may take: the kernel
/// answers at once, so the limit only bounds a pathological namespace.
const MAX_LISTENERS: usize = 65_536;
const DUMP_DEADLINE: Duration = Duration::from_secs(1);

/// A listening socket, as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listener {
    pub port: u16,
    /// The socket's inode (`socket:[N]` in `/proc/PID/fd`).
    pub inode: u32,
    /// Its cgroup v2 id (the cgroup directory's inode number), 0 where
    /// the kernel sent none.
    pub cgroup_id: u64,
}

/// Every listening TCP socket (IPv4 and IPv6) in the network namespace of
/// process `pid`.
pub fn listeners(pid: u32) -> io::Result<Vec<Listener>> {
    let sock = socket_in_netns_of(pid)?;
    let mut all = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        dump(&sock, family as u8, &mut all)?;
    }
    Ok(all)
}

/// A sock_diag netlink socket in `pid`'s network namespace.
fn socket_in_netns_of(pid: u32) -> io::Result<OwnedFd> {
    let theirs = std::fs::metadata(format!("/proc/{pid}/ns/net"))?;
    let ours = std::fs::metadata("/proc/self/ns/net")?;
    if std::os::unix::fs::MetadataExt::ino(&theirs) == std::os::unix::fs::MetadataExt::ino(&ours) {
        return diag_socket();
    }
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns(2) on a descriptor we own; it moves only this
            // thread, which ends here.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            diag_socket()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
}

fn diag_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned by socket(2), owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A dump request for the listening TCP sockets of `family`.
fn request(family: u8) -> [u8; NLMSG_HDR + REQ_LEN] {
    let mut m = [0u8; NLMSG_HDR + REQ_LEN];
    m[0..4].copy_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    m[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    m[8..12].copy_from_slice(&1u32.to_ne_bytes());
    m[NLMSG_HDR] = family;
    m[NLMSG_HDR + 1] = libc::IPPROTO_TCP as u8;
    m[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
    m
}

fn dump(sock: &OwnedFd, family: u8, out: &mut Vec<Listener>) -> io::Result<()> {
    let req = request(family);
    // SAFETY: send(2) of a buffer that outlives the call.
    let sent = unsafe { libc::send(sock.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let deadline = Instant::now() + DUMP_DEADLINE;
    let limit = out.len() + MAX_LISTENERS;
    let mut buf = vec![0u8; 32 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "sock_diag dump unfinished",
            ));
        }
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, valid for the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: recv(2) into a buffer of the length given.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) {
                continue;
            }
            return Err(e);
        }
        let done = parse(&buf[..n as usize], out)?;
        if done || out.len() >= limit {
            out.truncate(limit);
            return Ok(());
        }
    }
}

/// Reads the netlink messages of one datagram into `out`; true once the
/// dump's end is among them. The kernel's answer is bounds-checked like
/// any input: a message that does not fit ends the datagram.
pub fn parse(mut buf: &[u8], out: &mut Vec<Listener>) -> io::Result<bool> {
    while buf.len() >= NLMSG_HDR {
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        let kind = u16::from_ne_bytes([buf[4], buf[5]]);
        if len < NLMSG_HDR || len > buf.len() {
            break;
        }
        let body = &buf[NLMSG_HDR..len];
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let code = body
                    .get(..4)
                    .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                return Err(if code < 0 {
                    io::Error::from_raw_os_error(-code)
                } else {
                    io::Error::other("sock_diag: error message without a code")
                });
            }
            SOCK_DIAG_BY_FAMILY => out.extend(listener(body)),
            _ => {}
        }
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(false)
}

/// One `struct inet_diag_msg` and its attributes.
fn listener(body: &[u8]) -> Option<Listener> {
    let msg = body.get(..MSG_LEN)?;
    let port = u16::from_be_bytes([msg[4], msg[5]]);
    let inode = u32::from_ne_bytes([msg[68], msg[69], msg[70], msg[71]]);
    let mut attrs = &body[MSG_LEN..];
    let mut cgroup_id = 0;
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]);
        if len < 4 || len > attrs.len() {
            break;
        }
        if kind == INET_DIAG_CGROUP_ID
            && let Some(v) = attrs.get(4..12).filter(|_| len >= 12)
        {
            cgroup_id = u64::from_ne_bytes(v.try_into().ok()?);
        }
        attrs = &attrs[align4(len).min(attrs.len())..];
    }
    Some(Listener {
        port,
        inode,
        cgroup_id,
    })
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram of one listener message (with a padding attribute
    /// before the cgroup's) and the end of the dump.
    fn datagram(port: u16, inode: u32, cgroup: Option<u64>) -> Vec<u8> {
        let mut body = vec![0u8; MSG_LEN];
        body[0] = libc::AF_INET as u8;
        body[1] = TCP_LISTEN as u8;
        body[4..6].copy_from_slice(&port.to_be_bytes());
        body[68..72].copy_from_slice(&inode.to_ne_bytes());
        // An attribute of 5 bytes, padded to 8.
        body.extend_from_slice(&5u16.to_ne_bytes());
        body.extend_from_slice(&99u16.to_ne_bytes());
        body.extend_from_slice(&[7, 0, 0, 0]);
        if let Some(id) = cgroup {
            body.extend_from_slice(&12u16.to_ne_bytes());
            body.extend_from_slice(&INET_DIAG_CGROUP_ID.to_ne_bytes());
            body.extend_from_slice(&id.to_ne_bytes());
        }
        let mut m = Vec::new();
        for (kind, payload) in [(SOCK_DIAG_BY_FAMILY, body), (NLMSG_DONE, vec![0; 4])] {
            m.extend_from_slice(&((NLMSG_HDR + payload.len()) as u32).to_ne_bytes());
            m.extend_from_slice(&kind.to_ne_bytes());
            m.extend_from_slice(&[0; 10]);
            m.extend_from_slice(&payload);
        }
        m
    }

    #[test]
    fn reads_the_listener_and_its_cgroup() {
        let mut out = Vec::new();
        assert!(parse(&datagram(8000, 4242, Some(8974)), &mut out).expect("parsed"));
        assert_eq!(
            out,
            [Listener {
                port: 8000,
                inode: 4242,
                cgroup_id: 8974
            }]
        );
        out.clear();
        assert!(parse(&datagram(8000, 4242, None), &mut out).expect("parsed"));
        assert_eq!(out[0].cgroup_id, 0);
    }

    #[test]
    fn a_message_that_does_not_fit_ends_the_datagram() {
        let mut d = datagram(8000, 1, Some(2));
        for cut in 0..d.len() {
            let mut out = Vec::new();
            // Never a panic, never a listener from a short message.
            let done = parse(&d[..cut], &mut out).expect("a cut datagram is no error");
            assert!(!done || cut == d.len());
            assert!(out.iter().all(|l| l.port == 8000 && l.inode == 1));
        }
        // A length past the end.
        d[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
        let mut out = Vec::new();
        assert!(!parse(&d, &mut out).expect("a bad length is no error"));
        assert!(out.is_empty());
    }

    #[test]
    fn the_kernels_error_is_returned() {
        let mut m = Vec::new();
        m.extend_from_slice(&20u32.to_ne_bytes());
        m.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&(-libc::EPERM).to_ne_bytes());
        let e = parse(&m, &mut Vec::new()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn finds_our_own_listener() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        // Any user may list the sockets of its own namespace.
        let found = listeners(std::process::id()).expect("sock_diag");
        let ours = found.iter().find(|x| x.port == port);
        assert!(ours.is_some_and(|l| l.cgroup_id != 0), "{port}: {found:?}");
    }
}
