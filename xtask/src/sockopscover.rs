//! Which received segments a cgroup `sock_ops` program sees, and a
//! `cgroup_skb` one (`cargo xtask bench --only sockops`): the check behind
//! docs/limits.md's answer to "why not replace `tcp_probe` with per-socket
//! `sock_ops` callbacks?", and the coverage of the hook that could scope
//! the segment program to the workload's cgroup instead.
//!
//! `sock_ops` callbacks are switched on per socket
//! (`bpf_sock_ops_cb_flags_set`), so a connection that is not followed
//! would run no program per segment, where `raw_tcp_probe` runs on every
//! segment of the host. The tracer needs two things of a followed
//! connection's segments: when data arrived (a request) and what it
//! acknowledged (the response's first bytes reached the client). This
//! bench sets both per-segment flags, `PARSE_ALL_HDR_OPT` (documented as
//! "every TCP header received") and `RTT`, on every connection established
//! while it runs, and counts the callbacks of the 1-byte loopback ping-pong
//! of `hosttax tcp` (every segment carries data and acknowledges the last
//! one) against the segments the kernel processed, counted by a program
//! on `tcp:tcp_probe`. Beside them, a `cgroup_skb` ingress program on the
//! same cgroup counts the packets it runs for: the hook that a segment
//! program scoped to the workload's cgroup would use.
//!
//! The programs are hand-assembled and loaded with the bpf() syscall, as
//! the empty floor program is ([`crate::rawfloor`]), and the cgroup ones
//! are attached with links, so that they go when the bench does (the flags
//! stay on the sockets opened in that second; with no program left, the
//! kernel's calls for them find none to run). The figures are stated, not
//! judged.

use std::{os::fd::AsRawFd as _, os::fd::OwnedFd, path::Path};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use crate::{
    cgroup2::{self, BPF_CGROUP_INET_INGRESS},
    hosttax::run_fixture,
    placement::Placement,
    rawfloor::{ATTR_SIZE, BPF_PROG_TYPE_RAW_TRACEPOINT, bpf, call, load_insns, put, raw_tp_open},
};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_PROG_TYPE_SOCK_OPS: u32 = 13;
const BPF_PROG_TYPE_CGROUP_SKB: u32 = 8;
const BPF_CGROUP_SOCK_OPS: u32 = 3;
/// `sock_ops` operations: an active and a passive open completed, an RTT
/// sample (an ACK of new data), a received header parsed.
const OP_ACTIVE_ESTABLISHED: i32 = 4;
const OP_PASSIVE_ESTABLISHED: i32 = 5;
const OP_RTT: u32 = 12;
const OP_PARSE_HDR: u32 = 13;
/// `BPF_SOCK_OPS_RTT_CB_FLAG | BPF_SOCK_OPS_PARSE_ALL_HDR_OPT_CB_FLAG`.
const FLAGS: i32 = 0x08 | 0x10;
/// The counter slots: one per `sock_ops` operation (below 32; masked so),
/// then `cgroup_skb` ingress and `tcp_probe`.
const SLOTS: u32 = 64;
const INGRESS_SLOT: i32 = 62;
const SEGMENT_SLOT: i32 = 63;
/// How long the ping-pong runs.
const MS: &str = "1000";

/// One instruction: opcode, registers, offset, immediate.
const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    code as u64
        | ((dst as u64) << 8)
        | ((src as u64) << 12)
        | ((off as u16 as u64) << 16)
        | ((imm as u32 as u64) << 32)
}

/// `map[*(u32 *)(r10 - 4)] += 1` (the key already stored), then `r0 = ret;
/// exit`: the shared tail of the programs.
fn count_tail(map: &OwnedFd, ret: i32) -> [u64; 10] {
    [
        insn(0xbf, 2, 10, 0, 0), // r2 = r10
        insn(0x07, 2, 0, 0, -4), // r2 += -4
        // r1 = the map (BPF_PSEUDO_MAP_FD), two slots.
        insn(0x18, 1, 1, 0, map.as_raw_fd()),
        0,
        insn(0x85, 0, 0, 0, 1),   // call bpf_map_lookup_elem
        insn(0x15, 0, 0, 2, 0),   // if r0 == 0 goto +2
        insn(0xb7, 1, 0, 0, 1),   // r1 = 1
        insn(0xdb, 0, 1, 0, 0),   // lock *(u64 *)(r0 + 0) += r1
        insn(0xb7, 0, 0, 0, ret), // r0 = ret
        insn(0x95, 0, 0, 0, 0),   // exit
    ]
}

/// Counts each operation; on an open, first sets [`FLAGS`] on the socket.
fn sock_ops_prog(map: &OwnedFd) -> Vec<u64> {
    let mut p = vec![
        insn(0xbf, 6, 1, 0, 0),                      // r6 = ctx
        insn(0x61, 7, 6, 0, 0),                      // r7 = ctx->op
        insn(0x15, 7, 0, 2, OP_ACTIVE_ESTABLISHED),  // -> set flags
        insn(0x15, 7, 0, 1, OP_PASSIVE_ESTABLISHED), // -> set flags
        insn(0x05, 0, 0, 3, 0),                      // -> count
        insn(0xbf, 1, 6, 0, 0),                      // r1 = ctx
        insn(0xb7, 2, 0, 0, FLAGS),                  // r2 = FLAGS
        insn(0x85, 0, 0, 0, 59),                     // call bpf_sock_ops_cb_flags_set
        insn(0x57, 7, 0, 0, 31),                     // count: r7 &= 31
        insn(0x63, 10, 7, -4, 0),                    // *(u32 *)(r10 - 4) = r7
    ];
    p.extend(count_tail(map, 1));
    p
}

/// Counts every run in `slot`, returns `ret` (1: a `cgroup_skb` program
/// lets the packet through).
fn counter_prog(map: &OwnedFd, slot: i32, ret: i32) -> Vec<u64> {
    let mut p = vec![insn(0x62, 10, 0, -4, slot)]; // *(u32 *)(r10 - 4) = slot
    p.extend(count_tail(map, ret));
    p
}

/// Measures the coverage; stated, not judged.
pub fn run(root: &Path) -> Result<Value> {
    let mut attr = [0u8; ATTR_SIZE];
    for (at, v) in [(0, BPF_MAP_TYPE_ARRAY), (4, 4), (8, 8), (12, SLOTS)] {
        put(&mut attr, at, &v.to_ne_bytes());
    }
    let Some(cgroup_path) = cgroup2::root()?.map(|p| p.display().to_string()) else {
        println!("sock_ops coverage: skipped, no cgroup v2 hierarchy is mounted");
        return Ok(json!({"skipped": "no cgroup v2 hierarchy"}));
    };
    let map = bpf(BPF_MAP_CREATE, &attr).context("creating the counters")?;
    let cgroup = std::fs::File::open(&cgroup_path).with_context(|| cgroup_path.clone())?;
    let sock_ops = load_insns(
        BPF_PROG_TYPE_SOCK_OPS,
        &sock_ops_prog(&map),
        "sockops_cover",
    )
    .context("loading sock_ops")?;
    let _sock_ops_link =
        cgroup2::link(&sock_ops, &cgroup, BPF_CGROUP_SOCK_OPS).context("attaching sock_ops")?;
    let ingress = load_insns(
        BPF_PROG_TYPE_CGROUP_SKB,
        &counter_prog(&map, INGRESS_SLOT, 1),
        "ingress_count",
    )
    .context("loading the cgroup_skb counter")?;
    let _ingress_link = cgroup2::link(&ingress, &cgroup, BPF_CGROUP_INET_INGRESS)
        .context("attaching cgroup_skb ingress")?;
    let segments = load_insns(
        BPF_PROG_TYPE_RAW_TRACEPOINT,
        &counter_prog(&map, SEGMENT_SLOT, 0),
        "segment_count",
    )
    .context("loading the segment counter")?;
    let _segment_link = raw_tp_open(&segments, Some(c"tcp_probe"))?;

    // Both ends on one CPU (the last this process may use, as the host-tax
    // bench places them), so that each turn is a context switch rather than
    // a wakeup of another CPU: more round trips a second.
    let place = Placement::new()?;
    let cpu = place.measured.to_string();
    let out = run_fixture(&root.join("target/fixtures/hosttax"), &["tcp", MS, &cpu])?;
    drop(place);
    let ping: Value = serde_json::from_str(out.lines().last().unwrap_or("{}"))?;
    let count = |slot: u32| -> Result<u64> {
        let mut value = 0u64;
        let mut attr = [0u8; ATTR_SIZE];
        put(&mut attr, 0, &(map.as_raw_fd() as u32).to_ne_bytes());
        put(&mut attr, 8, &(&slot as *const u32 as u64).to_ne_bytes());
        put(
            &mut attr,
            16,
            &(&mut value as *mut u64 as u64).to_ne_bytes(),
        );
        call(BPF_MAP_LOOKUP_ELEM, &mut attr).context("reading a counter")?;
        Ok(value)
    };
    let (seen, parsed, rtt, ingress) = (
        count(SEGMENT_SLOT as u32)?,
        count(OP_PARSE_HDR)?,
        count(OP_RTT)?,
        count(INGRESS_SLOT as u32)?,
    );
    if seen == 0 {
        bail!("no segment was counted on tcp:tcp_probe during the ping-pong");
    }
    let share = |n: u64| n as f64 / seen as f64 * 100.0;
    println!(
        "sock_ops on the {cgroup_path} cgroup, loopback TCP ping-pong ({} round trips): of {seen} \
         segments the kernel processed (tcp_probe), the header-parse callback \
         (PARSE_ALL_HDR_OPT) saw {parsed} ({:.3} %) and the RTT callback (an ACK of new data) \
         {rtt} ({:.1} %); a cgroup_skb ingress program there ran for {ingress} packets ({:.1} %, \
         any other packet the host received in that second included)",
        ping["ops"],
        share(parsed),
        share(rtt),
        share(ingress)
    );
    Ok(json!({
        "cgroup": cgroup_path,
        "round_trips": ping["ops"],
        "segments_tcp_probe": seen,
        "parse_hdr_callbacks": parsed,
        "rtt_callbacks": rtt,
        "cgroup_skb_ingress_packets": ingress,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_encode_as_the_kernel_reads_them() {
        // The floor program's two instructions, as rawfloor writes them.
        assert_eq!(insn(0xb7, 0, 0, 0, 0), 0x0000_0000_0000_00b7);
        assert_eq!(insn(0x95, 0, 0, 0, 0), 0x0000_0000_0000_0095);
        // dst in the low nibble, src in the high one, offset and immediate
        // two's complement.
        assert_eq!(insn(0x63, 10, 7, -4, 0), 0x0000_0000_fffc_7a63);
        assert_eq!(insn(0x07, 2, 0, 0, -4), 0xffff_fffc_0000_0207);
    }
}
