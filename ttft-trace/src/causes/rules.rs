//! The rules, one function per cause (each documented in [`super`]), and [`attribute`] that
//! runs them on a slow request.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::nvml::WindowReadings;

use super::attribution::{Attribution, Cause, CauseClass};
use super::config::CauseConfig;
use super::evidence::Evidence;

pub(super) type EvidenceMap = BTreeMap<&'static str, Value>;

/// Judges one request: slow or not, SLO violation or not, and for a slow one every cause
/// whose rule fires, longest explained time first. A request without a TTFT that counts is
/// not judged (not slow, no violation).
pub fn attribute(ev: &Evidence, cfg: &CauseConfig) -> Attribution {
    let Some(ttft) = ev.request.ttft_ns else {
        return Attribution::default();
    };
    let client_ttft = client_ttft_of(ev);
    let slo_violation = ttft > cfg.slow_ttft_ns;
    // A first token still unacknowledged when the wait for its ACK ended (seconds), while
    // the connection retransmitted: the client has waited at least that long, unless every
    // one of its ACKs alone was lost for the whole wait.
    let undelivered = ev.request.t_first_token_unacked_ns.is_some() && ev.retransmits > 0;
    let slow = slo_violation || undelivered || client_ttft.is_some_and(|c| c > cfg.slow_ttft_ns);
    let mut verdict = Attribution {
        slow,
        slo_violation,
        causes: Vec::new(),
        ttft_ns: Some(ttft),
        client_ttft_estimate_ns: client_ttft,
    };
    if !slow {
        return verdict;
    }
    let cold = cold_start(ev, cfg, ttft);
    let is_cold = cold.is_some();
    verdict.causes = [
        queueing(ev, cfg, ttft),
        batching(ev, cfg, ttft),
        cpu(ev, cfg, ttft),
        network(ev, cfg),
        gpu_memory(ev, cfg, ttft, is_cold),
        cold,
    ]
    .into_iter()
    .flatten()
    .collect();
    longest_first(&mut verdict.causes);
    verdict
}

/// The rules that read a window's signals alone, not the first token's delivery nor a cold
/// start, on `ev` filled over a window of `span` ns (a stall's, `super::stalls`): `queueing`,
/// `batching`, `cpu`, `gpu_memory`, with their TTFT thresholds.
pub(super) fn window_causes(ev: &Evidence, cfg: &CauseConfig, span: u64) -> Vec<Cause> {
    [
        queueing(ev, cfg, span),
        batching(ev, cfg, span),
        cpu(ev, cfg, span),
        gpu_memory(ev, cfg, span, false),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Orders causes by explained time, longest first; ties by class.
pub(super) fn longest_first(causes: &mut [Cause]) {
    causes.sort_by(|a, b| {
        b.explained_ns
            .cmp(&a.explained_ns)
            .then(a.class.cmp(&b.class))
    });
}

pub(super) fn cause(class: CauseClass, explained_ns: u64, evidence: EvidenceMap) -> Cause {
    Cause {
        class,
        explained_ns,
        evidence,
    }
}

/// A share for the JSONL, rounded to 4 decimals so that it reads as a share.
fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 0.0;
    }
    (part as f64 / whole as f64 * 1e4).round() / 1e4
}

/// For causes that involve the GPU: the throttle reasons seen, other than plain idleness
/// (throttling is evidence, not a class of its own), and the lowest SM clock.
fn add_throttle(e: &mut EvidenceMap, gpu: Option<&WindowReadings>) {
    let Some(g) = gpu.filter(|g| g.throttled()) else {
        return;
    };
    let reasons: Vec<&str> = g
        .throttle_reasons
        .iter()
        .map(String::as_str)
        .filter(|&r| r != "gpu_idle")
        .collect();
    e.insert("gpu_throttle", reasons.into());
    if let Some(hz) = g.sm_clock_min_hz {
        e.insert("sm_clock_min_hz", hz.into());
    }
}

/// Scheduler starvation: a long wait for the GPU while it ran other work.
fn queueing(ev: &Evidence, cfg: &CauseConfig, ttft: u64) -> Option<Cause> {
    let r = &ev.request;
    let (queue, idle) = (r.queue_ns?, r.gpu_idle_before_start_ns?);
    // The request's own step is among the steps waited; the others are someone else's work.
    let other_steps = r.gpu_steps_waited?.saturating_sub(1);
    let busy = queue.saturating_sub(idle);
    let fires = queue >= cfg.queueing_min_ns
        && other_steps >= 1
        && busy as f64 >= cfg.queueing_min_busy_share * queue as f64;
    if !fires {
        return None;
    }
    let mut e = EvidenceMap::from([
        ("queue_ns", queue.into()),
        ("gpu_busy_ns", busy.into()),
        ("gpu_busy_ratio", ratio(busy, queue).into()),
        ("other_gpu_steps", other_steps.into()),
    ]);
    add_throttle(&mut e, ev.gpu.as_ref());
    Some(cause(CauseClass::Queueing, busy.min(ttft), e))
}

/// Batching-window mismatch: the GPU idled while the request waited, its launching thread
/// blocked, and no CPU stage was busy enough to account for the gap.
fn batching(ev: &Evidence, cfg: &CauseConfig, ttft: u64) -> Option<Cause> {
    let idle = ev.request.gpu_idle_before_start_ns?;
    let stage = ev.cpu_stage_oncpu_ns + ev.cpu_stage_blocked_ns;
    let fires = idle >= cfg.batching_min_idle_ns
        && (stage as f64) < cfg.batching_max_cpu_share * idle as f64
        && ev.gpu_thread_blocked_ns as f64 >= cfg.batching_min_gpu_blocked_share * idle as f64;
    if !fires {
        return None;
    }
    let e = EvidenceMap::from([
        ("gpu_idle_ns", idle.into()),
        ("cpu_stage_ns", stage.into()),
        ("gpu_thread_blocked_ns", ev.gpu_thread_blocked_ns.into()),
    ]);
    Some(cause(
        CauseClass::Batching,
        idle.saturating_sub(stage).min(ttft),
        e,
    ))
}

/// CPU contention (run-queue delay) or a CPU stage that held the request while the GPU idled.
fn cpu(ev: &Evidence, cfg: &CauseConfig, ttft: u64) -> Option<Cause> {
    let runq = if ev.runq_ns >= cfg.cpu_min_runq_ns {
        ev.runq_ns
    } else {
        0
    };
    // Only the stage time that fits in the GPU's idle gap can have delayed the request: while
    // the GPU ran others' work, a busy server's CPU stages serve other requests too.
    let idle = ev.request.gpu_idle_before_start_ns.unwrap_or(0);
    let stage_total = ev.cpu_stage_oncpu_ns + ev.cpu_stage_blocked_ns;
    // One thread that stalled for that long inside the queue explains it even while the GPU
    // was busy with others (continuous batching would have taken the request at the next
    // step); capped at the queue.
    let queue = ev.request.queue_ns.unwrap_or(0);
    let stalled = ev.cpu_stage_thread_max_ns.min(queue);
    let stage = stage_total.min(idle).max(stalled);
    let stage = if stage >= cfg.cpu_min_stage_ns {
        stage
    } else {
        0
    };
    if runq == 0 && stage == 0 {
        return None;
    }
    let e = EvidenceMap::from([
        ("runq_ns", ev.runq_ns.into()),
        ("runq_max_ns", ev.runq_max_ns.into()),
        ("cpu_stage_oncpu_ns", ev.cpu_stage_oncpu_ns.into()),
        ("cpu_stage_blocked_ns", ev.cpu_stage_blocked_ns.into()),
        ("cpu_stage_thread_max_ns", ev.cpu_stage_thread_max_ns.into()),
        ("gpu_idle_ns", idle.into()),
        ("runq_explained_ns", runq.into()),
        ("stage_explained_ns", stage.into()),
    ]);
    Some(cause(CauseClass::Cpu, (runq + stage).min(ttft), e))
}

/// The client TTFT estimate the rules count ([`super::evidence::RequestTimes::ack_for_judging`]).
fn client_ttft_of(ev: &Evidence) -> Option<u64> {
    ev.request
        .ack_for_judging(ev.retransmits)
        .map(|(_, estimate)| estimate)
}

/// Loss on the request's own connection that held back the first token's delivery: the
/// client acknowledged it late (beyond one smoothed round trip), or not at all by the end of
/// the wait for it (the delivery is then at least that long), and the connection
/// retransmitted meanwhile.
fn network(ev: &Evidence, cfg: &CauseConfig) -> Option<Cause> {
    let r = &ev.request;
    let acked = r
        .ack_for_judging(ev.retransmits)
        .map(|(acked, _)| acked)
        .or(r.t_first_token_unacked_ns)?;
    let sent = r.t_arrive_ns.saturating_add(r.ttft_ns?);
    let delivery = acked.saturating_sub(sent);
    let srtt = r.srtt_ns.unwrap_or(0);
    let late = delivery.saturating_sub(srtt);
    if late < cfg.network_min_ns() || ev.retransmits == 0 {
        return None;
    }
    let e = EvidenceMap::from([
        ("first_token_delivery_ns", delivery.into()),
        ("srtt_ns", srtt.into()),
        ("retransmits", ev.retransmits.into()),
        ("resets", ev.resets.into()),
        ("client_ttft_estimate_ns", client_ttft_of(ev).into()),
        (
            "first_token_unacked",
            r.t_first_token_acked_ns.is_none().into(),
        ),
    ]);
    let client = client_ttft_of(ev).unwrap_or(late);
    Some(cause(CauseClass::Network, late.min(client), e))
}

/// GPU memory pressure: memory near full, or swap-like copy traffic while the request waited.
fn gpu_memory(ev: &Evidence, cfg: &CauseConfig, ttft: u64, cold: bool) -> Option<Cause> {
    let memory_full = ev
        .gpu
        .as_ref()
        .is_some_and(|g| g.memory_above(cfg.gpu_memory_share));
    // In a cold start, large copies are the model being loaded, not the KV cache swapping.
    let swapping = !cold && ev.large_copy_bytes >= cfg.swap_min_bytes;
    if !(memory_full || swapping) {
        return None;
    }
    let copies_in_queue = if cold { 0 } else { ev.large_copy_queue_span_ns };
    let gpu = ev.request.gpu_ns.unwrap_or(0);
    let mut e = EvidenceMap::from([
        ("gpu_ns", gpu.into()),
        ("large_copies", ev.large_copies.into()),
        ("large_copy_bytes", ev.large_copy_bytes.into()),
        ("large_copy_queue_span_ns", copies_in_queue.into()),
    ]);
    if let Some(g) = &ev.gpu {
        e.insert("mem_used_max_ratio", g.mem_used_max_ratio.into());
        e.insert("mem_used_max_bytes", g.mem_used_max_bytes.into());
        e.insert("mem_total_bytes", g.mem_total_bytes.into());
    }
    add_throttle(&mut e, ev.gpu.as_ref());
    Some(cause(
        CauseClass::GpuMemory,
        (gpu + copies_in_queue).min(ttft),
        e,
    ))
}

/// The first work of a new process: its queue and GPU time are warm-up.
fn cold_start(ev: &Evidence, cfg: &CauseConfig, ttft: u64) -> Option<Cause> {
    let young = ev
        .gpu_process_age_ns
        .is_some_and(|age| age < cfg.cold_start_window_ns);
    let loading = ev.large_copy_h2d_bytes >= cfg.load_min_bytes
        && ev.large_copy_d2h_bytes < ev.large_copy_h2d_bytes / 4;
    if !(ev.first_gpu_work_in_window || young || loading) {
        return None;
    }
    let r = &ev.request;
    let explained = match (r.queue_ns, r.gpu_ns) {
        (Some(q), Some(g)) => q + g,
        _ => ttft,
    };
    let mut e = EvidenceMap::from([
        (
            "first_gpu_work_in_window",
            ev.first_gpu_work_in_window.into(),
        ),
        ("gpu_process_age_ns", ev.gpu_process_age_ns.into()),
        ("large_copy_h2d_bytes", ev.large_copy_h2d_bytes.into()),
    ]);
    add_throttle(&mut e, ev.gpu.as_ref());
    Some(cause(CauseClass::ColdStart, explained.min(ttft), e))
}
