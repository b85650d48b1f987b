//! Scheduler intervals indexed so that "which intervals overlap `[a, b]`"
//! costs what overlaps, not the whole history.
//!
//! Intervals are kept ordered by their end. Those overlapping `[a, b]` end
//! after `a`, and start before `b`: with the end ordered, a scan from `a`
//! must go on past `b` by the longest interval that could still start
//! before `b`. One list bounded by the longest interval ever seen makes
//! every query scan everything since `a` plus that much: one thread blocked
//! for 30 s (an idle pool thread, a server between loads) made each request
//! scan 30 s of the host's context switches, and the tracer fell behind its
//! ring buffer at 10 000 connections.
//!
//! So the intervals are split by length into classes of powers of two, each
//! ordered by end and scanned past `b` only by its own longest. A thread's
//! intervals do not overlap one another, so in a class of lengths from `L`
//! to `2L` a thread has at most `(b - a) / L + 3` intervals ending in
//! `(a, b + 2L]`: the scan is bounded by what overlaps the window plus a few
//! per thread and class.

use std::collections::VecDeque;

use ttft_trace_common::signals::SchedEvent;

/// Intervals shorter than `2^MIN_BITS` ns share the first class.
const MIN_BITS: u32 = 14;
/// Classes: the last holds every interval from `2^(MIN_BITS + CLASSES - 2)`
/// ns (about 9 minutes) up.
const CLASSES: usize = 26;

struct Class {
    /// Ordered by `t_end_ns` (events arrive nearly in that order; inserted
    /// in place when not).
    events: VecDeque<SchedEvent>,
    /// The longest interval this class has held: how far past a window's
    /// end a scan must go.
    longest_ns: u64,
}

/// Scheduler intervals by length class; at most `cap` in all (the oldest
/// end goes first).
pub struct Intervals {
    classes: Vec<Class>,
    len: usize,
    cap: usize,
}

fn class_of(len_ns: u64) -> usize {
    let bits = u64::BITS - len_ns.leading_zeros();
    (bits.saturating_sub(MIN_BITS) as usize).min(CLASSES - 1)
}

impl Intervals {
    pub fn new(cap: usize) -> Self {
        Self {
            classes: (0..CLASSES)
                .map(|_| Class {
                    events: VecDeque::new(),
                    longest_ns: 0,
                })
                .collect(),
            len: 0,
            cap,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn insert(&mut self, ev: SchedEvent) {
        let len_ns = ev.t_end_ns.saturating_sub(ev.t_start_ns);
        let class = &mut self.classes[class_of(len_ns)];
        class.longest_ns = class.longest_ns.max(len_ns);
        super::insert_ordered(&mut class.events, ev, |e| e.t_end_ns);
        self.len += 1;
        if self.len > self.cap {
            self.pop_oldest();
        }
    }

    /// Forgets the intervals that ended before `horizon`.
    pub fn prune(&mut self, horizon: u64) {
        for class in &mut self.classes {
            while class.events.front().is_some_and(|e| e.t_end_ns < horizon) {
                class.events.pop_front();
                self.len -= 1;
            }
        }
    }

    fn pop_oldest(&mut self) {
        let oldest = self
            .classes
            .iter_mut()
            .filter(|c| !c.events.is_empty())
            .min_by_key(|c| c.events.front().map_or(u64::MAX, |e| e.t_end_ns));
        if let Some(class) = oldest {
            class.events.pop_front();
            self.len -= 1;
        }
    }

    /// Calls `f` with every interval that overlaps `[a, b]` by more than
    /// nothing (ends after `a`, starts before `b`), class by class.
    pub fn for_each_overlapping(&self, a: u64, b: u64, mut f: impl FnMut(&SchedEvent)) {
        if b <= a {
            return;
        }
        for class in &self.classes {
            let until = b.saturating_add(class.longest_ns);
            let from = class.events.partition_point(|e| e.t_end_ns <= a);
            for e in class.events.range(from..) {
                if e.t_end_ns > until {
                    break;
                }
                if e.t_start_ns < b {
                    f(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ttft_trace_common::signals::{EVENT_SCHED, SCHED_ONCPU};

    fn iv(tid: u32, s: u64, e: u64) -> SchedEvent {
        SchedEvent {
            kind: EVENT_SCHED,
            what: SCHED_ONCPU,
            tgid: 1,
            tid,
            t_start_ns: s,
            t_end_ns: e,
        }
    }

    /// A small deterministic generator: no test depends on a seed file.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, below: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % below
        }
    }

    fn overlapping(ivs: &Intervals, a: u64, b: u64) -> Vec<(u32, u64, u64)> {
        let mut got = Vec::new();
        ivs.for_each_overlapping(a, b, |e| got.push((e.tid, e.t_start_ns, e.t_end_ns)));
        got.sort_unstable();
        got
    }

    #[test]
    fn classes_cover_every_length() {
        assert_eq!(class_of(0), 0);
        assert_eq!(class_of((1 << MIN_BITS) - 1), 0);
        assert_eq!(class_of(1 << MIN_BITS), 1);
        assert_eq!(class_of(u64::MAX), CLASSES - 1);
    }

    #[test]
    fn finds_exactly_what_a_full_scan_finds() {
        let mut rng = Lcg(7);
        let mut ivs = Intervals::new(usize::MAX);
        let mut all = Vec::new();
        // Eight threads, each a run of back-to-back intervals of lengths
        // from nanoseconds to seconds, arriving slightly out of order.
        for tid in 0..8u32 {
            let mut t = rng.next(1_000);
            for _ in 0..400 {
                let bits = 4 + rng.next(28);
                let len = 1 + rng.next(1 << bits);
                all.push(iv(tid, t, t + len));
                t += len + rng.next(1_000);
            }
        }
        for ev in &all {
            ivs.insert(*ev);
        }
        assert_eq!(ivs.len(), all.len());
        let end = all.iter().map(|e| e.t_end_ns).max().unwrap_or(0);
        for _ in 0..500 {
            let a = rng.next(end);
            let bits = rng.next(34);
            let b = a + 1 + rng.next(1 << bits);
            let mut want: Vec<_> = all
                .iter()
                .filter(|e| e.t_end_ns > a && e.t_start_ns < b)
                .map(|e| (e.tid, e.t_start_ns, e.t_end_ns))
                .collect();
            want.sort_unstable();
            assert_eq!(overlapping(&ivs, a, b), want, "window [{a}, {b}]");
        }
    }

    #[test]
    fn a_long_interval_is_found_without_scanning_the_short_ones_after_it() {
        let mut ivs = Intervals::new(usize::MAX);
        // One thread blocked for 30 s, another switching every 10 µs.
        ivs.insert(iv(1, 0, 30_000_000_000));
        for i in 0..100_000u64 {
            ivs.insert(iv(2, i * 10_000, i * 10_000 + 5_000));
        }
        let mut scanned = 0;
        ivs.for_each_overlapping(500_000_000, 500_050_000, |_| scanned += 1);
        // The long one and the five short ones inside the window.
        assert_eq!(scanned, 6);
    }

    #[test]
    fn the_cap_drops_the_oldest_end_and_pruning_the_ended() {
        let mut ivs = Intervals::new(3);
        ivs.insert(iv(1, 0, 10));
        ivs.insert(iv(1, 0, 1 << 20));
        ivs.insert(iv(2, 5, 20));
        ivs.insert(iv(2, 20, 30));
        assert_eq!(ivs.len(), 3);
        assert_eq!(overlapping(&ivs, 0, 11), vec![(1, 0, 1 << 20), (2, 5, 20)]);
        ivs.prune(25);
        assert_eq!(
            overlapping(&ivs, 0, 1 << 21),
            vec![(1, 0, 1 << 20), (2, 20, 30)]
        );
        ivs.prune(1 << 21);
        assert_eq!(ivs.len(), 0);
    }
}
