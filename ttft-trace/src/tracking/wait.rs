//! `attach --wait`: waiting for the target to load a CUDA library, and the
//! error that says what was searched when it has none.

use std::{collections::BTreeSet, path::PathBuf, time::Duration};

use anyhow::anyhow;

/// What `attach` waits for: a CUDA library in the tree of `pid`.
pub struct WaitFor {
    pub pid: u32,
    /// Wait at all (`--wait`); otherwise say what was searched.
    pub wait: bool,
    pub timeout: Option<Duration>,
}

/// How often `--wait` looks for a CUDA library to appear.
pub(super) const WAIT_POLL: Duration = Duration::from_millis(10);

/// The error of `attach` without `--wait` when the tree of `cfg.pid`
/// (`processes` live processes) maps no CUDA library: what was searched,
/// and what could not be opened.
pub(super) fn nothing_found(
    cfg: &WaitFor,
    processes: usize,
    searched: &BTreeSet<PathBuf>,
    denied: &BTreeSet<PathBuf>,
) -> anyhow::Error {
    let denied = if denied.is_empty() {
        String::new()
    } else {
        format!(
            "\n{} of them could not be opened (permission denied): tracing another \
             user's process needs CAP_SYS_PTRACE (for /proc/PID/root), and files in \
             directories closed to this process need CAP_DAC_READ_SEARCH.",
            denied.len()
        )
    };
    let list: Vec<String> = searched
        .iter()
        .map(|p| format!("  {}", p.display()))
        .collect();
    anyhow!(
        "pid {} ({} process(es) with descendants) maps no library that defines the CUDA \
         runtime or driver entry points (cudaLaunchKernel, cudaGraphLaunch, \
         cuLaunchKernel) in .dynsym or .symtab; searched {} mapped ELF file(s):\n{}{denied}\n\
         Use --wait to wait for one to be loaded, or --cuda-lib PATH to name one.",
        cfg.pid,
        processes,
        searched.len(),
        list.join("\n")
    )
}
