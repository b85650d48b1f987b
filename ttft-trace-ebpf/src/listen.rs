//! Listening ports by network namespace: a connection is a server
//! connection of a traced workload when it was accepted on a port the
//! workload listens on, in the workload's own network namespace (another
//! container's server on the same port number is not ours).

use aya_ebpf::helpers::bpf_probe_read_kernel;
use ttft_trace_common::{
    LISTEN_ANY_NETNS, LISTEN_SOME_NETNS, ListenKey, QUOTA_LISTENERS, SLOT_BYTES, Stat, listen_byte,
    offsets::ABSENT,
};

use crate::maps::{
    INGRESS_LISTENERS, LISTEN_NETNS, LISTEN_PORTS, bump_stat, offsets, over_share, seg_offset,
};

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

/// `port`'s two bytes of `LISTEN_PORTS`: (every namespace, some), or None
/// where the array is missing (it never is: it is sized at compile time).
#[inline(always)]
fn port_flags(port: u16) -> Option<(u8, u8)> {
    let at = listen_byte(port, LISTEN_ANY_NETNS);
    let slot = LISTEN_PORTS.get(at / SLOT_BYTES)?;
    // Even, so both bytes are in this element (the bound is visible to the
    // compiler and the verifier: no check is left).
    let i = (at % SLOT_BYTES) as usize & !1;
    Some((
        slot[i + LISTEN_ANY_NETNS as usize],
        slot[i + LISTEN_SOME_NETNS as usize],
    ))
}

/// Whether `port` is followed in some network namespace: one inlined
/// array load.
#[inline(always)]
pub fn port_followed(port: u16) -> bool {
    port_flags(port).is_some_and(|(any, some)| any | some != 0)
}

/// Whether a connection of socket `sk` on local port `port` was accepted on
/// a followed listening port. Every other port costs one array load.
#[inline(always)]
pub fn is_followed(sk: u64, port: u16) -> bool {
    let Some((any, some)) = port_flags(port) else {
        return false;
    };
    if any != 0 {
        return true;
    }
    if some == 0 {
        return false;
    }
    let Some(netns) = netns_of(sk) else {
        return true;
    };
    let key = ListenKey {
        netns,
        port,
        _pad: 0,
    };
    // SAFETY: only the presence is read.
    unsafe { LISTEN_NETNS.get(key) }.is_some()
}

/// A process of traced workload `workload` listens on `port` with socket
/// `sk`: follows the port in the socket's namespace (in every one where
/// that cannot be read), unless the workload's tenant holds its share of
/// the followed listeners (userspace counts those it finds held).
#[inline(always)]
pub fn add(workload: u32, sk: u64, port: u16) {
    if over_share(workload, QUOTA_LISTENERS) {
        return;
    }
    let which = match netns_of(sk) {
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
    let at = listen_byte(port, which);
    if let Some(slot) = LISTEN_PORTS.get_ptr_mut(at / SLOT_BYTES) {
        // SAFETY: one byte of a live map value, stored whole (its other
        // writer, userspace, stores the same value).
        unsafe { (*slot)[(at % SLOT_BYTES) as usize] = 1 };
    }
}

/// Whether the listening port of followed socket `sk` had its handshakes
/// seen at a cgroup's ingress ([`crate::ingress`]; false where its port cannot be read).
#[inline(always)]
pub fn listener_seen(sk: u64) -> bool {
    let at = seg_offset!(num);
    if at == 0 {
        return false;
    }
    // SAFETY: the helper checks the address.
    let Ok(port) = (unsafe { bpf_probe_read_kernel((sk + u64::from(at)) as *const u16) }) else {
        return false;
    };
    // SAFETY: only the presence is read.
    unsafe { INGRESS_LISTENERS.get(u32::from(port)) }.is_some()
}
