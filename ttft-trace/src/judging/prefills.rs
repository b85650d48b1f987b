//! Recent requests' prefill windows, per workload: what a stall after the first token is
//! checked against for `prefill_interference`. A request's window, the GPU episode that
//! produced its first token (`t_arrive + queue` to `+ gpu`: the GPU running its first step,
//! not its egress after it), is kept when it is judged, that is when it has
//! finished: a stall is compared with the prefills of requests finished before the stalled
//! one (a long request whose prefill fell in the stall but which ends later is not seen).
//! Windows are kept for [`KEEP_NS`] after they were inserted, as long as the GPU episodes a stall
//! is judged on (`CorrelatorConfig::episode_history_ns`): a stall further back than that has
//! neither. Within it, at most [`PER_WORKLOAD`] windows per workload, the oldest evicted and
//! counted: enough for 2 000 requests a second finishing within the minute (5 MiB at most).

use std::collections::{HashMap, VecDeque};

use crate::{
    causes::{PrefillOverlap, RequestId},
    requests::RequestRecord,
    signals::{covered_ns, overlap},
};

/// Prefill windows kept per workload.
pub const PER_WORKLOAD: usize = 1 << 17;
/// How long a window is kept once inserted (its request judged).
pub const KEEP_NS: u64 = 60_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prefill {
    request: RequestId,
    /// The GPU process of its first token's episode.
    gpu_pid: Option<u32>,
    t_start_ns: u64,
    t_end_ns: u64,
    /// When it was inserted: what [`KEEP_NS`] counts from.
    t_kept_ns: u64,
}

/// What the prefills say about one stall.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlaps {
    /// Union of the overlaps with the stall.
    pub union_ns: u64,
    pub longest: Option<PrefillOverlap>,
    pub count: u32,
}

pub struct Prefills {
    by_root: HashMap<u32, VecDeque<Prefill>>,
    cap: usize,
    keep_ns: u64,
    /// Windows evicted because a workload's ring was full, since the start.
    pub evicted: u64,
}

impl Default for Prefills {
    fn default() -> Self {
        Self::new(PER_WORKLOAD, KEEP_NS)
    }
}

pub fn id_of(r: &RequestRecord) -> RequestId {
    RequestId {
        conn: r.sk,
        request_index: r.request_index,
    }
}

impl Prefills {
    pub fn new(cap: usize, keep_ns: u64) -> Self {
        Self {
            by_root: HashMap::new(),
            cap: cap.max(1),
            keep_ns,
            evicted: 0,
        }
    }

    /// Keeps `r`'s prefill window (when its GPU work is known) for workload `root`, at
    /// `now_ns`; forgets the windows kept longer than [`KEEP_NS`] before it (not counted).
    pub fn insert(&mut self, root: u32, r: &RequestRecord, now_ns: u64) {
        let (Some(queue), Some(gpu)) = (r.queue_ns, r.gpu_ns) else {
            return;
        };
        let ring = self.by_root.entry(root).or_default();
        let horizon = now_ns.saturating_sub(self.keep_ns);
        while ring.front().is_some_and(|p| p.t_kept_ns < horizon) {
            ring.pop_front();
        }
        if ring.len() >= self.cap {
            ring.pop_front();
            self.evicted += 1;
        }
        let start = r.t_arrive_ns.saturating_add(queue);
        ring.push_back(Prefill {
            request: id_of(r),
            gpu_pid: r.gpu_pid,
            t_start_ns: start,
            t_end_ns: start.saturating_add(gpu),
            t_kept_ns: now_ns,
        });
    }

    /// Forgets an ended workload.
    /// Workloads with prefill windows kept.
    pub fn workloads(&self) -> usize {
        self.by_root.len()
    }

    pub fn forget(&mut self, root: u32) {
        self.by_root.remove(&root);
    }

    /// Other requests' prefills over `[a, b]` on workload `root`, `r` excluded, and only
    /// those of `r`'s GPU process when both are known.
    pub fn overlapping(&self, root: u32, r: &RequestRecord, a: u64, b: u64) -> Overlaps {
        let mut out = Overlaps::default();
        let Some(ring) = self.by_root.get(&root) else {
            return out;
        };
        let me = id_of(r);
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for p in ring {
            let same_gpu = match (p.gpu_pid, r.gpu_pid) {
                (Some(x), Some(y)) => x == y,
                _ => true,
            };
            let o = overlap(p.t_start_ns, p.t_end_ns, a, b);
            if p.request == me || !same_gpu || o == 0 {
                continue;
            }
            out.count += 1;
            if out.longest.is_none_or(|l| o > l.overlap_ns) {
                out.longest = Some(PrefillOverlap {
                    request: p.request,
                    overlap_ns: o,
                });
            }
            spans.push((p.t_start_ns.max(a), p.t_end_ns.min(b)));
        }
        out.union_ns = covered_ns(&mut spans, a);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        report::tests::{MS, T0, record},
        requests::Outcome,
    };

    fn nth(i: u32) -> RequestRecord {
        RequestRecord {
            request_index: i,
            ..record(Outcome::Ok)
        }
    }

    /// The prefills over `[T0, T0 + 10 ms]` seen by a request of another connection.
    fn seen(p: &Prefills) -> u32 {
        let other = RequestRecord {
            sk: 0xdef,
            ..record(Outcome::Ok)
        };
        p.overlapping(1, &other, T0, T0 + 10 * MS).count
    }

    /// Windows kept past the horizon are forgotten without a count; a full ring within
    /// it drops its oldest and counts it.
    #[test]
    fn old_windows_go_uncounted_a_full_ring_counts() {
        let mut p = Prefills::new(3, 1_000 * MS);
        for i in 0..3 {
            p.insert(1, &nth(i), T0);
        }
        assert_eq!((seen(&p), p.evicted), (3, 0));
        // Within the horizon, full: the oldest goes and is counted.
        p.insert(1, &nth(3), T0 + 500 * MS);
        assert_eq!((seen(&p), p.evicted), (3, 1));
        // Past it: the three of T0 are forgotten, not counted.
        p.insert(1, &nth(4), T0 + 1_200 * MS);
        assert_eq!((seen(&p), p.evicted), (2, 1));
        // A record without its GPU work keeps nothing.
        let unknown = RequestRecord {
            gpu_ns: None,
            ..nth(5)
        };
        p.insert(1, &unknown, T0 + 1_200 * MS);
        assert_eq!((seen(&p), p.evicted), (2, 1));
    }
}
