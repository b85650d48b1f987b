//! Recent requests' prefill windows, per workload: what a stall after the first token is
//! checked against for `prefill_interference`. A request's window, the GPU episode that
//! produced its first token (`t_arrive + queue` to `+ gpu`: the GPU running its first step,
//! not its egress after it), is kept when it is judged, that is when it has
//! finished: a stall is compared with the prefills of requests finished before the stalled
//! one (a long request whose prefill fell in the stall but which ends later is not seen).
//! At most [`PER_WORKLOAD`] windows per workload, the oldest evicted and counted.

use std::collections::{HashMap, VecDeque};

use crate::{
    causes::{PrefillOverlap, RequestId},
    requests::RequestRecord,
    signals::{covered_ns, overlap},
};

/// Prefill windows kept per workload.
pub const PER_WORKLOAD: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prefill {
    request: RequestId,
    /// The GPU process of its first token's episode.
    gpu_pid: Option<u32>,
    t_start_ns: u64,
    t_end_ns: u64,
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
    /// Windows evicted because a workload's ring was full, since the start.
    pub evicted: u64,
}

impl Default for Prefills {
    fn default() -> Self {
        Self::new(PER_WORKLOAD)
    }
}

pub fn id_of(r: &RequestRecord) -> RequestId {
    RequestId {
        conn: r.sk,
        request_index: r.request_index,
    }
}

impl Prefills {
    pub fn new(cap: usize) -> Self {
        Self {
            by_root: HashMap::new(),
            cap: cap.max(1),
            evicted: 0,
        }
    }

    /// Keeps `r`'s prefill window (when its GPU work is known) for workload `root`.
    pub fn insert(&mut self, root: u32, r: &RequestRecord) {
        let (Some(queue), Some(gpu)) = (r.queue_ns, r.gpu_ns) else {
            return;
        };
        let ring = self.by_root.entry(root).or_default();
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
        });
    }

    /// Forgets an ended workload.
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
