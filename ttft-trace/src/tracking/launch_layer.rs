//! Which layer a traced process's launches are probed at. Both are at
//! first: the runtime's launch probes see `cudaLaunchKernel`, and the
//! driver's see the `cuLaunchKernel` it makes (recognised and skipped) and
//! the launches of direct driver users. Once a process's runtime has shown
//! that every launch of its reaches the driver's probed entry points, the
//! runtime's launch probes are redundant: detaching them leaves one trap
//! per launch. A runtime that reaches the driver some other way (through
//! entry points not probed) never shows it, and keeps both.

use std::collections::{BTreeMap, BTreeSet};

use ttft_trace_common::GpuCounters;

/// Runtime launches a process must have made, every one seen again at the
/// driver, before its launches are left to the driver's probes.
pub const EVIDENCE_LAUNCHES: u64 = 256;

/// The processes of `reading` whose launches may now be left to the
/// driver's probes, leaving out those in `done`.
pub fn ready(reading: &BTreeMap<u32, GpuCounters>, done: &BTreeSet<u32>) -> Vec<u32> {
    reading
        .iter()
        .filter(|(tgid, c)| {
            !done.contains(tgid)
                && c.runtime_launches >= EVIDENCE_LAUNCHES
                && c.runtime_launches_at_driver == c.runtime_launches
        })
        .map(|(tgid, _)| *tgid)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(runtime: u64, at_driver: u64) -> GpuCounters {
        GpuCounters {
            runtime_launches: runtime,
            runtime_launches_at_driver: at_driver,
            ..GpuCounters::default()
        }
    }

    #[test]
    fn only_full_evidence_hands_launches_to_the_driver() {
        let reading = BTreeMap::from([
            (1, counters(EVIDENCE_LAUNCHES, EVIDENCE_LAUNCHES)),
            (2, counters(EVIDENCE_LAUNCHES - 1, EVIDENCE_LAUNCHES - 1)),
            (3, counters(10_000, 9_999)),
            (4, counters(10_000, 0)),
            (5, counters(0, 0)),
            (6, counters(1_000, 1_000)),
        ]);
        assert_eq!(ready(&reading, &BTreeSet::new()), [1, 6]);
        assert_eq!(ready(&reading, &BTreeSet::from([6])), [1]);
    }
}
