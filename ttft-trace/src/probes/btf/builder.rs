//! Test fixtures: BTF blobs built by hand, as the kernel lays them out.

use super::parse::{
    KIND_CONST, KIND_ENUM, KIND_FUNC_PROTO, KIND_INT, KIND_PTR, KIND_STRUCT, KIND_TYPEDEF,
    KIND_UNION, MAGIC,
};

/// Builds BTF blobs by hand, as the kernel lays them out.
#[derive(Default)]
pub(super) struct Builder {
    types: Vec<u8>,
    strings: Vec<u8>,
    next_id: u32,
}

impl Builder {
    pub(super) fn new() -> Self {
        Self {
            strings: vec![0],
            next_id: 1,
            ..Self::default()
        }
    }

    pub(super) fn string(&mut self, s: &str) -> u32 {
        if s.is_empty() {
            return 0;
        }
        let off = self.strings.len() as u32;
        self.strings.extend_from_slice(s.as_bytes());
        self.strings.push(0);
        off
    }

    pub(super) fn push(&mut self, name: &str, kind: u32, vlen: u32, size_or_type: u32) -> u32 {
        let name_off = self.string(name);
        for w in [name_off, kind << 24 | vlen, size_or_type] {
            self.types.extend_from_slice(&w.to_le_bytes());
        }
        self.next_id += 1;
        self.next_id - 1
    }

    pub(super) fn words(&mut self, words: &[u32]) {
        for w in words {
            self.types.extend_from_slice(&w.to_le_bytes());
        }
    }

    pub(super) fn int(&mut self, name: &str, size: u32) -> u32 {
        let id = self.push(name, KIND_INT, 0, size);
        self.words(&[size * 8]);
        id
    }

    /// A struct or union of (name, type, byte offset) members.
    pub(super) fn record(
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
    pub(super) fn tracepoint(&mut self, name: &str, void_ptr: u32, args: &[u32]) {
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
    pub(super) fn tcp_sock(&mut self, sock: u32, members: &[(&str, u32, u32)]) {
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

    pub(super) fn blob(&self) -> Vec<u8> {
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
pub(super) fn kernel_like(iov_offset_at: u32) -> Vec<u8> {
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
