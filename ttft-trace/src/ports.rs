//! Listening TCP ports of the traced processes, found through /proc: the
//! sockets a process holds (`/proc/PID/fd` -> `socket:[inode]`) matched
//! against the listening sockets of its network namespace
//! (`/proc/PID/net/tcp{,6}`, state `0A`).

use std::{collections::BTreeSet, fs};

/// TCP state LISTEN in /proc/net/tcp.
const TCP_LISTEN_HEX: &str = "0A";

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

/// Ports on which any of `pids` listens.
pub fn listening_ports(pids: &[u32]) -> BTreeSet<u16> {
    let mut ports = BTreeSet::new();
    for &pid in pids {
        let inodes = socket_inodes(pid);
        if inodes.is_empty() {
            continue;
        }
        for table in ["tcp", "tcp6"] {
            let Ok(text) = fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
                continue;
            };
            ports.extend(
                parse_listeners(&text)
                    .into_iter()
                    .filter(|(_, inode)| inodes.contains(inode))
                    .map(|(port, _)| port),
            );
        }
    }
    ports
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
        assert!(ports.contains(&port), "{port} not in {ports:?}");
    }
}
