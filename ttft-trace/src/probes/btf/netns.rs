//! Where a socket's network namespace is: `sock_common.skc_net` and the
//! namespace's inode number (`net.ns.inum`).

use super::{BtfError, Layouts};

/// Offsets of a socket's network namespace pointer in `struct sock`
/// (`__sk_common.skc_net`, a `possible_net_t` whose only member is the
/// pointer) and of the namespace's inode number in `struct net` (`ns.inum`).
pub fn netns_offsets(btf: &dyn Layouts) -> Result<(u32, u32), BtfError> {
    let (common, _) = btf.member("sock", "__sk_common")?;
    let (net, net_size) = btf.member("sock_common", "skc_net")?;
    if net_size != 8 {
        return Err(BtfError::Unexpected(format!(
            "sock_common.skc_net is {net_size} bytes, not a pointer"
        )));
    }
    let (ns, _) = btf.member("net", "ns")?;
    let (inum, inum_size) = btf.member("ns_common", "inum")?;
    if inum_size != 4 {
        return Err(BtfError::Unexpected(format!(
            "ns_common.inum is {inum_size} bytes, not 4"
        )));
    }
    Ok((common + net, ns + inum))
}
