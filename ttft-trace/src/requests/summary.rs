//! Exact percentiles of the per-request figures for the terminal: one
//! recorder per figure, per summary window and in total. The formatting of
//! a [`Percentiles`] is the caller's (the session's summary helpers), so
//! that the terminal reads the same for every figure.

use crate::record::{LatencyRecorder, Percentiles};

use super::record::{Figure, RequestRecord};

pub struct RequestRecorders {
    /// Indexed by `Figure as usize`.
    recorders: Vec<LatencyRecorder>,
}

impl Default for RequestRecorders {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestRecorders {
    pub fn new() -> Self {
        Self {
            recorders: Figure::ALL.iter().map(|_| LatencyRecorder::new()).collect(),
        }
    }

    /// Records the figures that count (see [`RequestRecord::observations`]).
    pub fn record(&mut self, r: &RequestRecord) {
        for (figure, ns) in r.observations() {
            self.recorders[figure as usize].record(ns);
        }
    }

    /// One line per figure for the window since the last call (which starts
    /// a new window), e.g. `TTFT   n=12     p50 120ms p95 ...`.
    pub fn window_lines(&mut self, fmt: impl Fn(&Percentiles) -> String) -> Vec<String> {
        let windows: Vec<Percentiles> =
            self.recorders.iter_mut().map(|r| r.take_window()).collect();
        lines(&windows, fmt)
    }

    /// One line per figure over the whole run.
    pub fn total_lines(&self, fmt: impl Fn(&Percentiles) -> String) -> Vec<String> {
        let totals: Vec<Percentiles> = self.recorders.iter().map(|r| r.total()).collect();
        lines(&totals, fmt)
    }
}

fn lines(per_figure: &[Percentiles], fmt: impl Fn(&Percentiles) -> String) -> Vec<String> {
    Figure::ALL
        .iter()
        .zip(per_figure)
        .map(|(f, p)| format!("{:<6} n={:<7} {}", f.label(), p.count, fmt(p)))
        .collect()
}
