//! Reading the kernel's BTF (`/sys/kernel/btf/vmlinux`): just enough to
//! find struct member offsets, enum values and a tracepoint's prototype.
//! The eBPF side is Rust, which has no CO-RE relocations, so the layouts
//! the probes walk are read here at load time and handed over as load-time
//! globals, as the tracefs offsets are.
//!
//! [`parse`] reads the file; each layout reader (one file per thing the
//! probes read) asks it questions through [`Layouts`], which the facts
//! recorded in a kernel description ([`BtfFacts`]) answer as well.

#[cfg(test)]
mod builder;
mod facts;
mod netns;
mod parse;
mod segment;
mod send;
mod task;

pub use facts::{BtfFacts, Refusal};
pub use netns::netns_offsets;
pub use parse::{Btf, VMLINUX};
pub use segment::{segment_offsets, skb_ack_seq_offset};
pub use send::{SENDMSG_MSG_ARG, SENDMSG_SK_ARG, send_offsets};
pub use task::{HOT_PROTOTYPES, task_offsets};

use thiserror::Error;

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
    /// An answer recorded in a kernel description: the original error's
    /// text, said again as it was.
    #[error("{0}")]
    Recorded(String),
}

/// The questions the layout readers ask of BTF.
pub trait Layouts {
    /// Byte offset of `member` in `struct strukt` (looking into anonymous
    /// struct and union members as C does), and the member's size.
    fn member(&self, strukt: &str, member: &str) -> Result<(u32, u32), BtfError>;

    /// The size of `struct strukt`.
    fn struct_size(&self, strukt: &str) -> Result<u32, BtfError>;

    /// The value of enumerator `name` of `enum ty`.
    fn enum_value(&self, ty: &str, name: &str) -> Result<u64, BtfError>;

    /// What each argument of a tracepoint's `TP_PROTO` points to (a struct
    /// name, or "" for anything else). The kernel describes the prototype
    /// as `typedef void (*btf_trace_NAME)(void *ctx, args...)`; the leading
    /// context pointer is not an argument a raw tracepoint program sees.
    fn tracepoint_args(&self, tracepoint: &str) -> Result<Vec<String>, BtfError>;

    /// The offset of `strukt.member`, checked to be `size` bytes.
    fn sized_member(&self, strukt: &str, member: &str, size: u32) -> Result<u32, BtfError> {
        let (off, got) = self.member(strukt, member)?;
        if got != size {
            return Err(BtfError::Unexpected(format!(
                "{strukt}.{member} is {got} bytes, not {size}"
            )));
        }
        Ok(off)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The running kernel's own BTF, where it has one: the probe depends on
    /// reading it, and this kernel (6.18) has `tcp_sendmsg_locked`.
    #[test]
    fn reads_this_kernels_btf() {
        if !Path::new(VMLINUX).exists() {
            crate::test_support::skip_or_fail("reads_this_kernels_btf", &format!("no {VMLINUX}"));
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
        // Recorded for a kernel description, the facts read every layout
        // as the BTF itself does.
        let facts = BtfFacts::record(&btf);
        assert_eq!(every_layout(&facts), every_layout(&btf));
    }

    /// Every layout a kernel offers, as text (results and refusals).
    fn every_layout(l: &dyn Layouts) -> String {
        let text = |e: BtfError| e.to_string();
        format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{:?}",
            send_offsets(l).map_err(text),
            task_offsets(l).map_err(text),
            segment_offsets(l).map_err(text),
            skb_ack_seq_offset(l).map_err(text),
            netns_offsets(l).map_err(text)
        )
    }
}
