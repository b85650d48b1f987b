//! The kernel descriptions kept under `tests/kernels/`, for the plan's
//! tests. `this-machine.json` was read from the running kernel of the
//! machine the project is built on; the others are derived from it by
//! removing one piece each (BTF, the TCP send tracepoints, every TCP
//! tracepoint, cgroup v2), as a kernel without that piece describes
//! itself: derived, not recorded on such kernels, and each says so in its
//! note. [`records_this_kernel`] writes them all, as root (tracefs is
//! root's):
//!
//! `TTFT_TRACE_RECORD_KERNELS=1 cargo test -p ttft-trace --lib records_this_kernel -- --ignored`

use std::path::PathBuf;

use super::{
    btf::{BtfError, VMLINUX},
    kernel::KernelDescription,
};
use crate::host::tracefs::TracefsError;

/// (file, description) of each kept kernel.
pub const KERNELS: &[(&str, &str)] = &[
    (
        "this-machine.json",
        include_str!("../../tests/kernels/this-machine.json"),
    ),
    (
        "no-btf.json",
        include_str!("../../tests/kernels/no-btf.json"),
    ),
    (
        "no-tcp-send-tracepoints.json",
        include_str!("../../tests/kernels/no-tcp-send-tracepoints.json"),
    ),
    (
        "no-tcp-tracepoints.json",
        include_str!("../../tests/kernels/no-tcp-tracepoints.json"),
    ),
    (
        "no-cgroup2.json",
        include_str!("../../tests/kernels/no-cgroup2.json"),
    ),
];

/// The kept kernel of that file name.
pub fn kernel(file: &str) -> KernelDescription {
    let (_, text) = KERNELS
        .iter()
        .find(|(name, _)| *name == file)
        .expect("a kept kernel description");
    serde_json::from_str(text).expect("a kernel description")
}

/// What reading a file the kernel lacks says.
fn absent() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::ENOENT)
}

/// Each derived description, from this machine's: (file, description).
fn derived(machine: &KernelDescription) -> Vec<(&'static str, KernelDescription)> {
    let derive = |note: &str, change: &dyn Fn(&mut KernelDescription)| {
        let mut k = machine.clone();
        k.note = format!("derived from this-machine.json: {note}");
        change(&mut k);
        k
    };
    let no_btf = derive("no /sys/kernel/btf/vmlinux", &|k| {
        k.btf = Err(BtfError::Read(VMLINUX.into(), absent()).to_string());
    });
    let send_tracepoints = ["tcp_sendmsg_locked", "tcp_rcv_space_adjust"];
    let no_send = derive(
        "no tcp:tcp_sendmsg_locked nor tcp_rcv_space_adjust (as before Linux 6.2), in BTF",
        &|k| without_tracepoints(k, &send_tracepoints),
    );
    let no_tcp = derive("no tcp:* tracepoint at all, in tracefs nor BTF", &|k| {
        let all = ["tcp_retransmit_skb", "tcp_receive_reset", "tcp_send_reset"];
        without_tracepoints(k, &all);
        without_tracepoints(k, &send_tracepoints);
        without_tracepoints(k, &["tcp_probe"]);
    });
    let no_cgroup2 = derive("no cgroup v2 hierarchy mounted", &|k| {
        k.cgroup2 = Err("no cgroup v2 hierarchy is mounted".into());
    });
    vec![
        ("no-btf.json", no_btf),
        ("no-tcp-send-tracepoints.json", no_send),
        ("no-tcp-tracepoints.json", no_tcp),
        ("no-cgroup2.json", no_cgroup2),
    ]
}

/// Removes `tcp:` tracepoints: their format files (where read) and their
/// prototypes in BTF.
fn without_tracepoints(k: &mut KernelDescription, names: &[&str]) {
    for name in names {
        if let Ok(tracepoints) = &mut k.tracefs {
            let tp = format!("tcp:{name}");
            if let Some(format) = tracepoints.formats.get_mut(&tp) {
                *format = Err(TracefsError::NoTracepoint(tp, absent()).to_string());
            }
        }
        if let Ok(btf) = &mut k.btf {
            btf.without_tracepoint(name);
        }
    }
}

fn kernels_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/kernels")
}

#[test]
#[ignore = "writes tests/kernels/ from this machine's kernel: run as root with \
            TTFT_TRACE_RECORD_KERNELS=1 and --ignored"]
fn records_this_kernel() {
    if std::env::var_os("TTFT_TRACE_RECORD_KERNELS").is_none() {
        eprintln!("SKIP: set TTFT_TRACE_RECORD_KERNELS=1 to record");
        return;
    }
    let mut machine = KernelDescription::read();
    assert!(machine.tracefs.is_ok(), "tracefs: {:?}", machine.tracefs);
    machine.note = format!(
        "read from the running kernel ({}) by recorded_kernels::records_this_kernel",
        machine.release.as_deref().unwrap_or("?")
    );
    let dir = kernels_dir();
    std::fs::create_dir_all(&dir).expect("tests/kernels");
    let mut all = vec![("this-machine.json", machine.clone())];
    all.extend(derived(&machine));
    for (file, k) in all {
        let text = serde_json::to_string_pretty(&k).expect("JSON") + "\n";
        std::fs::write(dir.join(file), text).expect("writing a kernel description");
    }
}

/// The derived files are what deriving this machine's gives (none edited
/// by hand).
#[test]
fn derived_kernels_are_derived() {
    let machine = kernel("this-machine.json");
    for (file, k) in derived(&machine) {
        assert_eq!(kernel(file), k, "{file}");
    }
}
