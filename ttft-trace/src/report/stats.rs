//! One run's figures from its request lines: exact percentiles (every value
//! kept and sorted, interpolated between ranks as numpy's default, which
//! `vllm bench serve` prints), the share within the objective, the cause
//! mix, and the slowest requests whole.

use std::collections::BTreeMap;

use super::read::Lines;
use crate::{jsonl_schema::Request, requests::Figure};

/// Mean and percentiles of one figure, in nanoseconds (fractional: the mean
/// and interpolated percentiles fall between values).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Stats {
    /// `values` are sorted here.
    pub fn of(values: &mut [u64]) -> Self {
        values.sort_unstable();
        let Some(&max) = values.last() else {
            return Self::default();
        };
        let sum: u128 = values.iter().map(|&v| u128::from(v)).sum();
        Self {
            count: values.len(),
            mean: sum as f64 / values.len() as f64,
            median: percentile(values, 50.0),
            p90: percentile(values, 90.0),
            p99: percentile(values, 99.0),
            p999: percentile(values, 99.9),
            max: max as f64,
        }
    }
}

/// The `p`th percentile of sorted, non-empty `sorted`, interpolated linearly
/// between the two nearest ranks (numpy's default method).
pub fn percentile(sorted: &[u64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let (a, b) = (sorted[lo] as f64, sorted[hi] as f64);
    a + (b - a) * (rank - lo as f64)
}

/// One request's place on the time axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Arrival, seconds since the run's first arrival.
    pub t_s: f64,
    pub ttft_ns: u64,
}

/// How many slow requests named a cause, and the time it explained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CauseTally {
    pub requests: u64,
    pub explained_ns: u64,
}

/// Everything the table and the page show of one JSONL file.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// The file's name, for headings.
    pub name: String,
    pub lines: Lines,
    /// The objective, in nanoseconds.
    pub slo_ns: u64,
    pub outcomes: BTreeMap<String, u64>,
    pub figures: Vec<(Figure, Stats)>,
    /// Every counted TTFT, ascending (the CDF).
    pub ttft_sorted: Vec<u64>,
    /// Every counted TTFT by arrival.
    pub points: Vec<Point>,
    /// First arrival and last response end seen, CLOCK_MONOTONIC ns.
    pub start_ns: u64,
    pub end_ns: u64,
    /// Requests the tracer judged slow (`slow`), those no cause explained,
    /// and the causes named.
    pub slow: u64,
    pub unexplained: u64,
    pub causes: BTreeMap<String, CauseTally>,
    /// The slowest requests by counted TTFT, slowest first.
    pub slowest: Vec<Request>,
    /// Retries of interrupted requests, and the TTFT their users saw (from
    /// the first attempt's arrival; those with a first token).
    pub retried: u64,
    pub retries: Stats,
    /// TLS handshakes (one a connection: on the record that counts it),
    /// and their connections by version.
    pub tls_handshakes: Stats,
    pub tls_versions: BTreeMap<String, u64>,
}

/// Collects a run from its request lines.
pub struct Builder {
    top: usize,
    values: Vec<Vec<u64>>,
    arrivals: Vec<(u64, u64)>,
    outcomes: BTreeMap<String, u64>,
    start_ns: u64,
    end_ns: u64,
    slow: u64,
    unexplained: u64,
    causes: BTreeMap<String, CauseTally>,
    slowest: Vec<Request>,
    retried: u64,
    user_ttfts: Vec<u64>,
    handshakes: Vec<u64>,
    tls_versions: BTreeMap<String, u64>,
}

impl Builder {
    /// Keeps the `top` slowest requests whole.
    pub fn new(top: usize) -> Self {
        Self {
            top,
            values: vec![Vec::new(); Figure::ALL.len()],
            arrivals: Vec::new(),
            outcomes: BTreeMap::new(),
            start_ns: u64::MAX,
            end_ns: 0,
            slow: 0,
            unexplained: 0,
            causes: BTreeMap::new(),
            slowest: Vec::new(),
            retried: 0,
            user_ttfts: Vec::new(),
            handshakes: Vec::new(),
            tls_versions: BTreeMap::new(),
        }
    }

    pub fn add(&mut self, mut r: Request) {
        *self.outcomes.entry(r.outcome.clone()).or_default() += 1;
        if r.retry_of.is_some() {
            self.retried += 1;
            self.user_ttfts.extend(r.user_ttft_ns);
        }
        if let Some(tls) = r.tls.as_ref().filter(|t| t.handshake_counted) {
            self.handshakes.extend(tls.handshake_ns);
            *self.tls_versions.entry(tls.version.clone()).or_default() += 1;
        }
        self.start_ns = self.start_ns.min(r.t_arrive_ns);
        let end = r.t_done_ns.or(r.t_first_token_ns).unwrap_or(r.t_arrive_ns);
        self.end_ns = self.end_ns.max(end);
        if r.slow {
            self.slow += 1;
            if r.causes.is_empty() {
                self.unexplained += 1;
            }
            for c in &r.causes {
                let t = self.causes.entry(c.class.clone()).or_default();
                t.requests += 1;
                t.explained_ns = t.explained_ns.saturating_add(c.explained_ns);
            }
        }
        // The figures `RequestRecord::observations` gives.
        let started = r.first_token_counts();
        let whole = r.whole();
        for (i, f) in Figure::ALL.into_iter().enumerate() {
            let v = match f {
                Figure::Ttft => r.ttft_ns.filter(|_| started),
                Figure::Queue => r.queue_ns.filter(|_| started),
                Figure::Gpu => r.gpu_ns.filter(|_| started),
                Figure::Egress => r.egress_ns.filter(|_| started),
                Figure::E2e => r.e2e_ns.filter(|_| whole),
                Figure::Tpot => r.tpot_ns.filter(|_| whole),
                Figure::Itl => {
                    if started {
                        self.values[i].append(&mut r.itl_ns);
                    }
                    None
                }
            };
            self.values[i].extend(v);
        }
        // The ITL list is in the figures now; the kept request needs none.
        r.itl_ns = Vec::new();
        if let Some(ttft) = r.counted_ttft_ns() {
            self.arrivals.push((r.t_arrive_ns, ttft));
            self.keep_if_slowest(r);
        }
    }

    fn keep_if_slowest(&mut self, r: Request) {
        if self.top == 0 {
            return;
        }
        self.slowest.push(r);
        // Sorted and cut only now and then: amortised O(log top) a request.
        if self.slowest.len() >= 2 * self.top {
            self.cut();
        }
    }

    fn cut(&mut self) {
        // Slowest first; ties by arrival, so the output is deterministic.
        self.slowest
            .sort_by_key(|r| (std::cmp::Reverse(r.counted_ttft_ns()), r.t_arrive_ns, r.pid));
        self.slowest.truncate(self.top);
    }

    pub fn finish(mut self, name: String, lines: Lines, slo_ns: u64) -> Run {
        self.cut();
        let figures: Vec<(Figure, Stats)> = Figure::ALL
            .into_iter()
            .zip(self.values.iter_mut())
            .map(|(f, v)| (f, Stats::of(v)))
            .collect();
        let ttft_sorted = std::mem::take(&mut self.values[0]);
        debug_assert_eq!(Figure::ALL[0], Figure::Ttft);
        let start_ns = if self.start_ns == u64::MAX {
            0
        } else {
            self.start_ns
        };
        self.arrivals.sort_unstable();
        let points = self
            .arrivals
            .iter()
            .map(|&(t, ttft_ns)| Point {
                t_s: t.saturating_sub(start_ns) as f64 / 1e9,
                ttft_ns,
            })
            .collect();
        Run {
            name,
            lines,
            slo_ns,
            outcomes: self.outcomes,
            figures,
            ttft_sorted,
            points,
            start_ns,
            end_ns: self.end_ns.max(start_ns),
            slow: self.slow,
            unexplained: self.unexplained,
            causes: self.causes,
            slowest: self.slowest,
            retried: self.retried,
            retries: Stats::of(&mut self.user_ttfts),
            tls_handshakes: Stats::of(&mut self.handshakes),
            tls_versions: self.tls_versions,
        }
    }
}

impl Run {
    pub fn stats(&self, f: Figure) -> Stats {
        self.figures
            .iter()
            .find(|(g, _)| *g == f)
            .map_or_else(Stats::default, |(_, s)| *s)
    }

    /// Share of the counted TTFTs at or under the objective; `None` without any.
    pub fn within_slo(&self) -> Option<f64> {
        let n = self.ttft_sorted.len();
        let within = self.ttft_sorted.partition_point(|&t| t <= self.slo_ns);
        (n > 0).then(|| within as f64 / n as f64)
    }

    /// From the first arrival to the last response's end, in seconds.
    pub fn duration_s(&self) -> f64 {
        (self.end_ns - self.start_ns) as f64 / 1e9
    }

    pub fn successful(&self) -> u64 {
        self.outcomes.get("ok").copied().unwrap_or(0)
    }
}
