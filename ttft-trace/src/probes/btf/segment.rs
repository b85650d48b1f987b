//! What the raw `tcp:tcp_probe` program reads: the tracepoint's prototype,
//! the socket (`sock_common`, `tcp_sock`) and the segment's control block
//! (`sk_buff.cb` as `tcp_skb_cb`).

use ttft_trace_common::offsets::SegmentOffsets;

use super::{BtfError, Layouts, send::tcp_sock_begins_with_sock};

/// The offsets the raw `tcp:tcp_probe` program needs, checked against what
/// it assumes: the prototype `tcp_probe(struct sock *, struct sk_buff *)`,
/// 4-byte sequence numbers, 2-byte family and ports, and the segment's
/// `tcp_skb_cb` inside `sk_buff.cb`.
pub fn segment_offsets(btf: &dyn Layouts) -> Result<SegmentOffsets, BtfError> {
    let args = btf.tracepoint_args("tcp_probe")?;
    if args != ["sock", "sk_buff"] {
        return Err(BtfError::Unexpected(format!(
            "tcp_probe takes ({}), not (struct sock *, struct sk_buff *)",
            args.join(", ")
        )));
    }
    tcp_sock_begins_with_sock(btf)?;
    let (common, _) = btf.member("sock", "__sk_common")?;
    if common != 0 {
        return Err(BtfError::Unexpected(
            "sock does not begin with its sock_common".into(),
        ));
    }
    let tcp = |member: &str| btf.sized_member("tcp_sock", member, 4);
    let sk = |member: &str, size: u32| btf.sized_member("sock_common", member, size);
    let (cb, cb_size) = btf.member("sk_buff", "cb")?;
    let in_cb = |member: &str, at: u32, size: u32| -> Result<u32, BtfError> {
        if at + size > cb_size {
            return Err(BtfError::Unexpected(format!(
                "tcp_skb_cb.{member} at {at} is outside sk_buff.cb ({cb_size} bytes)"
            )));
        }
        Ok(cb + at)
    };
    let skb = |member: &str, size: u32| -> Result<u32, BtfError> {
        let at = btf.sized_member("tcp_skb_cb", member, size)?;
        in_cb(member, at, size)
    };
    Ok(SegmentOffsets {
        snd_nxt: tcp("snd_nxt")?,
        snd_una: tcp("snd_una")?,
        srtt_us: tcp("srtt_us")?,
        family: sk("skc_family", 2)?,
        num: sk("skc_num", 2)?,
        dport: sk("skc_dport", 2)?,
        rcv_saddr: sk("skc_rcv_saddr", 4)?,
        daddr: sk("skc_daddr", 4)?,
        v6_rcv_saddr: sk("skc_v6_rcv_saddr", 16)?,
        v6_daddr: sk("skc_v6_daddr", 16)?,
        skb_seq: skb("seq", 4)?,
        skb_end_seq: skb("end_seq", 4)?,
        skb_ack_seq: skb("ack_seq", 4)?,
        skb_tcp_flags: tcp_flags(btf, in_cb)?,
    })
}

/// Where the byte of `tcp_skb_cb.tcp_flags` with FIN and SYN lies: the
/// member is one byte, or two since the AccECN flag joined it (6.18).
fn tcp_flags(
    btf: &dyn Layouts,
    in_cb: impl Fn(&str, u32, u32) -> Result<u32, BtfError>,
) -> Result<u32, BtfError> {
    let (at, size) = btf.member("tcp_skb_cb", "tcp_flags")?;
    match size {
        1 => in_cb("tcp_flags", at, 1),
        // The low byte: first in memory on a little-endian host.
        2 => in_cb("tcp_flags", at, 2).map(|at| at + u32::from(cfg!(target_endian = "big"))),
        _ => Err(BtfError::Unexpected(format!(
            "tcp_skb_cb.tcp_flags is {size} bytes, not 1 or 2"
        ))),
    }
}

/// Offset of a received segment's acknowledgment number in its `struct
/// sk_buff`: the control block `cb`, where TCP keeps `struct tcp_skb_cb`,
/// and its `ack_seq` (host order, filled before `tcp_rcv_established`).
pub fn skb_ack_seq_offset(btf: &dyn Layouts) -> Result<u32, BtfError> {
    let (cb, cb_size) = btf.member("sk_buff", "cb")?;
    let (ack, ack_size) = btf.member("tcp_skb_cb", "ack_seq")?;
    if ack_size != 4 {
        return Err(BtfError::Unexpected(format!(
            "tcp_skb_cb.ack_seq is {ack_size} bytes, not 4"
        )));
    }
    if ack + 4 > cb_size {
        return Err(BtfError::Unexpected(format!(
            "tcp_skb_cb.ack_seq at {ack} is outside sk_buff.cb ({cb_size} bytes)"
        )));
    }
    Ok(cb + ack)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::btf::{
        Btf, Layouts,
        builder::{Builder, kernel_like},
        parse::{KIND_ARRAY, KIND_PTR, KIND_STRUCT, KIND_UNION},
    };

    /// `struct sk_buff { ...; char cb[48]; }` and `struct tcp_skb_cb`
    /// with `ack_seq` behind an anonymous union, as 6.18 has them.
    fn skb_like(ack_seq_at: u32) -> Vec<u8> {
        let mut b = Builder::new();
        let char_t = b.int("char", 1);
        let u32_t = b.int("__u32", 4);
        let int_t = b.int("int", 4);
        let cb = b.push("", KIND_ARRAY, 0, 0);
        b.words(&[char_t, int_t, 48]);
        b.record(
            KIND_STRUCT,
            "sk_buff",
            232,
            &[("len", u32_t, 0), ("cb", cb, 40)],
        );
        let inner = b.record(KIND_UNION, "", 4, &[("tcp_tw_isn", u32_t, 0)]);
        b.record(
            KIND_STRUCT,
            "tcp_skb_cb",
            48,
            &[
                ("seq", u32_t, 0),
                ("end_seq", u32_t, 4),
                ("", inner, 8),
                ("ack_seq", u32_t, ack_seq_at),
            ],
        );
        b.blob()
    }

    #[test]
    fn finds_the_ack_number_in_the_control_block() {
        let btf = Btf::parse(&skb_like(24)).expect("parse");
        assert_eq!(btf.member("sk_buff", "cb").expect("cb"), (40, 48));
        assert_eq!(skb_ack_seq_offset(&btf).expect("offset"), 40 + 24);
        // A layout that puts it past the control block is refused.
        let btf = Btf::parse(&skb_like(46)).expect("parse");
        assert!(matches!(
            skb_ack_seq_offset(&btf),
            Err(BtfError::Unexpected(_))
        ));
    }

    /// The structs `tcp_probe` reads, laid out as 6.18 has them (the
    /// ports and addresses behind anonymous members), with the prototype
    /// `tcp_probe(struct sock *, second)` and a `cb` of `cb_len` bytes.
    fn tcp_probe_like(second: &str, cb_len: u32) -> Vec<u8> {
        let mut b = Builder::new();
        let u8_t = b.int("__u8", 1);
        let u16_t = b.int("__u16", 2);
        let u32_t = b.int("__u32", 4);
        let int_t = b.int("int", 4);
        let void_ptr = b.push("", KIND_PTR, 0, 0);
        let v6 = b.record(KIND_STRUCT, "in6_addr", 16, &[("s6_addr32", u32_t, 0)]);
        let addrs = b.record(
            KIND_STRUCT,
            "",
            8,
            &[("skc_daddr", u32_t, 0), ("skc_rcv_saddr", u32_t, 4)],
        );
        let ports = b.record(
            KIND_STRUCT,
            "",
            4,
            &[("skc_dport", u16_t, 0), ("skc_num", u16_t, 2)],
        );
        let common = b.record(
            KIND_STRUCT,
            "sock_common",
            136,
            &[
                ("", addrs, 0),
                ("", ports, 12),
                ("skc_family", u16_t, 16),
                ("skc_v6_daddr", v6, 56),
                ("skc_v6_rcv_saddr", v6, 72),
            ],
        );
        let sock = b.record(KIND_STRUCT, "sock", 760, &[("__sk_common", common, 0)]);
        b.tcp_sock(
            sock,
            &[
                ("snd_nxt", u32_t, 1600),
                ("snd_una", u32_t, 1660),
                ("srtt_us", u32_t, 1740),
            ],
        );
        let cb = b.push("", KIND_ARRAY, 0, 0);
        b.words(&[u8_t, int_t, cb_len]);
        let skb = b.record(
            KIND_STRUCT,
            "sk_buff",
            232,
            &[("len", u32_t, 112), ("cb", cb, 40)],
        );
        b.record(
            KIND_STRUCT,
            "tcp_skb_cb",
            48,
            &[
                ("seq", u32_t, 0),
                ("end_seq", u32_t, 4),
                ("tcp_flags", u8_t, 12),
                ("ack_seq", u32_t, 36),
            ],
        );
        let sock_ptr = b.push("", KIND_PTR, 0, sock);
        let second = if second == "sk_buff" {
            b.push("", KIND_PTR, 0, skb)
        } else {
            int_t
        };
        b.tracepoint("tcp_probe", void_ptr, &[sock_ptr, second]);
        b.blob()
    }

    #[test]
    fn segment_offsets_follow_the_prototype() {
        let btf = Btf::parse(&tcp_probe_like("sk_buff", 48)).expect("parse");
        assert_eq!(
            segment_offsets(&btf).expect("offsets"),
            SegmentOffsets {
                snd_nxt: 1600,
                snd_una: 1660,
                srtt_us: 1740,
                family: 16,
                num: 14,
                dport: 12,
                rcv_saddr: 4,
                daddr: 0,
                v6_rcv_saddr: 72,
                v6_daddr: 56,
                skb_seq: 40,
                skb_end_seq: 44,
                skb_ack_seq: 76,
                skb_tcp_flags: 52,
            }
        );
        // A prototype the program would read wrongly: the classic one.
        let btf = Btf::parse(&tcp_probe_like("int", 48)).expect("parse");
        let err = segment_offsets(&btf).expect_err("not an sk_buff");
        assert!(err.to_string().contains("tcp_probe takes"), "{err}");
        // A control block too small for `ack_seq`.
        let btf = Btf::parse(&tcp_probe_like("sk_buff", 32)).expect("parse");
        let err = segment_offsets(&btf).expect_err("outside cb");
        assert!(err.to_string().contains("outside sk_buff.cb"), "{err}");
        // A kernel without the tracepoint's BTF.
        let btf = Btf::parse(&kernel_like(8)).expect("parse");
        assert!(matches!(segment_offsets(&btf), Err(BtfError::Missing(_))));
    }
}
