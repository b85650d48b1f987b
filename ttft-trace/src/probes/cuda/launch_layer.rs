//! Which layer a traced process's launches are probed at. Both are at
//! first: the runtime's launch probes see `cudaLaunchKernel`, and the
//! driver's see the `cuLaunchKernel` it makes (recognised and skipped) and
//! the launches of direct driver users. Once a process's runtime has shown
//! that every launch of its reaches the driver's probed entry points, the
//! runtime's launch probes are redundant: detaching them leaves one trap
//! per launch. A runtime that reaches the driver some other way (through
//! entry points not probed) never shows it, and keeps both.
//!
//! Probes bound to one process (`attach`) follow that process's evidence.
//! Host-wide probes (the daemon, `--host-wide-probes`) serve every process
//! that maps the file: they follow the evidence of the traced processes
//! that map it, together (one of them has shown it, and none has a runtime
//! launch the driver's probes did not see).

use std::collections::{BTreeMap, BTreeSet};

use ttft_trace_common::GpuCounters;

use super::RUNTIME;

/// Runtime launches a process must have made, every one seen again at the
/// driver, before its launches are left to the driver's probes.
pub const EVIDENCE_LAUNCHES: u64 = 256;

/// Whether one process has shown that its runtime's launches all reach
/// the driver's probes.
fn shown(c: &GpuCounters) -> bool {
    c.runtime_launches >= EVIDENCE_LAUNCHES && c.runtime_launches_at_driver == c.runtime_launches
}

/// The processes of `reading` whose launches may now be left to the
/// driver's probes, leaving out those in `done`.
pub fn ready(reading: &BTreeMap<u32, GpuCounters>, done: &BTreeSet<u32>) -> Vec<u32> {
    reading
        .iter()
        .filter(|(tgid, c)| !done.contains(tgid) && shown(c))
        .map(|(tgid, _)| *tgid)
        .collect()
}

/// Whether `program` is the entry program of a runtime launch: the probes
/// detached once the launches are left to the driver's.
pub fn is_runtime_launch(program: &str) -> bool {
    RUNTIME
        .symbols
        .iter()
        .any(|s| s.program == program && s.is_launch())
}

/// Whether a file's launches may be left to the driver's probes host-wide,
/// from the counters of the traced processes that map it.
pub fn file_ready(users: &[&GpuCounters]) -> bool {
    users.iter().any(|c| shown(c))
        && users
            .iter()
            .all(|c| c.runtime_launches_at_driver == c.runtime_launches)
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

    #[test]
    fn a_file_needs_one_user_that_showed_it_and_none_against() {
        let (shown, young, against) = (
            counters(EVIDENCE_LAUNCHES, EVIDENCE_LAUNCHES),
            counters(10, 10),
            counters(10, 9),
        );
        assert!(file_ready(&[&shown]));
        assert!(file_ready(&[&shown, &young]));
        assert!(
            !file_ready(&[&young]),
            "no process has made enough launches"
        );
        assert!(
            !file_ready(&[&shown, &against]),
            "one runtime launch missed the driver"
        );
        assert!(!file_ready(&[]));
    }

    #[test]
    fn only_the_runtime_launches_are_left_to_the_driver() {
        assert!(is_runtime_launch("cuda_launch_kernel") && is_runtime_launch("cuda_graph_launch"));
        assert!(!is_runtime_launch("cu_launch_kernel") && !is_runtime_launch("cuda_memcpy"));
    }
}
