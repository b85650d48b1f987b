//! The toggle bench's analysis ([`crate::hooktoggle`]): the fixture's
//! slices sorted into the phases between switches (a slice across a switch
//! is dropped), each on phase paired with the off phases beside it, and a
//! case's summary of the ratios. Pure, and unit-tested on made-up slices.

use serde_json::{Value, json};

use crate::hosttax::quantile;

/// One switch: CLOCK_MONOTONIC before and after its bpf() calls, and
/// whether the second links are on after it.
#[derive(Clone, Copy)]
pub(crate) struct Toggle {
    pub(crate) before: u64,
    pub(crate) after: u64,
    pub(crate) on: bool,
}

/// One slice of the fixture's run: stamps and operations.
pub(crate) struct Slice {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) ops: u64,
}

/// Per phase (between two switches): whether the hooks were on, and the ns
/// and operations of the slices wholly inside it.
pub(crate) fn phases(slices: &[Slice], toggles: &[Toggle]) -> Vec<(bool, u64, u64)> {
    let spans: Vec<(u64, u64, bool)> = toggles
        .windows(2)
        .map(|w| (w[0].after, w[1].before, w[0].on))
        .collect();
    let mut sums = vec![(0, 0); spans.len()];
    for s in slices {
        let i = spans.partition_point(|p| p.0 <= s.start);
        if i > 0 && s.end <= spans[i - 1].1 {
            sums[i - 1].0 += s.end - s.start;
            sums[i - 1].1 += s.ops;
        }
    }
    spans
        .iter()
        .zip(sums)
        .map(|(&(_, _, on), (ns, ops))| (on, ns, ops))
        .collect()
}

/// Each on phase's ns per operation over the mean of the off phases right
/// before and after it (all three with whole slices).
pub(crate) fn paired(phases: &[(bool, u64, u64)]) -> Vec<f64> {
    let per_op = |&(_, ns, ops): &(bool, u64, u64)| (ops > 0).then(|| ns as f64 / ops as f64);
    phases
        .windows(3)
        .filter(|w| w[1].0)
        .filter_map(|w| {
            let (b, on, a) = (per_op(&w[0])?, per_op(&w[1])?, per_op(&w[2])?);
            Some(on / ((b + a) / 2.0))
        })
        .collect()
}

/// Mean ns per operation over the phases in state `on`.
pub(crate) fn level(phases: &[(bool, u64, u64)], on: bool) -> f64 {
    let (ns, ops) = phases
        .iter()
        .filter(|p| p.0 == on)
        .fold((0, 0), |(n, o), p| (n + p.1, o + p.2));
    ns as f64 / ops as f64
}

/// One case under one setup: the paired ratios' median and quartiles (NaN,
/// so null, without any), ns per operation off and on, and the switches
/// made with the longest of them (a switch held up by the kernel, as while
/// another tracer attaches or detaches, leaves fewer phases).
pub(crate) fn summary(slices: &[Slice], toggles: &[Toggle]) -> Value {
    let ph = phases(slices, toggles);
    let ratios = paired(&ph);
    let q = |p| match ratios.len() {
        0 => f64::NAN,
        _ => quantile(&ratios, p),
    };
    let off = level(&ph, false);
    let longest = toggles.iter().map(|t| t.after - t.before).max();
    json!({
        "paired_median": q(0.5), "paired_q1": q(0.25), "paired_q3": q(0.75),
        "phases": ratios.len(), "off_ns_per_op": off, "on_ns_per_op": level(&ph, true),
        "added_ns_per_op": (q(0.5) - 1.0) * off, "ratios": ratios,
        "switches": toggles.len(), "longest_switch_us": longest.unwrap_or(0) as f64 / 1e3,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toggle(at: u64, on: bool) -> Toggle {
        Toggle {
            before: at,
            after: at + 1,
            on,
        }
    }

    #[test]
    fn slices_across_a_switch_are_dropped_and_on_phases_paired() {
        // Off 0-100, on 101-200, off 201-300.
        let toggles = [
            toggle(0, false),
            toggle(100, true),
            toggle(200, false),
            toggle(300, true),
        ];
        let slice = |start, end, ops| Slice { start, end, ops };
        let slices = [
            slice(1, 50, 49),    // off: 1 ns/op
            slice(90, 110, 20),  // across a switch: dropped
            slice(120, 180, 30), // on: 2 ns/op
            slice(210, 290, 20), // off: 4 ns/op
        ];
        let ph = phases(&slices, &toggles);
        assert_eq!(ph, vec![(false, 49, 49), (true, 60, 30), (false, 80, 20)]);
        // 2 over the mean of 1 and 4.
        assert_eq!(paired(&ph), vec![2.0 / 2.5]);
        assert_eq!(level(&ph, false), 129.0 / 69.0);
    }
}
