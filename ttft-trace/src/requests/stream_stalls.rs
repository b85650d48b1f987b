//! Stalls after the first token (issue 31, item 1) and degradation over a
//! stream (item 3, the parts the gaps alone show). Pure: it reads a
//! request's first-token time and its inter-chunk gaps (`itl_ns`), nothing
//! else.
//!
//! A gap is a *stall* when it exceeds the threshold: a fixed one when
//! configured, otherwise the larger of `min_ns` and `k ×` the request's own
//! median gap (so a slow but steady stream is not all stalls, and a fast one
//! is not judged on jitter). Each stall's window is `[send before, send
//! after]` on the request's clock; at most `max_listed` windows are kept,
//! the rest counted in `dropped`.

/// How a gap is judged a stall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallConfig {
    /// A fixed threshold; `None` means `max(min_ns, k × median gap)`.
    pub fixed_ns: Option<u64>,
    pub min_ns: u64,
    pub k: u64,
    /// Stall windows kept per request; more are counted, not listed.
    pub max_listed: usize,
}

impl Default for StallConfig {
    fn default() -> Self {
        Self {
            fixed_ns: None,
            min_ns: 100_000_000,
            k: 4,
            max_listed: 16,
        }
    }
}

/// One stall: the gap between the chunk sent at `t_start_ns` and the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallWindow {
    pub t_start_ns: u64,
    pub t_end_ns: u64,
}

impl StallWindow {
    pub fn duration_ns(&self) -> u64 {
        self.t_end_ns - self.t_start_ns
    }
}

/// A request's stalls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stalls {
    pub threshold_ns: u64,
    pub count: u32,
    pub total_ns: u64,
    pub longest_ns: u64,
    pub windows: Vec<StallWindow>,
    /// Stalls beyond `max_listed`, counted but without a window.
    pub dropped: u32,
}

/// The stall threshold for these gaps under `config`.
pub fn threshold_ns(itl_ns: &[u64], config: &StallConfig) -> u64 {
    if let Some(fixed) = config.fixed_ns {
        return fixed;
    }
    config.min_ns.max(median(itl_ns).saturating_mul(config.k))
}

/// Every gap above the threshold, with its window. `t_first_token_ns` is
/// the first chunk's send; gap `i` follows chunk `i`.
pub fn find_stalls(t_first_token_ns: u64, itl_ns: &[u64], config: &StallConfig) -> Stalls {
    let threshold = threshold_ns(itl_ns, config);
    let mut stalls = Stalls {
        threshold_ns: threshold,
        ..Stalls::default()
    };
    let mut t_send = t_first_token_ns;
    for &gap in itl_ns {
        let t_next = t_send.saturating_add(gap);
        if gap > threshold {
            stalls.count += 1;
            stalls.total_ns = stalls.total_ns.saturating_add(gap);
            stalls.longest_ns = stalls.longest_ns.max(gap);
            if stalls.windows.len() < config.max_listed {
                stalls.windows.push(StallWindow {
                    t_start_ns: t_send,
                    t_end_ns: t_next,
                });
            } else {
                stalls.dropped += 1;
            }
        }
        t_send = t_next;
    }
    stalls
}

/// The median gap (the lower middle for an even count); 0 when none.
fn median(itl_ns: &[u64]) -> u64 {
    if itl_ns.is_empty() {
        return 0;
    }
    let mut sorted = itl_ns.to_vec();
    sorted.sort_unstable();
    sorted[(sorted.len() - 1) / 2]
}

/// How the stream's pace changed: mean gap of its last quarter over that of
/// its first, in per-mille (1000 = steady). `None` under 8 gaps, where a
/// quarter is one or two gaps and the ratio says nothing.
pub fn tpot_ratio_permille(itl_ns: &[u64]) -> Option<u64> {
    let quarter = itl_ns.len() / 4;
    if itl_ns.len() < 8 {
        return None;
    }
    let first: u64 = itl_ns[..quarter].iter().sum();
    let last: u64 = itl_ns[itl_ns.len() - quarter..].iter().sum();
    Some(last.saturating_mul(1000) / first.max(1))
}

/// A stream is *degrading* when its last quarter is paced at least this
/// many per-mille of its first (2000: twice as slow).
pub const DEGRADING_PERMILLE: u64 = 2000;
