//! `attach --wait`: waiting for the target to load a CUDA library, and the
//! error that says what was searched when it has none.

use std::{collections::BTreeSet, time::Duration, time::Instant};

use anyhow::{Result, bail};

use super::Tracking;

/// What `attach` waits for: a CUDA library in the tree of `pid`.
pub struct WaitFor {
    pub pid: u32,
    /// Wait at all (`--wait`); otherwise say what was searched.
    pub wait: bool,
    pub timeout: Option<Duration>,
}

/// How often `--wait` looks for a CUDA library to appear.
const WAIT_POLL: Duration = Duration::from_millis(10);

impl Tracking {
    /// Returns at once when a CUDA library is probed already. Otherwise
    /// blocks (asynchronously) until one appears in the tree, the target
    /// exits, or the timeout passes; without `--wait`, explains what was
    /// searched.
    pub async fn wait_for_library(&mut self, cfg: &WaitFor) -> Result<()> {
        if self.probes.attached().next().is_some() {
            return Ok(());
        }
        if !cfg.wait {
            let mut searched = BTreeSet::new();
            let mut denied = BTreeSet::new();
            let mut processes = 0;
            for (pid, _) in self.live_processes()? {
                processes += 1;
                if let Ok(scan) = self.scanner.scan(pid) {
                    searched.extend(scan.searched);
                    denied.extend(scan.denied);
                }
            }
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
            bail!(
                "pid {} ({} process(es) with descendants) maps no library that defines the CUDA \
                 runtime or driver entry points (cudaLaunchKernel, cudaGraphLaunch, \
                 cuLaunchKernel) in .dynsym or .symtab; searched {} mapped ELF file(s):\n{}{denied}\n\
                 Use --wait to wait for one to be loaded, or --cuda-lib PATH to name one.",
                cfg.pid,
                processes,
                searched.len(),
                list.join("\n")
            );
        }
        log::info!("waiting for pid {} to load a CUDA library", cfg.pid);
        let deadline = cfg.timeout.map(|t| Instant::now() + t);
        loop {
            tokio::time::sleep(WAIT_POLL).await;
            if self.live_processes()?.is_empty() {
                bail!("pid {} exited before loading a CUDA library", cfg.pid);
            }
            self.rescan()?;
            if self.probes.attached().next().is_some() {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                bail!(
                    "no CUDA library appeared in pid {} within the --wait-timeout",
                    cfg.pid
                );
            }
        }
    }
}
