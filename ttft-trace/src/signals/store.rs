//! Recent scheduler intervals, TCP trouble and large copies, kept so that
//! each finished request can be asked "what happened inside your window".

use std::collections::{HashMap, VecDeque};

use ttft_trace_common::Direction;
use ttft_trace_common::signals::{
    CopyEvent, SCHED_BLOCKED, SCHED_ONCPU, SCHED_RUNQ, SchedEvent, TcpEvent,
};

use super::intervals::Intervals;

/// How much history is kept: requests are finished at most this long after
/// their arrival and still see their signals (longer streams lose them).
pub const KEEP_NS: u64 = 300_000_000_000;
/// Caps, whatever the rate: the oldest entries go first.
const MAX_SCHED: usize = 1 << 20;
const MAX_COPIES: usize = 1 << 16;
const MAX_TCP_PER_CONN: usize = 4096;

/// Overlap of `[s, e]` with `[a, b]`, in ns.
pub fn overlap(s: u64, e: u64, a: u64, b: u64) -> u64 {
    e.min(b).saturating_sub(s.max(a))
}

/// Time covered by the union of `spans` (each `[s, e]`, clipped to the window by the
/// caller) from `start` on; sorts them.
pub fn covered_ns(spans: &mut [(u64, u64)], start: u64) -> u64 {
    spans.sort_unstable();
    let mut covered = 0;
    let mut reach = start;
    for &(a, b) in spans.iter() {
        let a = a.max(reach);
        if b > a {
            covered += b - a;
            reach = b;
        }
    }
    covered
}

/// Totals of one kind of scheduler interval inside a window.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Overlap {
    pub total_ns: u64,
    pub max_ns: u64,
}

/// Large copies inside a window.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Copies {
    pub count: u32,
    pub bytes: u64,
    /// Host to device (loading, swapping in) and device to host (swapping out).
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    /// First to last copy call in the window.
    pub span_ns: u64,
}

pub struct SignalStore {
    sched: Intervals,
    tcp: HashMap<u64, VecDeque<TcpEvent>>,
    /// Ordered by `t_ns`.
    copies: VecDeque<CopyEvent>,
    /// First traced GPU episode (its first launch) per process.
    first_episode: HashMap<u32, u64>,
    /// Threads that launched GPU episodes, with their process.
    gpu_threads: HashMap<u32, u32>,
}

impl Default for SignalStore {
    fn default() -> Self {
        Self {
            sched: Intervals::new(MAX_SCHED),
            tcp: HashMap::new(),
            copies: VecDeque::new(),
            first_episode: HashMap::new(),
            gpu_threads: HashMap::new(),
        }
    }
}

impl SignalStore {
    pub fn on_sched(&mut self, ev: &SchedEvent) {
        self.sched.insert(*ev);
    }

    pub fn on_tcp(&mut self, ev: &TcpEvent) {
        let q = self.tcp.entry(ev.sk).or_default();
        q.push_back(*ev);
        if q.len() > MAX_TCP_PER_CONN {
            q.pop_front();
        }
    }

    pub fn on_copy(&mut self, ev: &CopyEvent) {
        // In place by time, so that a window is found by bisection.
        super::insert_ordered(&mut self.copies, *ev, |e| e.t_ns);
        if self.copies.len() > MAX_COPIES {
            self.copies.pop_front();
        }
    }

    /// Notes an episode; the first one of each process marks its cold start.
    pub fn on_episode(&mut self, tgid: u32, tid: u32, t_first_launch_ns: u64) {
        self.gpu_threads.insert(tid, tgid);
        let first = self.first_episode.entry(tgid).or_insert(t_first_launch_ns);
        *first = (*first).min(t_first_launch_ns);
    }

    pub fn first_episode(&self, tgid: u32) -> Option<u64> {
        self.first_episode.get(&tgid).copied()
    }

    /// Forgets what is older than [`KEEP_NS`] before `now`, and the
    /// connections and processes that are gone.
    pub fn prune(&mut self, now_ns: u64) {
        let horizon = now_ns.saturating_sub(KEEP_NS);
        self.sched.prune(horizon);
        while self.copies.front().is_some_and(|e| e.t_ns < horizon) {
            self.copies.pop_front();
        }
        self.tcp.retain(|_, q| {
            while q.front().is_some_and(|e| e.t_ns < horizon) {
                q.pop_front();
            }
            !q.is_empty()
        });
    }

    /// Forgets a process that exited (its threads' ids may be reused).
    pub fn forget_process(&mut self, tgid: u32) {
        self.retain_processes(|p| p != tgid);
    }

    /// Keeps the per-process entries (first episode, GPU threads) of the
    /// processes `keep` accepts: bounds them by the live processes.
    pub fn retain_processes(&mut self, keep: impl Fn(u32) -> bool) {
        self.first_episode.retain(|p, _| keep(*p));
        self.gpu_threads.retain(|_, p| keep(*p));
    }

    /// Intervals of kind `what` overlapping `[a, b]` that `keep` accepts.
    pub fn sched_in(
        &self,
        what: u32,
        a: u64,
        b: u64,
        keep: impl Fn(&SchedEvent) -> bool,
    ) -> Overlap {
        let mut out = Overlap::default();
        self.sched.for_each_overlapping(a, b, |e| {
            if e.what == what && keep(e) {
                let o = overlap(e.t_start_ns, e.t_end_ns, a, b);
                out.total_ns += o;
                out.max_ns = out.max_ns.max(o);
            }
        });
        out
    }

    pub fn runq_in(&self, a: u64, b: u64, keep: impl Fn(&SchedEvent) -> bool) -> Overlap {
        self.sched_in(SCHED_RUNQ, a, b, keep)
    }

    pub fn oncpu_in(&self, a: u64, b: u64, keep: impl Fn(&SchedEvent) -> bool) -> Overlap {
        self.sched_in(SCHED_ONCPU, a, b, keep)
    }

    pub fn blocked_in(&self, a: u64, b: u64, keep: impl Fn(&SchedEvent) -> bool) -> Overlap {
        self.sched_in(SCHED_BLOCKED, a, b, keep)
    }

    /// TCP events on connection `sk` inside `[a, b]`.
    pub fn tcp_events_in(&self, sk: u64, a: u64, b: u64) -> impl Iterator<Item = &TcpEvent> {
        self.tcp
            .get(&sk)
            .into_iter()
            .flatten()
            .filter(move |e| e.t_ns >= a && e.t_ns <= b)
    }

    /// The largest overlap with `[a, b]` of one thread's intervals of kind
    /// `what` (summed per thread), among the threads `keep` accepts.
    pub fn max_thread_overlap(
        &self,
        what: u32,
        a: u64,
        b: u64,
        keep: impl Fn(&SchedEvent) -> bool,
    ) -> u64 {
        self.max_thread_total(a, b, |e| e.what == what && keep(e))
    }

    /// The largest overlap with `[a, b]` of one thread's intervals of any
    /// kind `keep` accepts (summed per thread).
    pub fn max_thread_total(&self, a: u64, b: u64, keep: impl Fn(&SchedEvent) -> bool) -> u64 {
        let mut per_thread: HashMap<u32, u64> = HashMap::new();
        self.sched.for_each_overlapping(a, b, |e| {
            if keep(e) {
                *per_thread.entry(e.tid).or_default() += overlap(e.t_start_ns, e.t_end_ns, a, b);
            }
        });
        per_thread.values().copied().max().unwrap_or(0)
    }

    /// Whether `tid` has launched GPU work (a GPU-launching thread).
    pub fn is_gpu_thread(&self, tid: u32) -> bool {
        self.gpu_threads.contains_key(&tid)
    }

    /// Large copies of any traced process inside `[a, b]`.
    pub fn copies_in(&self, a: u64, b: u64) -> Copies {
        let mut out = Copies::default();
        let (mut first, mut last) = (u64::MAX, 0);
        let from = self.copies.partition_point(|e| e.t_ns < a);
        for e in self.copies.range(from..).take_while(|e| e.t_ns <= b) {
            out.count += 1;
            out.bytes += e.bytes;
            if e.direction == Direction::HostToDevice as u32 {
                out.h2d_bytes += e.bytes;
            } else if e.direction == Direction::DeviceToHost as u32 {
                out.d2h_bytes += e.bytes;
            }
            first = first.min(e.t_ns);
            last = last.max(e.t_ns);
        }
        if out.count > 0 {
            out.span_ns = last - first;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ttft_trace_common::signals::{
        EVENT_COPY, EVENT_SCHED, EVENT_TCP, TCP_RESET_SENT, TCP_RETRANSMIT,
    };

    fn sched(what: u32, tid: u32, s: u64, e: u64) -> SchedEvent {
        SchedEvent {
            kind: EVENT_SCHED,
            what,
            tgid: 1,
            tid,
            t_start_ns: s,
            t_end_ns: e,
        }
    }

    #[test]
    fn overlaps_are_clipped_to_the_window() {
        let mut st = SignalStore::default();
        st.on_sched(&sched(SCHED_RUNQ, 10, 0, 100));
        st.on_sched(&sched(SCHED_RUNQ, 11, 150, 400));
        st.on_sched(&sched(SCHED_RUNQ, 10, 500, 600));
        // Out of order arrival still lands in place.
        st.on_sched(&sched(SCHED_ONCPU, 12, 90, 300));
        let r = st.runq_in(50, 200, |_| true);
        assert_eq!(
            r,
            Overlap {
                total_ns: 50 + 50,
                max_ns: 50
            }
        );
        let r = st.runq_in(50, 200, |e| e.tid != 11);
        assert_eq!(r.total_ns, 50);
        assert_eq!(st.oncpu_in(0, 1000, |_| true).total_ns, 210);
        assert_eq!(st.blocked_in(0, 1000, |_| true).total_ns, 0);
        assert_eq!(st.runq_in(200, 200, |_| true).total_ns, 0, "empty window");
    }

    #[test]
    fn per_thread_maximum() {
        let mut st = SignalStore::default();
        st.on_sched(&sched(SCHED_BLOCKED, 1, 0, 100));
        st.on_sched(&sched(SCHED_BLOCKED, 1, 150, 200));
        st.on_sched(&sched(SCHED_BLOCKED, 2, 0, 120));
        assert_eq!(st.max_thread_overlap(SCHED_BLOCKED, 0, 200, |_| true), 150);
        assert_eq!(
            st.max_thread_overlap(SCHED_BLOCKED, 0, 200, |e| e.tid == 2),
            120
        );
        assert_eq!(st.max_thread_overlap(SCHED_RUNQ, 0, 200, |_| true), 0);
    }

    #[test]
    fn a_long_interval_ending_after_the_window_counts() {
        let mut st = SignalStore::default();
        st.on_sched(&sched(SCHED_BLOCKED, 1, 0, 10_000));
        for i in 0..100 {
            st.on_sched(&sched(SCHED_RUNQ, 2, 100 + i, 101 + i));
        }
        assert_eq!(st.blocked_in(500, 600, |_| true).total_ns, 100);
    }

    #[test]
    fn tcp_and_copies_in_windows() {
        let mut st = SignalStore::default();
        for (t, what) in [
            (10, TCP_RETRANSMIT),
            (20, TCP_RETRANSMIT),
            (30, TCP_RESET_SENT),
            (90, TCP_RETRANSMIT),
        ] {
            st.on_tcp(&TcpEvent {
                kind: EVENT_TCP,
                what,
                sk: 7,
                t_ns: t,
            });
        }
        let times: Vec<(u32, u64)> = st
            .tcp_events_in(7, 0, 50)
            .map(|e| (e.what, e.t_ns))
            .collect();
        assert_eq!(
            times,
            vec![
                (TCP_RETRANSMIT, 10),
                (TCP_RETRANSMIT, 20),
                (TCP_RESET_SENT, 30)
            ]
        );
        assert_eq!(st.tcp_events_in(8, 0, 50).count(), 0);
        for t in [100, 200, 300] {
            st.on_copy(&CopyEvent {
                kind: EVENT_COPY,
                bytes: 1 << 23,
                t_ns: t,
                direction: Direction::HostToDevice as u32,
                ..CopyEvent::default()
            });
        }
        let c = st.copies_in(150, 300);
        assert_eq!(
            (c.count, c.bytes, c.h2d_bytes, c.d2h_bytes, c.span_ns),
            (2, 2 << 23, 2 << 23, 0, 100)
        );
    }

    #[test]
    fn pruning_and_first_episodes() {
        let mut st = SignalStore::default();
        st.on_sched(&sched(SCHED_RUNQ, 1, 0, 10));
        st.on_tcp(&TcpEvent {
            kind: EVENT_TCP,
            what: TCP_RETRANSMIT,
            sk: 1,
            t_ns: 5,
        });
        st.on_episode(3, 30, 500);
        st.on_episode(3, 30, 400);
        assert_eq!(st.first_episode(3), Some(400));
        assert!(st.is_gpu_thread(30) && !st.is_gpu_thread(3));
        st.prune(KEEP_NS + 100);
        assert_eq!(st.runq_in(0, 100, |_| true).total_ns, 0);
        assert_eq!(st.tcp_events_in(1, 0, 100).count(), 0);
        st.forget_process(3);
        assert_eq!(st.first_episode(3), None);
        assert!(!st.is_gpu_thread(30));
    }
}
