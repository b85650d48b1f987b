//! eBPF side of ttft-trace: uprobes on the CUDA runtime and driver APIs, and
//! the scheduler tracepoints that keep the traced process tree current.
//!
//! Launches and copies are aggregated here (per-thread episode state, per
//! process counters); userspace gets one ring-buffer event per GPU episode.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod cuda;
#[cfg(target_arch = "bpf")]
mod h2;
#[cfg(target_arch = "bpf")]
mod ingress;
#[cfg(target_arch = "bpf")]
mod listen;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod mem;
#[cfg(target_arch = "bpf")]
mod process;
#[cfg(target_arch = "bpf")]
mod sched;
#[cfg(target_arch = "bpf")]
mod sock;
#[cfg(target_arch = "bpf")]
mod sock_event;
#[cfg(target_arch = "bpf")]
mod tcp;
#[cfg(target_arch = "bpf")]
mod tls;
#[cfg(target_arch = "bpf")]
mod tls_records;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // SAFETY: the verifier rejects any program that could reach this; it is
    // here only because no_std needs a panic handler.
    unsafe { core::hint::unreachable_unchecked() }
}

/// Host builds of the workspace compile this crate too; the probes exist
/// only for the BPF target.
#[cfg(not(target_arch = "bpf"))]
fn main() {}
