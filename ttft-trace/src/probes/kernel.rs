//! Step one of loading, reading the kernel: the format files of the
//! tracepoints the probes use, what its BTF says of the layouts they read,
//! and where the cgroup v2 hierarchy is mounted. Plain data, each part's
//! failure kept as its reason: [`super::plan`] decides from it alone, and a
//! description recorded on one machine can be planned on another (the
//! plan's tests run on the recorded kernels of `tests/kernels/`).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{
    TRACEPOINTS,
    btf::{Btf, BtfFacts},
    segment_scope::cgroup2_mount,
};
use crate::host::tracefs::{self, Format, TracefsError};

/// Most bytes read of `/proc/self/mounts`.
const MOUNTS_MAX: u64 = 1 << 20;

/// The syscall send hook's tracepoints whose fields it reads (in
/// `syscalls`): only that hook needs them, and CONFIG_FTRACE_SYSCALLS may
/// be off where the default hook works.
pub const SYSCALL_FORMATS: &[&str] = &[
    "sys_enter_write",
    "sys_enter_sendto",
    "sys_enter_writev",
    "sys_enter_sendmsg",
];

/// What a kernel offers the probes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelDescription {
    /// Where the description comes from: read from the running kernel, or
    /// recorded on a machine (and derived from that recording how).
    pub note: String,
    /// The kernel release (`/proc/sys/kernel/osrelease`), where readable.
    pub release: Option<String>,
    /// The format files of the tracepoints, or why tracefs cannot be read.
    pub tracefs: Result<Tracepoints, String>,
    /// What the kernel's BTF answered, or why it cannot be read.
    pub btf: Result<BtfFacts, String>,
    /// Where the cgroup v2 hierarchy is mounted, or why none is.
    pub cgroup2: Result<PathBuf, String>,
}

/// The format files read, by `category:name`: each one's fields, or why it
/// could not be read (the kernel lacks the tracepoint).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tracepoints {
    pub formats: BTreeMap<String, Result<Format, String>>,
}

impl Tracepoints {
    /// The format file of `category:name`, or the error reading it gave.
    pub fn format(&self, category: &str, name: &str) -> Result<&Format, TracefsError> {
        let tracepoint = format!("{category}:{name}");
        match self.formats.get(&tracepoint) {
            Some(Ok(format)) => Ok(format),
            Some(Err(why)) => Err(TracefsError::Recorded(why.clone())),
            None => Err(TracefsError::Recorded(format!(
                "tracepoint {tracepoint} is not in the kernel description"
            ))),
        }
    }
}

impl KernelDescription {
    /// Reads the running kernel (mounting tracefs where it is not).
    pub fn read() -> Self {
        let btf = Btf::vmlinux()
            .map(|btf| BtfFacts::record(&btf))
            .map_err(|e| e.to_string());
        Self {
            note: "read from the running kernel".into(),
            release: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .ok()
                .map(|s| s.trim().to_string()),
            tracefs: read_tracepoints().map_err(|e| e.to_string()),
            btf,
            cgroup2: read_cgroup2(),
        }
    }
}

/// Every format file the probes may read: the tracepoints they attach to,
/// and the syscall send hook's.
fn read_tracepoints() -> Result<Tracepoints, TracefsError> {
    let root = tracefs::root()?;
    let syscalls = SYSCALL_FORMATS.iter().map(|&name| ("syscalls", name));
    let wanted = TRACEPOINTS.iter().map(|&(_, c, n)| (c, n)).chain(syscalls);
    let formats = wanted
        .map(|(category, name)| {
            let read = Format::read(&root, category, name).map_err(|e| e.to_string());
            (format!("{category}:{name}"), read)
        })
        .collect();
    Ok(Tracepoints { formats })
}

fn read_cgroup2() -> Result<PathBuf, String> {
    let mounts = crate::host::rootfs::read_proc(Path::new("/proc/self/mounts"), MOUNTS_MAX)
        .map_err(|e| format!("reading /proc/self/mounts: {e}"))?;
    cgroup2_mount(&String::from_utf8_lossy(&mounts))
        .ok_or_else(|| "no cgroup v2 hierarchy is mounted".into())
}
