//! Stalls after the first token (issue 31, item 1) and degradation over a
//! stream (item 3, the parts the gaps alone show). Pure: it reads a
//! request's first-token time and its inter-chunk gaps (`itl_ns`), and the
//! gaps between its chunks' ACKs (`chunk_ack_gaps_ns`), nothing else.
//!
//! A gap is a *stall* when it exceeds the threshold: a fixed one when
//! configured, otherwise the larger of `min_ns` and `k ×` the request's own
//! median gap (so a slow but steady stream is not all stalls, and a fast one
//! is not judged on jitter). Each stall's window is `[send before, send
//! after]` on the request's clock; at most `max_listed` windows are kept,
//! the rest counted in `dropped`.
//!
//! A stall is seen at the *send* (a gap in `itl_ns`) or only at the
//! *delivery* (a gap between chunks' ACKs: the chunks left on time and
//! reached the client late, a stall on the wire). A delivery gap is a stall
//! when it exceeds both the send side's threshold (the request's own pace)
//! and the same rule on the delivery gaps (ACKs that cover several chunks
//! make gaps of 0 and lower that median: the send side's keeps the bar).
//! A delivery stall over a send stall is that stall seen again: one stall.

use serde::Serialize;

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

/// Where a stall was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SeenAt {
    /// A gap between two sends.
    Send,
    /// A gap between two chunks' ACKs, the sends on time.
    Delivery,
}

impl SeenAt {
    pub fn name(self) -> &'static str {
        match self {
            Self::Send => "send",
            Self::Delivery => "delivery",
        }
    }
}

/// One stall: the gap between the chunk sent (or, seen at the delivery,
/// acknowledged) at `t_start_ns` and the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallWindow {
    pub t_start_ns: u64,
    pub t_end_ns: u64,
    pub seen_at: SeenAt,
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
    gaps_over(t_first_token_ns, itl_ns, threshold, SeenAt::Send, config)
}

/// The stalls seen only at the delivery: every gap between chunks' ACKs
/// (`t_first_acked_ns` the first chunk's, gap `i` follows chunk `i`) above
/// both `send_threshold_ns` and the rule on these gaps, but for those over
/// a stall of `sent` (the same stall, seen at the send). Windows are not
/// capped here: [`merge`] caps both sides' together.
pub fn find_delivery_stalls(
    t_first_acked_ns: u64,
    ack_gaps_ns: &[u64],
    sent: &Stalls,
    config: &StallConfig,
) -> Stalls {
    let threshold = threshold_ns(ack_gaps_ns, config).max(sent.threshold_ns);
    let uncapped = StallConfig {
        max_listed: usize::MAX,
        ..*config
    };
    let mut found = gaps_over(
        t_first_acked_ns,
        ack_gaps_ns,
        threshold,
        SeenAt::Delivery,
        &uncapped,
    );
    let seen = |w: &StallWindow| {
        sent.windows
            .iter()
            .any(|s| w.t_start_ns < s.t_end_ns && w.t_end_ns > s.t_start_ns)
    };
    found.windows.retain(|w| !seen(w));
    found.count = found.windows.len() as u32;
    found.total_ns = found.windows.iter().map(StallWindow::duration_ns).sum();
    found.longest_ns = found
        .windows
        .iter()
        .map(StallWindow::duration_ns)
        .max()
        .unwrap_or(0);
    found
}

/// Both sides' stalls as one request's: counts and totals added, windows in
/// time order, at most `max_listed` (the rest counted in `dropped`).
/// `sent` must have been found with no fewer windows listed than it has
/// stalls for the order to hold; its threshold is kept.
pub fn merge(sent: Stalls, delivered: Stalls, max_listed: usize) -> Stalls {
    let mut windows = sent.windows;
    windows.extend(delivered.windows);
    windows.sort_by_key(|w| (w.t_start_ns, w.t_end_ns));
    let listed = windows.len().min(max_listed);
    let cut = (windows.len() - listed) as u32;
    windows.truncate(listed);
    Stalls {
        threshold_ns: sent.threshold_ns,
        count: sent.count + delivered.count,
        total_ns: sent.total_ns.saturating_add(delivered.total_ns),
        longest_ns: sent.longest_ns.max(delivered.longest_ns),
        windows,
        dropped: sent.dropped + delivered.dropped + cut,
    }
}

/// Every gap of `gaps` above `threshold`, from `t0`, seen at `seen_at`.
fn gaps_over(
    t0: u64,
    gaps: &[u64],
    threshold: u64,
    seen_at: SeenAt,
    config: &StallConfig,
) -> Stalls {
    let mut stalls = Stalls {
        threshold_ns: threshold,
        ..Stalls::default()
    };
    let mut t_send = t0;
    for &gap in gaps {
        let t_next = t_send.saturating_add(gap);
        if gap > threshold {
            stalls.count += 1;
            stalls.total_ns = stalls.total_ns.saturating_add(gap);
            stalls.longest_ns = stalls.longest_ns.max(gap);
            if stalls.windows.len() < config.max_listed {
                stalls.windows.push(StallWindow {
                    t_start_ns: t_send,
                    t_end_ns: t_next,
                    seen_at,
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

/// How a stream changed over its length: the mean of its last quarter of
/// `values` over that of its first, in per-mille (1000 = steady). Over the
/// gaps between chunks it is the pace (a slowing stream grows it); over the
/// chunks' sizes, how far tokens were coalesced per send (several a send
/// when the sender fell behind). `None` under 8 values, where a quarter is
/// one or two and the ratio says nothing.
pub fn quarter_ratio_permille<T: Copy + Into<u64>>(values: &[T]) -> Option<u64> {
    let quarter = values.len() / 4;
    if values.len() < 8 {
        return None;
    }
    let sum = |v: &[T]| v.iter().fold(0u64, |a, &x| a.saturating_add(x.into()));
    let first = sum(&values[..quarter]);
    let last = sum(&values[values.len() - quarter..]);
    Some(last.saturating_mul(1000) / first.max(1))
}

/// A stream is *degrading* when its last quarter is paced at least this
/// many per-mille of its first (2000: twice as slow), and its chunks
/// *growing* when its last quarter's are on average that much larger.
pub const DEGRADING_PERMILLE: u64 = 2000;
