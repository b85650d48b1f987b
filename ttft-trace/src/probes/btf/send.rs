//! What the TCP send hook reads: `tcp_sendmsg_locked`'s and
//! `tcp_rcv_space_adjust`'s prototypes, the message (`msghdr`, `iov_iter`,
//! `iovec`) and the socket's sequence numbers (`tcp_sock`).

use ttft_trace_common::SendOffsets;

use super::{BtfError, Layouts};

/// have a constant offset), so the prototype is checked against them.
pub const SENDMSG_SK_ARG: usize = 0;
pub const SENDMSG_MSG_ARG: usize = 1;

/// The offsets the TCP hook needs, checked against what it assumes: the
/// prototypes `tcp_sendmsg_locked(struct sock *, struct msghdr *, ...)` and
/// `tcp_rcv_space_adjust(struct sock *)`, 4-byte sequence numbers, the
/// one-byte `iter_type`, 8-byte pointers and sizes, and `ubuf` sharing its
/// slot with `__iov`.
pub fn send_offsets(btf: &dyn Layouts) -> Result<SendOffsets, BtfError> {
    let args = btf.tracepoint_args("tcp_sendmsg_locked")?;
    if args.get(SENDMSG_SK_ARG).map(String::as_str) != Some("sock")
        || args.get(SENDMSG_MSG_ARG).map(String::as_str) != Some("msghdr")
    {
        return Err(BtfError::Unexpected(format!(
            "tcp_sendmsg_locked takes ({}), not (struct sock *, struct msghdr *, ...)",
            args.join(", ")
        )));
    }
    let sized = |strukt: &str, member: &str, size: u32| btf.sized_member(strukt, member, size);
    let ubuf = sized("iov_iter", "ubuf", 8)?;
    let iov = sized("iov_iter", "__iov", 8)?;
    if ubuf != iov {
        return Err(BtfError::Unexpected(
            "iov_iter.ubuf and __iov are not one union slot".into(),
        ));
    }
    // The probe walks iovec arrays with the user ABI's layout.
    let iovec = (
        sized("iovec", "iov_base", 8)?,
        sized("iovec", "iov_len", 8)?,
        btf.struct_size("iovec")?,
    );
    if iovec != (0, 8, 16) {
        return Err(BtfError::Unexpected(format!(
            "struct iovec is laid out as {iovec:?} (base, len, size), not (0, 8, 16)"
        )));
    }
    let value = |name: &str| -> Result<u32, BtfError> {
        u32::try_from(btf.enum_value("iter_type", name)?)
            .map_err(|_| BtfError::Unexpected(format!("{name} out of range")))
    };
    // The receive half of the TCP hook: one argument, the socket.
    let args = btf.tracepoint_args("tcp_rcv_space_adjust")?;
    if args.first().map(String::as_str) != Some("sock") {
        return Err(BtfError::Unexpected(format!(
            "tcp_rcv_space_adjust takes ({}), not (struct sock *)",
            args.join(", ")
        )));
    }
    tcp_sock_begins_with_sock(btf)?;
    Ok(SendOffsets {
        msg_iter: btf.member("msghdr", "msg_iter")?.0,
        iter_type: sized("iov_iter", "iter_type", 1)?,
        iov_offset: sized("iov_iter", "iov_offset", 8)?,
        ubuf,
        iov,
        count: sized("iov_iter", "count", 8)?,
        nr_segs: sized("iov_iter", "nr_segs", 8)?,
        iter_ubuf: value("ITER_UBUF")?,
        iter_iovec: value("ITER_IOVEC")?,
        copied_seq: sized("tcp_sock", "copied_seq", 4)?,
        write_seq: sized("tcp_sock", "write_seq", 4)?,
    })
}

/// The probes read `tcp_sock` members through the `struct sock *`: a
/// `tcp_sock` begins with its `sock` (through `inet_connection_sock`).
pub(super) fn tcp_sock_begins_with_sock(btf: &dyn Layouts) -> Result<(), BtfError> {
    let (first, _) = btf.member("tcp_sock", "inet_conn")?;
    if first != 0 {
        return Err(BtfError::Unexpected(
            "tcp_sock does not begin with its inet_connection_sock".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::btf::{Btf, builder::kernel_like};

    #[test]
    fn finds_members_through_anonymous_unions() {
        let btf = Btf::parse(&kernel_like(8)).expect("parse");
        let off = send_offsets(&btf).expect("offsets");
        assert_eq!(
            off,
            SendOffsets {
                msg_iter: 16,
                iter_type: 0,
                iov_offset: 8,
                ubuf: 16,
                iov: 16,
                count: 24,
                nr_segs: 32,
                iter_ubuf: 0,
                iter_iovec: 1,
                copied_seq: 1588,
                write_seq: 1700,
            }
        );
    }
}
