//! The quota items of `ttft-trace check`: each workload's configured share
//! of the host-wide resources, and the workloads (pod, else cgroup: a
//! [`Tenant`]) that hold more than a share now. The decision is the
//! daemon's own ([`Quota::past`]); what a workload holds is read here from
//! /proc, for the processes that map a CUDA library (by name: `check` does
//! not read ELF files).

use std::collections::BTreeMap;

use super::Item;
use crate::{
    config::Quotas as Shares,
    host::{ports, rootfs, targets},
    workloads::{
        discover,
        quota::{Quota, Resource, Tenant},
    },
};

/// Most of `/proc/PID/maps` read (as the daemon's scan).
const MAPS_MAX: u64 = 16 << 20;

/// What one tenant's CUDA processes hold now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holding {
    pub processes: usize,
    /// Their threads (each a `TRACKED` entry once forked while traced, and
    /// a sampled thread under `sched = "sampled"`).
    pub threads: usize,
    /// (network namespace, port) pairs they listen on.
    pub listeners: usize,
}

/// The items: the shares, then each tenant past one (a warning: tracing
/// works, that workload is degraded), else that none is.
pub fn items(shares: &Shares, holdings: &BTreeMap<Tenant, Holding>) -> Vec<Item> {
    let quotas: [Quota<Tenant>; 3] = [
        Quota::new(Resource::Listeners, shares.listeners),
        Quota::new(Resource::Threads, shares.threads),
        Quota::new(Resource::SampledThreads, shares.sampled_threads),
    ];
    let mut described: Vec<String> = quotas
        .iter()
        .map(|q| format!("{} {}", q.share(), q.resource().name().replace('_', " ")))
        .collect();
    // Not seen by `check`: the daemon's OTLP metrics count them.
    described.push(format!(
        "{} OTLP attribute sets",
        shares.otlp_attribute_sets
    ));
    let mut items = vec![Item::ok(
        "quotas",
        format!(
            "each workload (pod, else cgroup) holds at most: {}",
            described.join(", ")
        ),
    )];
    for (tenant, held) in holdings {
        for q in &quotas {
            let r = q.resource();
            let n = match r {
                Resource::Listeners => held.listeners,
                _ => held.threads,
            };
            let past = q.past(n);
            if past == 0 {
                continue;
            }
            items.push(Item::warn(
                format!("quota {}", r.name()),
                format!(
                    "{tenant} holds {n} {} now, {past} past its share of {}: traced, {}",
                    r.name().replace('_', " "),
                    q.share(),
                    r.consequence()
                ),
                format!(
                    "none needed if that is meant; else raise [quotas] {} in the daemon's \
                     settings (a bigger share for every workload)",
                    match r {
                        Resource::Listeners => "listeners",
                        Resource::Threads => "threads",
                        _ => "sampled_threads",
                    }
                ),
            ));
        }
    }
    if items.len() == 1 {
        let processes: usize = holdings.values().map(|h| h.processes).sum();
        items.push(Item::ok(
            "quota use",
            format!(
                "{} workload(s) seen now ({processes} CUDA process(es)), none past a share",
                holdings.len()
            ),
        ));
    }
    items
}

/// Whether `maps` (a `/proc/PID/maps` text) names a CUDA runtime or
/// driver library.
pub fn maps_cuda(maps: &str) -> bool {
    maps.lines().any(|l| {
        let name = l.rsplit('/').next().unwrap_or_default();
        name.starts_with("libcudart") || name.starts_with("libcuda.so")
    })
}

/// What each tenant's CUDA processes hold now.
pub fn read_holdings() -> BTreeMap<Tenant, Holding> {
    let mut pids: BTreeMap<Tenant, Vec<u32>> = BTreeMap::new();
    let mut holdings: BTreeMap<Tenant, Holding> = BTreeMap::new();
    for pid in discover::processes() {
        let path = std::path::PathBuf::from(format!("/proc/{pid}/maps"));
        let Ok(maps) = rootfs::read_proc(&path, MAPS_MAX) else {
            continue;
        };
        if !maps_cuda(&String::from_utf8_lossy(&maps)) {
            continue;
        }
        let Some(tenant) = Tenant::of_process(pid) else {
            continue;
        };
        let threads = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| targets::status_field(&s, "Threads:"))
            .unwrap_or(1);
        let h = holdings.entry(tenant.clone()).or_default();
        h.processes += 1;
        h.threads += threads as usize;
        pids.entry(tenant).or_default().push(pid);
    }
    for (tenant, pids) in pids {
        let pairs: std::collections::BTreeSet<(Option<u32>, u16)> = ports::listening_sockets(&pids)
            .into_iter()
            .map(|l| (l.netns, l.port))
            .collect();
        if let Some(h) = holdings.get_mut(&tenant) {
            h.listeners = pairs.len();
        }
    }
    holdings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Verdict;

    #[test]
    fn names_each_workload_past_a_share_and_only_those() {
        let shares = Shares {
            listeners: 10,
            threads: 100,
            sampled_threads: 50,
            otlp_attribute_sets: 5,
        };
        let pod = Tenant::Pod("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9".into());
        let other = Tenant::Cgroup("/system.slice/other.service".into());
        let mut holdings = BTreeMap::from([
            (
                pod.clone(),
                Holding {
                    processes: 2,
                    threads: 60,
                    listeners: 12,
                },
            ),
            (
                other.clone(),
                Holding {
                    processes: 1,
                    threads: 50,
                    listeners: 10,
                },
            ),
        ]);
        let got = items(&shares, &holdings);
        assert_eq!(got[0].verdict, Verdict::Ok);
        assert_eq!(
            got[0].detail,
            "each workload (pod, else cgroup) holds at most: 10 listeners, 100 threads, \
             50 sampled threads, 5 OTLP attribute sets"
        );
        let past: Vec<(&str, &str)> = got[1..]
            .iter()
            .map(|i| (i.name.as_str(), i.detail.as_str()))
            .collect();
        assert_eq!(past.len(), 2, "{past:?}");
        assert_eq!(past[0].0, "quota listeners");
        assert!(
            past[0].1.starts_with(&format!(
                "{pod} holds 12 listeners now, 2 past its share of 10: traced, its further"
            )),
            "{}",
            past[0].1
        );
        assert_eq!(past[1].0, "quota sampled_threads");
        assert!(
            past[1]
                .1
                .contains("60 sampled threads now, 10 past its share of 50")
        );
        assert!(got.iter().all(|i| !i.detail.contains(&other.to_string())));
        assert!(got[1..].iter().all(|i| i.verdict == Verdict::Warn));

        // At its share is not past it.
        holdings.remove(&pod);
        let got = items(&shares, &holdings);
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[1].detail,
            "1 workload(s) seen now (1 CUDA process(es)), none past a share"
        );
    }

    #[test]
    fn a_cuda_process_is_one_that_maps_the_runtime_or_the_driver() {
        let line = |p: &str| format!("7f00-7f10 r-xp 00000000 08:01 42 {p}\n");
        assert!(maps_cuda(&line(
            "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54"
        )));
        assert!(maps_cuda(&line(
            "/opt/venv/nvidia/lib/libcudart-4e0b8a1f.so.12"
        )));
        assert!(!maps_cuda(&line("/usr/lib/libcudnn.so.9")));
        assert!(!maps_cuda(&line("/usr/lib/libc.so.6")));
    }

    #[test]
    fn reads_this_hosts_holdings() {
        // Whatever runs here: each tenant has a process per entry.
        for h in read_holdings().values() {
            assert!(h.processes > 0 && h.threads >= h.processes);
        }
    }
}
