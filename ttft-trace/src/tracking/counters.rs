//! Turning the kernel's cumulative per-process counters into increments for
//! the Prometheus counters, across processes that come and go.

use std::collections::{BTreeMap, HashMap};

use ttft_trace_common::{GpuCounters, counters::DIRECTIONS};

/// Remembers the last reading of each process.
#[derive(Default)]
pub struct CounterTracker {
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
