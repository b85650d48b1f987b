//! Listening ports by network namespace: a connection is a server
//! connection of a traced workload when it was accepted on a port the
//! workload listens on, in the workload's own network namespace (another
//! container's server on the same port number is not ours).

use aya_ebpf::helpers::bpf_probe_read_kernel;
use ttft_trace_common::{LISTEN_ANY_NETNS, LISTEN_SOME_NETNS, ListenKey, Stat, offsets::ABSENT};

use crate::maps::{LISTEN_NETNS, LISTEN_PORTS, bump_stat, offsets};

/// The inode number of `sk`'s network namespace, or None where this kernel
/// does not let us read it (no BTF).
#[inline(always)]
fn netns_of(sk: u64) -> Option<u32> {
    let off = offsets();
    if off.sk_net == ABSENT || off.net_inum == ABSENT {
        return None;
    }
    // SAFETY: the helper checks each address.
    let net = unsafe { bpf_probe_read_kernel((sk + u64::from(off.sk_net)) as *const u64) }.ok()?;
    // SAFETY: as above.
    unsafe { bpf_probe_read_kernel((net + u64::from(off.net_inum)) as *const u32) }.ok()
}

/// Whether `port` is followed in some network namespace: one lookup.
#[inline(always)]
pub fn port_followed(port: u16) -> bool {
    // SAFETY: only the presence is read.
    unsafe { LISTEN_PORTS.get(port) }.is_some()
}

/// Whether a connection of socket `sk` on local port `port` was accepted on
/// a followed listening port. Every other port costs one lookup.
#[inline(always)]
pub fn is_followed(sk: u64, port: u16) -> bool {
    // SAFETY: the value is copied out of the map.
    let Some(flags) = (unsafe { LISTEN_PORTS.get(port).copied() }) else {
        return false;
    };
    if flags & LISTEN_ANY_NETNS != 0 {
        return true;
    }
    let Some(netns) = netns_of(sk) else {
        return true;
    };
    let key = ListenKey {
        netns,
        port,
        _pad: 0,
    };
    // SAFETY: as above.
    unsafe { LISTEN_NETNS.get(key) }.is_some()
}

/// A traced process listens on `port` with socket `sk`: follows the port in
/// the socket's namespace (in every one where that cannot be read).
#[inline(always)]
pub fn add(sk: u64, port: u16) {
    let flag = match netns_of(sk) {
        Some(netns) => {
            let key = ListenKey {
                netns,
                port,
                _pad: 0,
            };
            if LISTEN_NETNS.insert(key, 1, 0).is_err() {
                bump_stat(Stat::ListenNetnsFull);
                return;
            }
            LISTEN_SOME_NETNS
        }
        None => LISTEN_ANY_NETNS,
    };
    // SAFETY: as above.
    let flags = unsafe { LISTEN_PORTS.get(port).copied() }.unwrap_or(0);
    if LISTEN_PORTS.insert(port, flags | flag, 0).is_err() {
        bump_stat(Stat::ListenPortsFull);
    }
}
