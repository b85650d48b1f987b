//! Listening TCP ports of the traced processes, found through /proc: the
//! sockets a process holds (`/proc/PID/fd` -> `socket:[inode]`) matched
//! against the listening sockets of its network namespace
//! (`/proc/PID/net/tcp{,6}`, state `0A`).

use std::{collections::BTreeSet, fs, path::Path};

/// TCP state LISTEN in /proc/net/tcp.
const TCP_LISTEN_HEX: &str = "0A";
/// Most bytes read of one `/proc/PID/net/tcp{,6}`: a network namespace's
/// sockets are its tenants' to open (about 150 bytes each). The kernel
/// lists the listening sockets before the connections, so the cap cuts
/// connections, which are not looked at, and bounds the cost of a
/// namespace with hundreds of thousands of them.
const NET_TCP_MAX: u64 = 32 << 20;

/// Socket inodes held by `pid`.
fn socket_inodes(pid: u32) -> BTreeSet<u64> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return BTreeSet::new();
    };
    dir.flatten()
        .filter_map(|e| fs::read_link(e.path()).ok())
        .filter_map(|target| {
            let t = target.to_str()?;
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// (local port, inode) of every listening socket in a /proc/net/tcp text.
pub fn parse_listeners(text: &str) -> Vec<(u16, u64)> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != TCP_LISTEN_HEX {
                return None;
            }
            let port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            Some((port, f[9].parse().ok()?))
        })
        .collect()
}

/// The inode number of a `/proc/PID/ns/net` link (`net:[4026531840]`).
fn netns_inode(link: &str) -> Option<u32> {
    link.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

/// The network namespace of `pid`, or None when it cannot be read.
fn netns_of(pid: u32) -> Option<u32> {
    let link = fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    netns_inode(link.to_str()?)
}

/// A listening socket one of the traced processes holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HeldListener {
    /// Its network namespace, None when it cannot be read.
    pub netns: Option<u32>,
    pub port: u16,
    pub inode: u64,
    /// A process holding it.
    pub pid: u32,
}

/// (network namespace, port) on which any of `pids` listens; the namespace
/// is None when it cannot be read (the port is then followed in every one).
pub fn listening_ports(pids: &[u32]) -> BTreeSet<(Option<u32>, u16)> {
    listening_sockets(pids)
        .into_iter()
        .map(|l| (l.netns, l.port))
        .collect()
}

/// The listening sockets `pids` hold.
pub fn listening_sockets(pids: &[u32]) -> BTreeSet<HeldListener> {
    let mut held = BTreeSet::new();
    for &pid in pids {
        let inodes = socket_inodes(pid);
        if inodes.is_empty() {
            continue;
        }
        let netns = netns_of(pid);
        for table in ["tcp", "tcp6"] {
            let path = format!("/proc/{pid}/net/{table}");
            let Ok(bytes) = crate::host::rootfs::read_proc(Path::new(&path), NET_TCP_MAX) else {
                continue;
            };
            // A capped read may end inside a line: only whole lines count.
            let whole = bytes
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(&bytes[..0], |i| &bytes[..=i]);
            let text = String::from_utf8_lossy(whole);
            held.extend(
                parse_listeners(&text)
                    .into_iter()
                    .filter(|(_, inode)| inodes.contains(inode))
                    .map(|(port, inode)| HeldListener {
                        netns,
                        port,
                        inode,
                        pid,
                    }),
            );
        }
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_net_tcp() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 123456 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F40 0100007F:D2A4 01 00000000:00000000 00:00000000 00000000     0        0 123457 1 0000000000000000 20 4 30 10 -1
";
        assert_eq!(parse_listeners(text), vec![(8000, 123456)]);
    }

    #[test]
    fn finds_our_own_listener() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let ports = listening_ports(&[std::process::id()]);
        let ns = netns_of(std::process::id());
        assert!(ns.is_some(), "our own namespace is readable");
        assert!(ports.contains(&(ns, port)), "{port} not in {ports:?}");
    }

    #[test]
    fn reads_namespace_links() {
        assert_eq!(netns_inode("net:[4026531840]"), Some(4026531840));
        assert_eq!(netns_inode("mnt:[4026531840]"), None);
        assert_eq!(netns_inode("net:[x]"), None);
    }
}
