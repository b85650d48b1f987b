//! Finding workloads on the host: processes that map a CUDA library, the
//! filters that select among them, and the process at the root of each
//! workload (so that an API server and its GPU workers are one workload).

use std::{
    collections::{BTreeSet, HashSet},
    fs,
};

use regex::Regex;

use crate::host::cgroups;
use crate::host::targets;

/// Which processes the daemon traces (each filter off when unset).
#[derive(Debug, Clone, Default)]
pub struct Filters {
    /// On the command name of the process that maps the CUDA library.
    pub comm: Option<Regex>,
    /// On the cgroup path of that process.
    pub cgroup_prefix: Option<String>,
    /// The workload must listen on one of these ports.
    pub ports: Vec<u16>,
}

impl Filters {
    /// Why `pid` is not to be traced by the comm and cgroup filters, or
    /// None when it passes.
    pub fn reject_process(&self, pid: u32) -> Option<String> {
        if let Some(re) = &self.comm {
            let comm = targets::comm(pid).unwrap_or_default();
            if !re.is_match(&comm) {
                return Some(format!("comm {comm:?} does not match {}", re.as_str()));
            }
        }
        if let Some(prefix) = &self.cgroup_prefix {
            let path = cgroups::cgroup_path(pid).unwrap_or_default();
            if !path.starts_with(prefix.as_str()) {
                return Some(format!("cgroup {path:?} is not under {prefix:?}"));
            }
        }
        None
    }

    /// Whether a workload listening on `ports` passes the port filter.
    /// Whether a workload listening on `ports` ((namespace, port), as
    /// [`crate::host::ports::listening_ports`] gives them) is one to trace.
    pub fn accepts_ports(&self, ports: &BTreeSet<(Option<u32>, u16)>) -> bool {
        self.ports.is_empty() || ports.iter().any(|(_, p)| self.ports.contains(p))
    }
}

/// Every process id in /proc (thread group leaders only: /proc lists no
/// threads at its top level).
pub fn processes() -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// `pid` and its ancestors: none of them is ever a workload's root (the
/// daemon's own parent may be a test harness or a shell).
pub fn self_and_ancestors() -> HashSet<u32> {
    let mut out = HashSet::new();
    let mut pid = std::process::id();
    while pid > 1 && out.insert(pid) {
        match targets::parent(pid) {
            Some(p) => pid = p,
            None => break,
        }
    }
    out
}

/// The root of the workload `pid` belongs to: the topmost ancestor in the
/// same cgroup (same container or service) that is itself part of the
/// serving stack, i.e. `is_server(ancestor)` (maps a CUDA library or
/// listens on TCP). An inference server's front end (which receives the
/// requests) and its GPU workers are then one workload, while a shell or
/// supervisor above them is not. Never pid 1 or one of `excluded`.
pub fn workload_root(
    pid: u32,
    excluded: &HashSet<u32>,
    mut is_server: impl FnMut(u32) -> bool,
) -> u32 {
    let cgroup = cgroups::cgroup_path(pid);
    let mut root = pid;
    let mut at = pid;
    let mut steps = 0;
    while let Some(parent) = targets::parent(at) {
        steps += 1;
        if parent <= 1 || excluded.contains(&parent) || steps > 64 {
            break;
        }
        if cgroups::cgroup_path(parent) != cgroup {
            break;
        }
        if is_server(parent) {
            root = parent;
        }
        at = parent;
    }
    root
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_by_comm_cgroup_and_port() {
        let me = std::process::id();
        let comm = targets::comm(me).expect("comm");
        let pass = Filters {
            comm: Some(Regex::new(&format!("^{}$", regex::escape(&comm))).expect("re")),
            cgroup_prefix: Some("/".into()),
            ports: vec![],
        };
        assert_eq!(pass.reject_process(me), None);
        let other = Filters {
            comm: Some(Regex::new("^no-such-server$").expect("re")),
            ..Filters::default()
        };
        assert!(
            other
                .reject_process(me)
                .expect("rejected")
                .contains("does not match")
        );
        let cg = Filters {
            cgroup_prefix: Some("/kubepods-nowhere".into()),
            ..Filters::default()
        };
        assert!(
            cg.reject_process(me)
                .expect("rejected")
                .contains("not under")
        );
        let ports = Filters {
            ports: vec![8000],
            ..Filters::default()
        };
        assert!(ports.accepts_ports(&BTreeSet::from([(Some(1), 8000), (None, 9000)])));
        assert!(!ports.accepts_ports(&BTreeSet::from([(Some(1), 9000)])));
        assert!(Filters::default().accepts_ports(&BTreeSet::new()));
    }

    #[test]
    fn root_is_the_topmost_server_ancestor() {
        // sh (server) -> sleep: sleep's root is sh when sh counts as a
        // server, itself otherwise; our own process is never a root.
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 5 & wait"])
            .spawn()
            .expect("spawn sh");
        let shell = sh.id();
        let mut sleeper = None;
        for _ in 0..100 {
            sleeper = targets::descendants(shell).first().copied();
            if sleeper.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let sleeper = sleeper.expect("sleep started");
        let excluded = self_and_ancestors();
        let as_server = workload_root(sleeper, &excluded, |p| p == shell);
        let alone = workload_root(sleeper, &excluded, |_| false);
        let everything = workload_root(sleeper, &excluded, |_| true);
        let listed = processes().contains(&shell);
        let _ = sh.kill();
        let _ = sh.wait();
        assert_eq!(as_server, shell);
        assert_eq!(alone, sleeper);
        assert_eq!(everything, shell, "stops below our own process");
        assert!(excluded.contains(&std::process::id()));
        assert!(listed);
    }
}
