//! What the kernel puts in the ring buffer, as bytes: any record, of any
//! length, routed to a workload's correlator and signals, then judged (its
//! stalls after the first token too). A
//! record the decoder does not know is counted, never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use ttft_trace::{
    causes::CauseConfig,
    judging::{Judge, WorkloadSignals},
    requests::{CorrelatorConfig, stream_stalls::StallConfig},
    routing::{Routed, Router, Workload},
    workloads::WorkloadLabels,
};

fuzz_target!(|data: &[u8]| {
    let mut router = Router::default();
    router.workloads.insert(Workload::new(
        10,
        WorkloadLabels::default(),
        &CorrelatorConfig::default(),
    ));
    let mut judge = Judge::new(CauseConfig::default(), StallConfig::default(), None);
    // Records: a length byte, then that many bytes (the decoder reads the
    // kind from the first four).
    let mut rest = data;
    let mut now = 0u64;
    while let Some((&len, tail)) = rest.split_first() {
        let (record, after) = tail.split_at(usize::from(len).min(tail.len()));
        rest = after;
        // Every process belongs to the workload, as the kernel's TRACKED
        // map would say for a traced tree.
        router.route(record, |tgid| (tgid % 2 == 0).then_some(10));
        now = now.saturating_add(u64::from(len) * 1_000_000);
        router.finish_requests(now);
        for routed in router.take() {
            if let Routed::Request { root, record } = routed
                && let Some(w) = router.workloads.by_root.get(&root)
            {
                let judged = judge.request(*record, &WorkloadSignals::of(w), now);
                let _ = serde_json::to_string(&judged.attribution);
                let _ = serde_json::to_string(&judged.stalls);
            }
        }
    }
    router.flush(10);
    router.prune(now);
    let _ = router.take();
});
