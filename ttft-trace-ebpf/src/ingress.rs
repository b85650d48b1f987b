//! Segments seen at a cgroup's ingress (`cgroup_skb`): the default way to
//! see a followed connection's segments where the traced workloads run in
//! cgroups of their own. The program is attached to those cgroups only, so
//! that the segments of every other process on the host run no program at
//! all (`tcp:tcp_probe` is host-wide: every TCP segment of the host pays
//! its dispatch). It shares [`on_segment`] with the tracepoints.
//!
//! The kernel runs it from `tcp_v4_rcv`/`tcp_v6_rcv` (`tcp_filter`) before
//! the segment is processed, as `tcp_probe` fires before, so `snd_una` is
//! what the previous segment left. It sees every segment, header-predicted
//! or not (`cargo xtask bench --only sockops` counts both). Segments of a
//! socket in `ESTABLISHED` count, and, for a connection already followed,
//! those that arrive after either side's close while the server still has
//! bytes in flight (`FIN_WAIT1`, `CLOSE_WAIT`, `CLOSING`, `LAST_ACK`):
//! `tcp_probe` fires in `ESTABLISHED` only, and a server that closes right
//! after its response takes the client's ACK of a retransmitted first
//! token there (issue 34: the state change that says everything was
//! acknowledged came one or two retransmission timeouts later).
//!
//! The packet starts at its IP header here. An IPv6 segment behind
//! extension headers is skipped (its TCP header is not where the fixed
//! header ends).

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{__sk_buff, bpf_sock, bpf_tcp_sock},
    helpers::{bpf_probe_read_kernel, bpf_tcp_sock},
    macros::cgroup_skb,
    programs::SkBuffContext,
};
use ttft_trace_common::ConnEvent;

use crate::{
    h2, listen,
    maps::{CONNS, INGRESS_LISTENERS},
    mem::kernel,
    sock::{TCP_LISTEN, send_offsets},
    tcp::{AF_INET, Segment, TCP_ESTABLISHED, on_segment},
};

const IPPROTO_TCP: u8 = 6;
const IPV6_HEADER: usize = 40;
/// `tcphdr` flags byte: ACK.
const TCP_ACK: u8 = 0x10;
/// The states after a close in which the server still takes ACKs of what
/// it sent (`include/net/tcp_states.h`).
const TCP_FIN_WAIT1: u32 = 4;
const TCP_CLOSE_WAIT: u32 = 8;
const TCP_LAST_ACK: u32 = 9;
const TCP_CLOSING: u32 = 11;

/// `cgroup_skb/ingress` on the traced workloads' cgroups. Always passes
/// the packet (0 would drop it).
#[cgroup_skb(ingress)]
pub fn skb_segment(ctx: SkBuffContext) -> i32 {
    on_ingress(&ctx);
    1
}

#[inline(always)]
fn on_ingress(ctx: &SkBuffContext) -> Option<()> {
    let skb = ctx.skb.skb;
    // SAFETY: context fields, rewritten by the verifier into loads from
    // the packet's socket (always a full socket here).
    let port = unsafe { (*skb).local_port } as u16;
    if !listen::port_followed(port) {
        return None;
    }
    // SAFETY: as above.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return None;
    }
    // SAFETY: checked non-null; a field the verifier allows on any socket.
    let state = unsafe { (*sk).state };
    if state == TCP_LISTEN as u32 {
        // A handshake on a followed listening socket (only TCP sockets
        // listen): for the self-check.
        // SAFETY: only the presence is read.
        if unsafe { INGRESS_LISTENERS.get(u32::from(port)) }.is_none() {
            let _ = INGRESS_LISTENERS.insert(u32::from(port), 1, 0);
        }
        return None;
    }
    let after_close = matches!(
        state,
        TCP_FIN_WAIT1 | TCP_CLOSE_WAIT | TCP_LAST_ACK | TCP_CLOSING
    );
    if state != TCP_ESTABLISHED && !after_close {
        return None;
    }
    // SAFETY: the helper takes any socket and returns null for one that is
    // not TCP (a UDP socket may share the port number).
    let tp = unsafe { bpf_tcp_sock(sk) };
    if tp.is_null() {
        return None;
    }
    let sk = address_of(sk)?;
    // After a close only a connection followed already: one is never
    // adopted there (it makes no more requests).
    if after_close && CONNS.get_ptr(sk).is_none() {
        return None;
    }
    let seg = Ingress::read(ctx, skb, tp, sk, port)?;
    on_segment(sk, &seg);
    if seg.data_len > 0 {
        h2::on_segment(ctx, sk, seg.payload_at, seg.data_len, seg.seq);
    }
    Some(())
}

/// The socket's address as a plain number: the connection table's key,
/// and what the other programs read the socket's fields through. The
/// verifier types `sk` as a socket, which no arithmetic may touch; a copy
/// read back through the helper is a number to it.
#[inline(always)]
fn address_of(sk: *mut bpf_sock) -> Option<u64> {
    let slot = sk as u64;
    // SAFETY: reads our own stack slot.
    unsafe { bpf_probe_read_kernel(&slot as *const u64) }.ok()
}

/// One segment at a cgroup's ingress: its headers, and its TCP socket.
struct Ingress {
    skb: *mut __sk_buff,
    tp: *mut bpf_tcp_sock,
    sk: u64,
    port: u16,
    data_len: u32,
    /// Where the payload starts in the packet, and its sequence number.
    payload_at: u32,
    seq: u32,
    ack_seq: Option<u32>,
    /// The segment's source port (the client's), network order.
    remote_port: u16,
}

impl Ingress {
    /// Reads the IP and TCP headers: payload length, acknowledgment.
    #[inline(always)]
    fn read(
        ctx: &SkBuffContext,
        skb: *mut __sk_buff,
        tp: *mut bpf_tcp_sock,
        sk: u64,
        port: u16,
    ) -> Option<Self> {
        let ip = ctx.load::<[u8; 10]>(0).ok()?;
        let tcp_at = match ip[0] >> 4 {
            4 if ip[9] == IPPROTO_TCP => usize::from(ip[0] & 0x0f) * 4,
            6 if ip[6] == IPPROTO_TCP => IPV6_HEADER,
            _ => return None,
        };
        let tcp = ctx.load::<[u8; 14]>(tcp_at).ok()?;
        let header = tcp_at + usize::from(tcp[12] >> 4) * 4;
        let ack_seq = (tcp[13] & TCP_ACK != 0)
            .then(|| u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]));
        Some(Self {
            skb,
            tp,
            sk,
            port,
            data_len: ctx.len().saturating_sub(header as u32),
            payload_at: header as u32,
            seq: u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]),
            ack_seq,
            remote_port: u16::from_ne_bytes([tcp[0], tcp[1]]),
        })
    }
}

impl Segment for Ingress {
    #[inline(always)]
    fn data_len(&self) -> Option<u32> {
        Some(self.data_len)
    }

    #[inline(always)]
    fn snd_nxt_una(&self) -> Option<(u32, u32)> {
        // SAFETY: a TCP socket's fields, checked non-null by the caller.
        Some(unsafe { ((*self.tp).snd_nxt, (*self.tp).snd_una) })
    }

    #[inline(always)]
    fn srtt_us(&self) -> u32 {
        // SAFETY: as above. Kept shifted left by 3, as the kernel does.
        unsafe { (*self.tp).srtt_us >> 3 }
    }

    #[inline(always)]
    fn ack_seq(&self) -> Option<u32> {
        self.ack_seq
    }

    /// The socket's `write_seq` (what the server queued) where BTF gave
    /// its offset. A segment is seen here as it arrives, before the socket
    /// takes it: on loopback the client's ACK can arrive inside the
    /// server's transmit of the data it acknowledges, before `snd_nxt`
    /// moves past that data.
    #[inline(always)]
    fn sent_bound(&self, snd_nxt: u32) -> u32 {
        match send_offsets().write_seq {
            0 => snd_nxt,
            at => kernel::<u32>(self.sk + u64::from(at)).unwrap_or(snd_nxt),
        }
    }

    #[inline(always)]
    fn sport(&self) -> Option<u16> {
        Some(self.port)
    }

    #[inline(always)]
    fn fill_peer(&self, ev: &mut ConnEvent) {
        let skb = self.skb;
        ev.dport = u16::from_be(self.remote_port);
        // The family and addresses of the packet's socket, as the raw
        // tracepoint reads them.
        ev.family = context_field(skb, offset_of!(__sk_buff, family)) as u16;
        if ev.family == AF_INET {
            let local = context_field(skb, offset_of!(__sk_buff, local_ip4));
            let remote = context_field(skb, offset_of!(__sk_buff, remote_ip4));
            ev.saddr[..4].copy_from_slice(&local.to_ne_bytes());
            ev.daddr[..4].copy_from_slice(&remote.to_ne_bytes());
        } else {
            for i in 0..4 {
                let at = i * 4;
                let local = context_field(skb, offset_of!(__sk_buff, local_ip6) + at);
                let remote = context_field(skb, offset_of!(__sk_buff, remote_ip6) + at);
                ev.saddr[at..at + 4].copy_from_slice(&local.to_ne_bytes());
                ev.daddr[at..at + 4].copy_from_slice(&remote.to_ne_bytes());
            }
        }
    }
}

/// One 4-byte field of the context, loaded at its constant offset: the
/// verifier rewrites context loads only where the offset is in the
/// instruction (a pointer moved into the context first is refused).
#[inline(always)]
fn context_field(skb: *mut __sk_buff, at: usize) -> u32 {
    // SAFETY: a field of the context, 4 bytes, as the verifier allows.
    unsafe { core::ptr::read_volatile(skb.cast::<u8>().add(at).cast::<u32>()) }
}
