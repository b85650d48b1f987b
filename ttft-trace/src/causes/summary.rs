//! The terminal's view of causes: the cause mix of slow requests, per summary window and in
//! total, and the slowest requests with their causes (a bounded heap each, so memory does not
//! grow with the run).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use super::attribution::{Attribution, CauseClass, UNEXPLAINED};

pub struct CauseSummary {
    top_n: usize,
    window: Mix,
    total: Mix,
    /// Order of arrival, so that ties keep the earlier request and output is deterministic.
    seq: u64,
}

#[derive(Default)]
struct Mix {
    judged: u64,
    slow: u64,
    violations: u64,
    unexplained: u64,
    /// Indexed like [`CauseClass::ALL`]: requests, explained ns.
    per_class: [(u64, u64); CauseClass::ALL.len()],
    slowest: BinaryHeap<Reverse<Slowest>>,
}

/// One of the slowest requests, as the terminal shows it.
#[derive(Clone)]
struct Slowest {
    judged_ttft_ns: u64,
    seq: u64,
    label: String,
    causes: Vec<(CauseClass, u64)>,
}

impl Slowest {
    fn key(&self) -> (u64, Reverse<u64>) {
        (self.judged_ttft_ns, Reverse(self.seq))
    }
}

impl PartialEq for Slowest {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Slowest {}

impl PartialOrd for Slowest {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Slowest {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

impl CauseSummary {
    /// Keeps the `top_n` slowest slow requests per window and in total.
    pub fn new(top_n: usize) -> Self {
        Self {
            top_n,
            window: Mix::default(),
            total: Mix::default(),
            seq: 0,
        }
    }

    /// Counts one request's verdict. `label` names the request on a top-N line (e.g. client
    /// address and request index); it is called only when the request enters a top N.
    pub fn record(&mut self, a: &Attribution, label: impl FnOnce() -> String) {
        let Some(judged_ttft_ns) = a.judged_ttft_ns() else {
            return;
        };
        self.seq += 1;
        self.window.count(a);
        self.total.count(a);
        if !a.slow {
            return;
        }
        let key = (judged_ttft_ns, Reverse(self.seq));
        let to_window = self.window.wants(key, self.top_n);
        let to_total = self.total.wants(key, self.top_n);
        if !(to_window || to_total) {
            return;
        }
        let entry = Slowest {
            judged_ttft_ns,
            seq: self.seq,
            label: label(),
            causes: a.causes.iter().map(|c| (c.class, c.explained_ns)).collect(),
        };
        if to_total {
            self.total.keep(entry.clone(), self.top_n);
        }
        if to_window {
            self.window.keep(entry, self.top_n);
        }
    }

    /// The cause mix and slowest requests since the last call, which starts a new window.
    pub fn window_lines(&mut self) -> Vec<String> {
        std::mem::take(&mut self.window).lines()
    }

    /// The cause mix and slowest requests of the whole run.
    pub fn total_lines(&self) -> Vec<String> {
        self.total.lines()
    }
}

impl Mix {
    fn count(&mut self, a: &Attribution) {
        self.judged += 1;
        self.slow += u64::from(a.slow);
        self.violations += u64::from(a.slo_violation);
        self.unexplained += u64::from(a.unexplained());
        for c in &a.causes {
            // A TTFT verdict names only the classes of `CauseClass::ALL`.
            let Some(tally) = self.per_class.get_mut(c.class as usize) else {
                continue;
            };
            tally.0 += 1;
            tally.1 += c.explained_ns;
        }
    }

    fn wants(&self, key: (u64, Reverse<u64>), top_n: usize) -> bool {
        top_n > 0
            && (self.slowest.len() < top_n
                || self
                    .slowest
                    .peek()
                    .is_some_and(|Reverse(min)| key > min.key()))
    }

    fn keep(&mut self, entry: Slowest, top_n: usize) {
        self.slowest.push(Reverse(entry));
        if self.slowest.len() > top_n {
            self.slowest.pop();
        }
    }

    /// `slow 12/240 (5.0%), SLO violations 11: queueing 7 (3.10s), cpu 4 (900ms), unexplained 1`,
    /// then one line per slowest request, slowest first.
    fn lines(&self) -> Vec<String> {
        let share = if self.judged == 0 {
            0.0
        } else {
            self.slow as f64 * 100.0 / self.judged as f64
        };
        let mut head = format!(
            "slow {}/{} ({share:.1}%), SLO violations {}",
            self.slow, self.judged, self.violations
        );
        let mut mix: Vec<(CauseClass, (u64, u64))> = CauseClass::ALL
            .into_iter()
            .zip(self.per_class)
            .filter(|(_, (n, _))| *n > 0)
            .collect();
        // Most frequent first; equal counts in the classes' own order (the sort is stable).
        mix.sort_by_key(|&(_, (n, _))| Reverse(n));
        let mut parts: Vec<String> = mix
            .iter()
            .map(|(class, (n, ns))| format!("{} {n} ({})", class.name(), duration(*ns)))
            .collect();
        if self.unexplained > 0 {
            parts.push(format!("{UNEXPLAINED} {}", self.unexplained));
        }
        if !parts.is_empty() {
            head = format!("{head}: {}", parts.join(", "));
        }
        let mut slowest: Vec<&Slowest> = self.slowest.iter().map(|Reverse(s)| s).collect();
        slowest.sort_by(|a, b| b.cmp(a));
        std::iter::once(head)
            .chain(slowest.into_iter().map(|s| {
                let causes = if s.causes.is_empty() {
                    UNEXPLAINED.to_string()
                } else {
                    s.causes
                        .iter()
                        .map(|(class, ns)| format!("{} {}", class.name(), duration(*ns)))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                format!("  {:>8} {}: {causes}", duration(s.judged_ttft_ns), s.label)
            }))
            .collect()
    }
}

/// A duration with precision that suits its size: `3.10s`, `350ms`, `12.5ms`, `0.250ms`.
fn duration(ns: u64) -> String {
    let ms = ns as f64 / 1e6;
    if ms >= 1000.0 {
        format!("{:.2}s", ms / 1000.0)
    } else if ms >= 100.0 {
        format!("{ms:.0}ms")
    } else if ms >= 1.0 {
        format!("{ms:.1}ms")
    } else {
        format!("{ms:.3}ms")
    }
}
