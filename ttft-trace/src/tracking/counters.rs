//! Reading the kernel's counters: turning its cumulative per-process
//! counters into increments for the Prometheus counters, and its
//! scheduler totals into totals that never go back, across processes that
//! come and go.

use std::collections::{BTreeMap, HashMap};

use anyhow::Result;
use ttft_trace_common::{GpuCounters, counters::DIRECTIONS, signals::SchedTotals};

use crate::{host::targets, probes::Probes};

/// What the kernel counted since the last reading.
pub struct KernelReading {
    /// Growth of each process's CUDA counters.
    pub deltas: BTreeMap<u32, GpuCounters>,
    /// Exited processes whose last counters are now read and dropped.
    pub gone: Vec<u32>,
    pub stats: KernelStats,
}

/// The kernel's host-wide statistics.
#[derive(Debug, Default, Clone)]
pub struct KernelStats {
    /// Scheduler totals of every traced process, exited ones included.
    pub sched: SchedTotals,
    /// The run-queue delay histogram (log2 buckets) and its sum.
    pub runq_buckets: Vec<u64>,
    pub runq_sum_ns: u64,
    pub events_lost: u64,
    /// Followed connections read with none of their segments seen.
    pub segments_unseen: u64,
    pub thread_state_dropped: u64,
    /// HTTP/2 frames walked but not summarised (past the cap per call),
    /// and the times a connection's walk lost its place.
    pub h2_frames_dropped: u64,
    pub h2_walk_lost: u64,
    /// `SSL_write` plaintext not bound to a followed connection's send.
    pub tls_unbound: u64,
    /// `SSL_write` calls whose records went to a memory BIO, and of them
    /// the ones whose first record a followed connection's send carried.
    pub tls_held: u64,
    pub tls_held_sent: u64,
    /// Inserts refused by a full kernel map, per map.
    pub map_full: Vec<(&'static str, u64)>,
    /// What tenants were refused past their share, per resource.
    pub quota_exceeded: Vec<(&'static str, u64)>,
    /// Listening pairs followed in the kernel at the last scan.
    pub listeners_followed: usize,
}

/// The last readings of the kernel's per-process counters and scheduler
/// totals.
#[derive(Default)]
pub(super) struct KernelCounters {
    gpu: CounterTracker,
    /// Last scheduler totals read per process still in the kernel's map,
    /// and the sum of those gone from it, so that the exported counters
    /// never go back and the table stays as small as the kernel's map.
    sched_totals: BTreeMap<u32, SchedTotals>,
    sched_gone: SchedTotals,
}

/// One reading of the kernel's per-process CUDA counters.
pub(super) struct GpuReading {
    /// Each process's counters.
    pub reading: BTreeMap<u32, GpuCounters>,
    /// Their growth since the last reading.
    pub deltas: BTreeMap<u32, GpuCounters>,
    /// Exited processes whose last reading this was.
    pub gone: Vec<u32>,
}

/// Whether `tgid` exited: not among the `live` traced processes, and no
/// process at all.
fn exited(tgid: u32, live: &[(u32, u32)]) -> bool {
    !live.iter().any(|(p, _)| *p == tgid) && !targets::is_process(tgid)
}

impl KernelCounters {
    /// Everything the kernel counted since the start.
    pub fn gpu_totals(&self) -> &GpuCounters {
        self.gpu.total()
    }

    /// Reads every process's CUDA counters; the exited processes whose
    /// last reading this was are dropped from the kernel's map.
    pub fn read_gpu(&mut self, probes: &mut Probes, live: &[(u32, u32)]) -> Result<GpuReading> {
        let reading = probes.counters()?;
        let deltas = self.gpu.update(&reading);
        let mut gone = Vec::new();
        for tgid in reading.keys() {
            if exited(*tgid, live) {
                probes.drop_counters(*tgid)?;
                self.gpu.forget(*tgid);
                gone.push(*tgid);
            }
        }
        Ok(GpuReading {
            reading,
            deltas,
            gone,
        })
    }

    /// Reads the scheduler totals: of every traced process, exited ones
    /// included.
    pub fn read_sched(&mut self, probes: &mut Probes, live: &[(u32, u32)]) -> Result<SchedTotals> {
        let now = probes.sched_totals()?;
        self.sched_totals.extend(now.iter().map(|(t, v)| (*t, *v)));
        // An exited process's last reading, or one the kernel's LRU map
        // dropped, joins the sum of those gone; the exited one's entry is
        // dropped from the map too (it would only wait for the LRU).
        let done: Vec<u32> = self
            .sched_totals
            .keys()
            .filter(|t| !now.contains_key(t) || exited(**t, live))
            .copied()
            .collect();
        for tgid in done {
            if let Some(t) = self.sched_totals.remove(&tgid) {
                self.sched_gone.add(&t);
            }
            if now.contains_key(&tgid) {
                probes.drop_sched_totals(tgid)?;
            }
        }
        let mut sched = self.sched_gone;
        for t in self.sched_totals.values() {
            sched.add(t);
        }
        Ok(sched)
    }
}

/// Remembers the last reading of each process.
#[derive(Default)]
struct CounterTracker {
    last: HashMap<u32, GpuCounters>,
    total: GpuCounters,
}

/// Growth of one counter; a smaller reading means the entry was recreated
/// (evicted and re-added), so all of it is new.
fn growth(now: u64, before: u64) -> u64 {
    if now >= before { now - before } else { now }
}

impl CounterTracker {
    /// Takes a reading of every process's counters and returns each one's
    /// growth since the previous reading (processes that did not grow are left out).
    pub fn update(&mut self, reading: &BTreeMap<u32, GpuCounters>) -> BTreeMap<u32, GpuCounters> {
        let mut deltas = BTreeMap::new();
        for (tgid, now) in reading {
            let before = self.last.get(tgid).copied().unwrap_or_default();
            let mut delta = GpuCounters {
                kernel_launches: growth(now.kernel_launches, before.kernel_launches),
                graph_launches: growth(now.graph_launches, before.graph_launches),
                episodes: growth(now.episodes, before.episodes),
                ..GpuCounters::default()
            };
            for i in 0..DIRECTIONS {
                delta.memcpy_calls[i] = growth(now.memcpy_calls[i], before.memcpy_calls[i]);
                delta.memcpy_bytes[i] = growth(now.memcpy_bytes[i], before.memcpy_bytes[i]);
            }
            self.last.insert(*tgid, *now);
            if delta != GpuCounters::default() {
                self.total.add(&delta);
                deltas.insert(*tgid, delta);
            }
        }
        deltas
    }

    /// Forgets a process whose map entry has been removed.
    pub fn forget(&mut self, tgid: u32) {
        self.last.remove(&tgid);
    }

    /// Everything counted since the start.
    pub fn total(&self) -> &GpuCounters {
        &self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(launches: u64, d2h: u64) -> GpuCounters {
        let mut c = GpuCounters {
            kernel_launches: launches,
            ..GpuCounters::default()
        };
        c.memcpy_bytes[2] = d2h;
        c
    }

    #[test]
    fn deltas_across_processes_and_resets() {
        let mut t = CounterTracker::default();
        let d = t.update(&BTreeMap::from([(1, c(10, 100)), (2, c(5, 0))]));
        assert_eq!(d, BTreeMap::from([(1, c(10, 100)), (2, c(5, 0))]));
        let d = t.update(&BTreeMap::from([(1, c(12, 150)), (2, c(5, 0))]));
        assert_eq!(d, BTreeMap::from([(1, c(2, 50))]), "2 did not grow");
        // Process 1's entry was recreated with smaller values.
        let d = t.update(&BTreeMap::from([(1, c(3, 10))]));
        assert_eq!(d, BTreeMap::from([(1, c(3, 10))]));
        // A forgotten process that reappears counts from zero.
        t.forget(2);
        let d = t.update(&BTreeMap::from([(2, c(6, 0))]));
        assert_eq!(d, BTreeMap::from([(2, c(6, 0))]));
        assert_eq!(t.total().kernel_launches, 26);
    }
}
