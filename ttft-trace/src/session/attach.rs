//! `ttft-trace attach --pid PID`: one workload, the target's process tree.

use std::{collections::BTreeSet, path::PathBuf, time::Duration, time::Instant};

use anyhow::{Result, bail};

use super::{Session, Stop, TraceConfig};
use crate::targets;

/// How often `--wait` looks for a CUDA library to appear.
const WAIT_POLL: Duration = Duration::from_millis(10);

pub struct AttachConfig {
    pub pid: u32,
    pub wait: bool,
    pub wait_timeout: Option<Duration>,
    pub cuda_libs: Vec<PathBuf>,
    pub trace: TraceConfig,
}

pub async fn attach(cfg: AttachConfig) -> Result<Stop> {
    if !targets::is_process(cfg.pid) {
        bail!(
            "no process with pid {} (or it is a thread, or a zombie)",
            cfg.pid
        );
    }
    let title = format!(
        "pid {} ({})",
        cfg.pid,
        targets::comm(cfg.pid).unwrap_or_default()
    );
    let (mut s, listener) = Session::start(&cfg.trace, false)?;
    s.add_workload(cfg.pid)?;
    s.attach_named(&cfg.cuda_libs)?;
    s.attach_new_libraries()?;
    // Ports first: with --wait, the first request may be what makes the
    // server load its CUDA library (a lazily started engine process).
    s.follow_ports(&cfg.trace.ports)?;
    if s.probes.attached().next().is_none() {
        s.wait_for_library(&cfg).await?;
    }
    s.run_to_end(listener, &cfg.trace, None, &title).await
}

impl Session {
    /// Blocks (asynchronously) until a CUDA library appears in the tree, the
    /// target exits, or the timeout passes; without `--wait`, explains what
    /// was searched.
    async fn wait_for_library(&mut self, cfg: &AttachConfig) -> Result<()> {
        if !cfg.wait {
            let mut searched = BTreeSet::new();
            let mut denied = BTreeSet::new();
            let mut processes = 0;
            for pid in self.live_processes()? {
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
        let deadline = cfg.wait_timeout.map(|t| Instant::now() + t);
        loop {
            tokio::time::sleep(WAIT_POLL).await;
            if self.live_processes()?.is_empty() {
                bail!("pid {} exited before loading a CUDA library", cfg.pid);
            }
            self.attach_new_libraries()?;
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
