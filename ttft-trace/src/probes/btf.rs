//! A small reader of the kernel's BTF (`/sys/kernel/btf/vmlinux`): just
//! enough to find struct member offsets, enum values and a tracepoint's
//! prototype. The eBPF side is Rust, which has no CO-RE relocations, so the
//! layouts the send probe walks (`msghdr`, `iov_iter`, `iovec`) and the
//! thread id in `task_struct` are read here at load time and handed over as
//! load-time globals, as the tracefs offsets are.

use std::path::Path;

use thiserror::Error;
use ttft_trace_common::{
    SendOffsets,
    offsets::{ABSENT, SegmentOffsets, TaskOffsets},
};

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
/// The BTF file a kernel exports is a few MiB; anything far larger is not one.
const MAX_BYTES: u64 = 256 << 20;

const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Debug, Error)]
pub enum BtfError {
    #[error("cannot read {0}: {1}")]
    Read(String, std::io::Error),
    #[error("not a BTF file: {0}")]
    Format(&'static str),
    #[error("BTF has no {0}")]
    Missing(String),
    #[error("BTF: {0}")]
    Unexpected(String),
}

/// One type record: where its kind-specific trailer starts in the type section.
#[derive(Debug, Clone, Copy)]
struct Type {
    name_off: u32,
    kind: u32,
    vlen: u32,
    kind_flag: bool,
    size_or_type: u32,
    /// Byte offset of the trailer in the type section.
    extra: usize,
}

/// Parsed BTF: type records indexed by id (id 0 is `void`).
pub struct Btf {
    types_data: Vec<u8>,
    strings: Vec<u8>,
    types: Vec<Type>,
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, BtfError> {
    data.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(BtfError::Format("truncated"))
}

impl Btf {
    /// Reads the running kernel's BTF.
    pub fn vmlinux() -> Result<Self, BtfError> {
        Self::read(Path::new(VMLINUX))
    }

    pub fn read(path: &Path) -> Result<Self, BtfError> {
        use std::io::Read as _;
        let err = |e| BtfError::Read(path.display().to_string(), e);
        let mut data = Vec::new();
        std::fs::File::open(path)
            .map_err(err)?
            .take(MAX_BYTES)
            .read_to_end(&mut data)
            .map_err(err)?;
        Self::parse(&data)
    }

    /// Parses a little-endian BTF blob (the only byte order of the kernels
    /// this tracer supports: x86_64 and aarch64).
    pub fn parse(data: &[u8]) -> Result<Self, BtfError> {
        if data.len() < 24 || u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            return Err(BtfError::Format("bad magic (or not little-endian)"));
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let field = |i: usize| u32_at(data, 8 + 4 * i).map(|v| v as usize);
        let (type_off, type_len, str_off, str_len) = (field(0)?, field(1)?, field(2)?, field(3)?);
        let section = |off: usize, len: usize| {
            let start = hdr_len
                .checked_add(off)
                .ok_or(BtfError::Format("section offset"))?;
            data.get(start..start.saturating_add(len))
                .ok_or(BtfError::Format("section past the end"))
        };
        let types_data = section(type_off, type_len)?.to_vec();
        let strings = section(str_off, str_len)?.to_vec();
        let mut types = vec![Type {
            name_off: 0,
            kind: 0,
            vlen: 0,
            kind_flag: false,
            size_or_type: 0,
            extra: 0,
        }];
        let mut at = 0;
        while at < types_data.len() {
            let info = u32_at(&types_data, at + 4)?;
            let t = Type {
                name_off: u32_at(&types_data, at)?,
                kind: (info >> 24) & 0x1f,
                vlen: info & 0xffff,
                kind_flag: info >> 31 == 1,
                size_or_type: u32_at(&types_data, at + 8)?,
                extra: at + 12,
            };
            let vlen = t.vlen as usize;
            let trailer = match t.kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen,
                0..=19 => 0,
                _ => return Err(BtfError::Format("unknown type kind")),
            };
            types.push(t);
            at = t.extra + trailer;
        }
        Ok(Self {
            types_data,
            strings,
            types,
        })
    }

    fn name(&self, t: &Type) -> &str {
        self.string(t.name_off)
    }

    fn string(&self, off: u32) -> &str {
        let start = off as usize;
        let Some(rest) = self.strings.get(start..) else {
            return "";
        };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    fn get(&self, id: u32) -> Result<&Type, BtfError> {
        self.types
            .get(id as usize)
            .ok_or_else(|| BtfError::Unexpected(format!("type id {id} out of range")))
    }

    fn find(&self, kind: u32, name: &str) -> Result<u32, BtfError> {
        self.types
            .iter()
            .position(|t| t.kind == kind && self.name(t) == name)
            .map(|i| i as u32)
            .ok_or_else(|| BtfError::Missing(name.to_string()))
    }

    /// Follows typedefs and qualifiers to the type they name.
    fn strip(&self, mut id: u32) -> Result<u32, BtfError> {
        // A chain longer than this is a loop in a corrupt file.
        for _ in 0..32 {
            let t = self.get(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type;
                }
                _ => return Ok(id),
            }
        }
        Err(BtfError::Unexpected("typedef chain too long".into()))
    }

    /// (name, type id, bit offset) of each member of a struct or union.
    fn members(&self, id: u32) -> Result<Vec<(&str, u32, u32)>, BtfError> {
        let t = *self.get(id)?;
        if t.kind != KIND_STRUCT && t.kind != KIND_UNION {
            return Err(BtfError::Unexpected(format!(
                "type {} is not a struct",
                self.name(&t)
            )));
        }
        (0..t.vlen as usize)
            .map(|i| {
                let at = t.extra + 12 * i;
                let name_off = u32_at(&self.types_data, at)?;
                let ty = u32_at(&self.types_data, at + 4)?;
                let off = u32_at(&self.types_data, at + 8)?;
                // With kind_flag the high byte is a bitfield size.
                let bits = if t.kind_flag { off & 0x00ff_ffff } else { off };
                let name = self.string(name_off);
                Ok((name, ty, bits))
            })
            .collect()
    }

    /// Byte offset and type of `member` in a struct or union, looking into
    /// anonymous struct and union members as C does.
    fn member_in(&self, id: u32, member: &str, depth: u32) -> Result<Option<(u32, u32)>, BtfError> {
        if depth > 8 {
            return Ok(None);
        }
        for (name, ty, bits) in self.members(id)? {
            if name == member {
                if bits % 8 != 0 {
                    return Err(BtfError::Unexpected(format!("{member} is a bitfield")));
                }
                return Ok(Some((bits / 8, ty)));
            }
            if name.is_empty() {
                let inner = self.strip(ty)?;
                if let Some((off, t)) = self.member_in(inner, member, depth + 1)? {
                    return Ok(Some((bits / 8 + off, t)));
                }
            }
        }
        Ok(None)
    }

    /// Byte offset of `member` in `struct name`, and the member's size.
    pub fn member(&self, strukt: &str, member: &str) -> Result<(u32, u32), BtfError> {
        let id = self.find(KIND_STRUCT, strukt)?;
        let (off, ty) = self
            .member_in(id, member, 0)?
            .ok_or_else(|| BtfError::Missing(format!("member {member} of struct {strukt}")))?;
        Ok((off, self.size(ty)?))
    }

    /// The offset of `strukt.member`, checked to be `size` bytes.
    pub fn sized_member(&self, strukt: &str, member: &str, size: u32) -> Result<u32, BtfError> {
        let (off, got) = self.member(strukt, member)?;
        if got != size {
            return Err(BtfError::Unexpected(format!(
                "{strukt}.{member} is {got} bytes, not {size}"
            )));
        }
        Ok(off)
    }

    fn size(&self, id: u32) -> Result<u32, BtfError> {
        self.size_at(id, 0)
    }

    /// `depth`: arrays of arrays followed so far (a malformed loop ends).
    fn size_at(&self, id: u32, depth: u32) -> Result<u32, BtfError> {
        if depth > 8 {
            return Err(BtfError::Unexpected("arrays nested too deep".into()));
        }
        let t = self.get(self.strip(id)?)?;
        match t.kind {
            KIND_INT | KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64 => Ok(t.size_or_type),
            KIND_PTR => Ok(8),
            // `struct btf_array { type, index_type, nelems }` follows.
            KIND_ARRAY => {
                let elem = u32_at(&self.types_data, t.extra)?;
                let count = u32_at(&self.types_data, t.extra + 8)?;
                self.size_at(elem, depth + 1)?
                    .checked_mul(count)
                    .ok_or_else(|| BtfError::Unexpected("array size overflows".into()))
            }
            k => Err(BtfError::Unexpected(format!("size of a type of kind {k}"))),
        }
    }

    /// The value of enumerator `name` of `enum ty`.
    pub fn enum_value(&self, ty: &str, name: &str) -> Result<u64, BtfError> {
        let enum32 = self.find(KIND_ENUM, ty);
        let (id, entry) = match enum32 {
            Ok(id) => (id, 8),
            Err(_) => (self.find(KIND_ENUM64, ty)?, 12),
        };
        let t = *self.get(id)?;
        for i in 0..t.vlen as usize {
            let at = t.extra + entry * i;
            let name_off = u32_at(&self.types_data, at)?;
            if self.string(name_off) == name {
                let lo = u64::from(u32_at(&self.types_data, at + 4)?);
                let hi = if entry == 12 {
                    u64::from(u32_at(&self.types_data, at + 8)?)
                } else {
                    0
                };
                return Ok(hi << 32 | lo);
            }
        }
        Err(BtfError::Missing(format!("{name} in enum {ty}")))
    }

    /// What each argument of a tracepoint's `TP_PROTO` points to (a struct
    /// name, or "" for anything else). The kernel describes the prototype as
    /// `typedef void (*btf_trace_NAME)(void *ctx, args...)`; the leading
    /// context pointer is not an argument a raw tracepoint program sees.
    pub fn tracepoint_args(&self, tracepoint: &str) -> Result<Vec<String>, BtfError> {
        let typedef = self.find(KIND_TYPEDEF, &format!("btf_trace_{tracepoint}"))?;
        let ptr = self.get(self.get(typedef)?.size_or_type)?;
        let proto = *self.get(ptr.size_or_type)?;
        if ptr.kind != KIND_PTR || proto.kind != KIND_FUNC_PROTO {
            return Err(BtfError::Unexpected(format!(
                "btf_trace_{tracepoint} is not a function pointer"
            )));
        }
        (1..proto.vlen as usize)
            .map(|i| {
                let ty = u32_at(&self.types_data, proto.extra + 8 * i + 4)?;
                let t = self.get(self.strip(ty)?)?;
                if t.kind != KIND_PTR {
                    return Ok(String::new());
                }
                let target = self.get(self.strip(t.size_or_type)?)?;
                Ok(if target.kind == KIND_STRUCT {
                    self.name(target).to_string()
                } else {
                    String::new()
                })
            })
            .collect()
    }
}

/// The raw-tracepoint argument index of `tcp:tcp_sendmsg_locked`'s socket
/// and message; the probe reads these two fixed slots (a context read must
/// have a constant offset), so the prototype is checked against them.
pub const SENDMSG_SK_ARG: usize = 0;
pub const SENDMSG_MSG_ARG: usize = 1;

/// The offsets the TCP hook needs, checked against what it assumes: the
/// prototypes `tcp_sendmsg_locked(struct sock *, struct msghdr *, ...)` and
/// `tcp_rcv_space_adjust(struct sock *)`, 4-byte sequence numbers, the
/// one-byte `iter_type`, 8-byte pointers and sizes, and `ubuf` sharing its
/// slot with `__iov`.
pub fn send_offsets(btf: &Btf) -> Result<SendOffsets, BtfError> {
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
        btf.size(btf.find(KIND_STRUCT, "iovec")?)?,
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
fn tcp_sock_begins_with_sock(btf: &Btf) -> Result<(), BtfError> {
    let (first, _) = btf.member("tcp_sock", "inet_conn")?;
    if first != 0 {
        return Err(BtfError::Unexpected(
            "tcp_sock does not begin with its inet_connection_sock".into(),
        ));
    }
    Ok(())
}

/// The offsets the raw `tcp:tcp_probe` program needs, checked against what
/// it assumes: the prototype `tcp_probe(struct sock *, struct sk_buff *)`,
/// 4-byte sequence numbers, 2-byte family and ports, and the segment's
/// `tcp_skb_cb` inside `sk_buff.cb`.
pub fn segment_offsets(btf: &Btf) -> Result<SegmentOffsets, BtfError> {
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
    btf: &Btf,
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

/// The raw tracepoints of the hot path and what their arguments must point
/// to, in order ("" for an argument that is not a struct pointer): the
/// probes read these slots by index, so each prototype is checked.
/// `sched_switch` has had `prev_state` as its fourth argument since 5.18.
pub const HOT_PROTOTYPES: &[(&str, &[&str])] = &[
    ("sched_switch", &["", "task_struct", "task_struct", ""]),
    ("sched_wakeup", &["task_struct"]),
    ("sched_wakeup_new", &["task_struct"]),
    ("sock_send_length", &["sock", "", ""]),
    ("sock_recv_length", &["sock", "", ""]),
];

/// The offsets the raw scheduler tracepoints need, after checking every
/// prototype of [`HOT_PROTOTYPES`].
pub fn task_offsets(btf: &Btf) -> Result<TaskOffsets, BtfError> {
    for &(tracepoint, want) in HOT_PROTOTYPES {
        let args = btf.tracepoint_args(tracepoint)?;
        if args != want {
            return Err(BtfError::Unexpected(format!(
                "{tracepoint} takes ({}), not ({})",
                args.join(", "),
                want.join(", ")
            )));
        }
    }
    let (pid, size) = btf.member("task_struct", "pid")?;
    if size != 4 {
        return Err(BtfError::Unexpected(format!(
            "task_struct.pid is {size} bytes, not 4"
        )));
    }
    let (last_queued, last_arrival) = sched_info_offsets(btf).unwrap_or((ABSENT, ABSENT));
    Ok(TaskOffsets {
        pid,
        last_queued,
        last_arrival,
    })
}

/// `task_struct.sched_info.last_queued` and `.last_arrival` (8 bytes each),
/// from the start of `task_struct`; an error on kernels without
/// CONFIG_SCHED_INFO.
fn sched_info_offsets(btf: &Btf) -> Result<(u32, u32), BtfError> {
    let (info, _) = btf.member("task_struct", "sched_info")?;
    let member = |name: &str| -> Result<u32, BtfError> {
        let (off, size) = btf.member("sched_info", name)?;
        if size != 8 {
            return Err(BtfError::Unexpected(format!(
                "sched_info.{name} is {size} bytes, not 8"
            )));
        }
        Ok(info + off)
    };
    Ok((member("last_queued")?, member("last_arrival")?))
}

/// Offset of a received segment's acknowledgment number in its `struct
/// sk_buff`: the control block `cb`, where TCP keeps `struct tcp_skb_cb`,
/// and its `ack_seq` (host order, filled before `tcp_rcv_established`).
pub fn skb_ack_seq_offset(btf: &Btf) -> Result<u32, BtfError> {
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

/// Offsets of a socket's network namespace pointer in `struct sock`
/// (`__sk_common.skc_net`, a `possible_net_t` whose only member is the
/// pointer) and of the namespace's inode number in `struct net` (`ns.inum`).
pub fn netns_offsets(btf: &Btf) -> Result<(u32, u32), BtfError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds BTF blobs by hand, as the kernel lays them out.
    #[derive(Default)]
    struct Builder {
        types: Vec<u8>,
        strings: Vec<u8>,
        next_id: u32,
    }

    impl Builder {
        fn new() -> Self {
            Self {
                strings: vec![0],
                next_id: 1,
                ..Self::default()
            }
        }

        fn string(&mut self, s: &str) -> u32 {
            if s.is_empty() {
                return 0;
            }
            let off = self.strings.len() as u32;
            self.strings.extend_from_slice(s.as_bytes());
            self.strings.push(0);
            off
        }

        fn push(&mut self, name: &str, kind: u32, vlen: u32, size_or_type: u32) -> u32 {
            let name_off = self.string(name);
            for w in [name_off, kind << 24 | vlen, size_or_type] {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
            self.next_id += 1;
            self.next_id - 1
        }

        fn words(&mut self, words: &[u32]) {
            for w in words {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
        }

        fn int(&mut self, name: &str, size: u32) -> u32 {
            let id = self.push(name, KIND_INT, 0, size);
            self.words(&[size * 8]);
            id
        }

        /// A struct or union of (name, type, byte offset) members.
        fn record(
            &mut self,
            kind: u32,
            name: &str,
            size: u32,
            members: &[(&str, u32, u32)],
        ) -> u32 {
            let id = self.push(name, kind, members.len() as u32, size);
            for &(m, ty, off) in members {
                let n = self.string(m);
                self.words(&[n, ty, off * 8]);
            }
            id
        }

        /// `typedef void (*btf_trace_NAME)(void *, args...)`, as the
        /// kernel declares each tracepoint.
        fn tracepoint(&mut self, name: &str, void_ptr: u32, args: &[u32]) {
            let proto = self.push("", KIND_FUNC_PROTO, args.len() as u32 + 1, 0);
            self.words(&[0, void_ptr]);
            for &a in args {
                self.words(&[0, a]);
            }
            let fn_ptr = self.push("", KIND_PTR, 0, proto);
            self.push(&format!("btf_trace_{name}"), KIND_TYPEDEF, 0, fn_ptr);
        }

        /// `struct tcp_sock`, beginning with `sock` (through
        /// `inet_connection_sock`), then `members`.
        fn tcp_sock(&mut self, sock: u32, members: &[(&str, u32, u32)]) {
            let icsk = self.record(
                KIND_STRUCT,
                "inet_connection_sock",
                1496,
                &[("icsk_inet", sock, 0)],
            );
            let mut all = vec![("inet_conn", icsk, 0)];
            all.extend_from_slice(members);
            self.record(KIND_STRUCT, "tcp_sock", 2560, &all);
        }

        fn blob(&self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(&MAGIC.to_le_bytes());
            out.extend_from_slice(&[1, 0]);
            let (tl, sl) = (self.types.len() as u32, self.strings.len() as u32);
            for w in [24, 0, tl, tl, sl] {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.extend_from_slice(&self.types);
            out.extend_from_slice(&self.strings);
            out
        }
    }

    /// This kernel's layout of the structs the send probe reads (6.18),
    /// with the anonymous unions where the kernel has them.
    fn kernel_like(iov_offset_at: u32) -> Vec<u8> {
        let mut b = Builder::new();
        let u8_t = b.int("u8", 1);
        let size_t = b.int("long unsigned int", 8);
        let int_t = b.int("int", 4);
        let void_ptr = b.push("", KIND_PTR, 0, 0);
        let iovec = b.record(
            KIND_STRUCT,
            "iovec",
            16,
            &[("iov_base", void_ptr, 0), ("iov_len", size_t, 8)],
        );
        let iovec_ptr = b.push("", KIND_PTR, 0, iovec);
        let inner_union = b.record(
            KIND_UNION,
            "",
            8,
            &[("__iov", iovec_ptr, 0), ("ubuf", void_ptr, 0)],
        );
        let inner_struct = b.record(
            KIND_STRUCT,
            "",
            16,
            &[("", inner_union, 0), ("count", size_t, 8)],
        );
        let outer_union = b.record(
            KIND_UNION,
            "",
            16,
            &[("__ubuf_iovec", iovec, 0), ("", inner_struct, 0)],
        );
        let segs_union = b.record(KIND_UNION, "", 8, &[("nr_segs", size_t, 0)]);
        let iov_iter = b.record(
            KIND_STRUCT,
            "iov_iter",
            40,
            &[
                ("iter_type", u8_t, 0),
                ("iov_offset", size_t, iov_offset_at),
                ("", outer_union, 16),
                ("", segs_union, 32),
            ],
        );
        let msghdr = b.record(
            KIND_STRUCT,
            "msghdr",
            96,
            &[
                ("msg_name", void_ptr, 0),
                ("msg_namelen", int_t, 8),
                ("msg_iter", iov_iter, 16),
            ],
        );
        let enum_id = b.push("iter_type", KIND_ENUM, 2, 4);
        let (ubuf, iovec_name) = (b.string("ITER_UBUF"), b.string("ITER_IOVEC"));
        b.words(&[ubuf, 0, iovec_name, 1]);
        let _ = enum_id;
        let sock = b.record(KIND_STRUCT, "sock", 8, &[("sk_x", size_t, 0)]);
        let sock_ptr = b.push("", KIND_PTR, 0, sock);
        let const_msghdr = b.push("", KIND_CONST, 0, msghdr);
        let msghdr_ptr = b.push("", KIND_PTR, 0, const_msghdr);
        b.tracepoint(
            "tcp_sendmsg_locked",
            void_ptr,
            &[sock_ptr, msghdr_ptr, int_t],
        );
        b.tracepoint("tcp_rcv_space_adjust", void_ptr, &[sock_ptr]);
        let u32_t = b.int("u32", 4);
        b.tcp_sock(
            sock,
            &[("copied_seq", u32_t, 1588), ("write_seq", u32_t, 1700)],
        );
        b.blob()
    }

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

    #[test]
    fn a_moved_member_moves_its_offset() {
        let btf = Btf::parse(&kernel_like(4)).expect("parse");
        assert_eq!(
            btf.member("iov_iter", "iov_offset").expect("member"),
            (4, 8)
        );
    }

    #[test]
    fn prototype_args_name_their_structs() {
        let btf = Btf::parse(&kernel_like(8)).expect("parse");
        assert_eq!(
            btf.tracepoint_args("tcp_sendmsg_locked").expect("args"),
            vec!["sock".to_string(), "msghdr".into(), String::new()]
        );
        assert!(matches!(
            btf.tracepoint_args("tcp_probe"),
            Err(BtfError::Missing(_))
        ));
    }

    /// The hot tracepoints' prototypes as 6.18 has them, `sched_switch`
    /// with or without `prev_state` (before 5.18), and `task_struct.pid`.
    fn scheduler_like(with_prev_state: bool, pid_size: u32) -> Vec<u8> {
        scheduler_with(with_prev_state, pid_size, "sched_info")
    }

    /// As [`scheduler_like`], the `sched_info` member named `info` (another
    /// name: a kernel without CONFIG_SCHED_INFO).
    fn scheduler_with(with_prev_state: bool, pid_size: u32, info: &str) -> Vec<u8> {
        let mut b = Builder::new();
        let int_t = b.int("int", 4);
        let pid_t = b.int("pid_t", pid_size);
        let bool_t = b.int("_Bool", 1);
        let void_ptr = b.push("", KIND_PTR, 0, 0);
        let u64_t = b.int("long long unsigned int", 8);
        let sched_info = b.record(
            KIND_STRUCT,
            "sched_info",
            48,
            &[
                ("pcount", u64_t, 0),
                ("run_delay", u64_t, 8),
                ("last_arrival", u64_t, 32),
                ("last_queued", u64_t, 40),
            ],
        );
        let task = b.record(
            KIND_STRUCT,
            "task_struct",
            2048,
            &[
                ("__state", int_t, 24),
                (info, sched_info, 1000),
                ("pid", pid_t, 1496),
            ],
        );
        let task_ptr = b.push("", KIND_PTR, 0, task);
        let sock = b.record(KIND_STRUCT, "sock", 8, &[("sk_x", int_t, 0)]);
        let sock_ptr = b.push("", KIND_PTR, 0, sock);
        let typedef =
            |b: &mut Builder, name: &str, args: &[u32]| b.tracepoint(name, void_ptr, args);
        if with_prev_state {
            typedef(&mut b, "sched_switch", &[bool_t, task_ptr, task_ptr, int_t]);
        } else {
            typedef(&mut b, "sched_switch", &[bool_t, task_ptr, task_ptr]);
        }
        typedef(&mut b, "sched_wakeup", &[task_ptr]);
        typedef(&mut b, "sched_wakeup_new", &[task_ptr]);
        typedef(&mut b, "sock_send_length", &[sock_ptr, int_t, int_t]);
        typedef(&mut b, "sock_recv_length", &[sock_ptr, int_t, int_t]);
        b.blob()
    }

    #[test]
    fn task_offsets_follow_the_prototypes() {
        let btf = Btf::parse(&scheduler_like(true, 4)).expect("parse");
        assert_eq!(
            task_offsets(&btf).expect("offsets"),
            TaskOffsets {
                pid: 1496,
                last_queued: 1040,
                last_arrival: 1032,
            }
        );
        // Before 5.18 sched_switch has no prev_state: the classic tracepoint.
        // Without CONFIG_SCHED_INFO: the wakeup programs tell wakeups.
        let btf = Btf::parse(&scheduler_with(true, 4, "other")).expect("parse");
        let off = task_offsets(&btf).expect("offsets");
        assert_eq!((off.pid, off.has_sched_info()), (1496, false));
        let btf = Btf::parse(&scheduler_like(false, 4)).expect("parse");
        let err = task_offsets(&btf).expect_err("three-argument sched_switch");
        assert!(err.to_string().contains("sched_switch"), "{err}");
        // A pid the probe would read wrongly.
        let btf = Btf::parse(&scheduler_like(true, 8)).expect("parse");
        assert!(task_offsets(&btf).is_err());
        // A kernel without the sock tracepoints (before 6.3).
        let btf = Btf::parse(&kernel_like(8)).expect("parse");
        assert!(matches!(task_offsets(&btf), Err(BtfError::Missing(_))));
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

    #[test]
    fn rejects_what_is_not_btf() {
        assert!(Btf::parse(b"not btf at all, not btf at all").is_err());
        let mut blob = kernel_like(8);
        blob.truncate(blob.len() - 40);
        assert!(Btf::parse(&blob).is_err());
    }

    /// The running kernel's own BTF, where it has one: the probe depends on
    /// reading it, and this kernel (6.18) has `tcp_sendmsg_locked`.
    #[test]
    fn reads_this_kernels_btf() {
        if !Path::new(VMLINUX).exists() {
            eprintln!("skipped: no {VMLINUX}");
            return;
        }
        let btf = Btf::vmlinux().expect("vmlinux BTF");
        match skb_ack_seq_offset(&btf) {
            Ok(off) => assert!(off > 0 && off % 4 == 0, "ack_seq at {off}"),
            Err(BtfError::Missing(what)) => eprintln!("this kernel lacks {what}"),
            Err(e) => panic!("{e}"),
        }
        match netns_offsets(&btf) {
            Ok((net, inum)) => assert!(net % 8 == 0 && inum % 4 == 0, "{net} {inum}"),
            Err(BtfError::Missing(what)) => eprintln!("this kernel lacks {what}"),
            Err(e) => panic!("{e}"),
        }
        match send_offsets(&btf) {
            Ok(off) => {
                assert_ne!(off.iter_ubuf, off.iter_iovec);
                assert_eq!(off.ubuf, off.iov);
                assert!(off.count > off.ubuf && off.nr_segs > off.count);
            }
            Err(BtfError::Missing(what)) => eprintln!("this kernel lacks {what}"),
            Err(e) => panic!("{e}"),
        }
        match segment_offsets(&btf) {
            Ok(off) => {
                assert!(off.snd_nxt > 1000 && off.snd_una > 1000, "{off:?}");
                assert_eq!(off.skb_end_seq, off.skb_seq + 4, "{off:?}");
                assert_eq!(off.num, off.dport + 2, "{off:?}");
            }
            Err(BtfError::Missing(what)) => eprintln!("this kernel lacks {what}"),
            Err(e) => panic!("{e}"),
        }
        match task_offsets(&btf) {
            // pid sits well inside task_struct on every kernel.
            Ok(off) => assert!(off.pid > 64, "{off:?}"),
            Err(BtfError::Missing(what)) => eprintln!("this kernel lacks {what}"),
            Err(e) => panic!("{e}"),
        }
    }
}
