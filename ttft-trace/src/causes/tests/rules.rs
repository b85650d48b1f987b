//! Each rule at its threshold (fires) and just under it (does not), and how causes combine.

use crate::nvml::{ThrottleReasons, WindowReadings};

use super::*;
use CauseClass::*;

#[test]
fn a_request_at_the_threshold_is_not_slow_and_gets_no_cause() {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(350));
    ev.runq_ns = ms(300);
    ev.first_gpu_work_in_window = true;
    let a = judge(&ev);
    assert!(!a.slow && !a.slo_violation);
    assert!(a.causes.is_empty() && !a.unexplained());
    assert!(a.labels().is_empty());

    ev.request.ttft_ns = Some(ms(350) + 1);
    let a = judge(&ev);
    assert!(a.slow && a.slo_violation);
    assert_eq!(classes(&a), [ColdStart, Cpu]);
}

#[test]
fn a_slow_request_without_evidence_is_unexplained() {
    let a = judge(&slow_request());
    assert!(a.slow && a.slo_violation && a.unexplained());
    assert!(a.causes.is_empty());
    assert_eq!(a.labels(), ["unexplained"]);
}

#[test]
fn a_request_without_a_ttft_is_not_judged() {
    let mut ev = slow_request();
    ev.request.ttft_ns = None;
    ev.add_retransmit(T0 + ms(900));
    let a = judge(&ev);
    assert_eq!(a, Attribution::default());
    assert_eq!(a.judged_ttft_ns(), None);
}

/// Queue 2 s, GPU idle 1 s of it (busy share 0.5), one other step: TTFT 2.5 s.
fn starved() -> Evidence {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(2_500));
    ev.request.queue_ns = Some(ms(2_000));
    ev.request.gpu_ns = Some(ms(450));
    ev.request.gpu_steps_waited = Some(2);
    ev.request.gpu_idle_before_start_ns = Some(ms(1_000));
    ev.gpu_thread_blocked_ns = 0;
    ev
}

#[test]
fn queueing_fires_on_a_long_wait_while_the_gpu_ran_others_work() {
    let a = judge(&starved());
    assert_eq!(classes(&a), [Queueing]);
    assert_eq!(explained(&a, Queueing), Some(ms(1_000)));
    let e = &a.causes[0].evidence;
    assert_eq!(e["queue_ns"], ms(2_000));
    assert_eq!(e["gpu_busy_ratio"], 0.5);
    assert_eq!(e["other_gpu_steps"], 1);

    let mut short = starved();
    short.request.queue_ns = Some(ms(2_000) - 1);
    assert_eq!(explained(&judge(&short), Queueing), None);
    let mut idle = starved();
    idle.request.gpu_idle_before_start_ns = Some(ms(1_000) + 1);
    assert_eq!(explained(&judge(&idle), Queueing), None);
    // Its own step alone: nobody else's work held the GPU.
    let mut alone = starved();
    alone.request.gpu_steps_waited = Some(1);
    assert_eq!(explained(&judge(&alone), Queueing), None);
}

/// GPU idle 100 ms of the queue, CPU stages 49 ms, GPU thread blocked 50 ms.
fn idle_gpu() -> Evidence {
    let mut ev = slow_request();
    ev.request.gpu_idle_before_start_ns = Some(ms(100));
    ev.cpu_stage_oncpu_ns = ms(40);
    ev.cpu_stage_blocked_ns = ms(9);
    ev.gpu_thread_blocked_ns = ms(50);
    ev
}

#[test]
fn batching_fires_when_the_gpu_idles_and_its_thread_waits() {
    let a = judge(&idle_gpu());
    assert_eq!(classes(&a), [Batching]);
    assert_eq!(explained(&a, Batching), Some(ms(51)));

    let mut short = idle_gpu();
    short.request.gpu_idle_before_start_ns = Some(ms(100) - 1);
    assert_eq!(explained(&judge(&short), Batching), None);
    // Half the idle time in a CPU stage: the stage, not the batch window, held it.
    let mut stage = idle_gpu();
    stage.cpu_stage_blocked_ns = ms(10);
    assert_eq!(explained(&judge(&stage), Batching), None);
    // The GPU thread was working, not waiting for a batch.
    let mut busy = idle_gpu();
    busy.gpu_thread_blocked_ns = ms(50) - 1;
    assert_eq!(explained(&judge(&busy), Batching), None);
}

#[test]
fn cpu_fires_on_run_queue_delay() {
    let mut ev = slow_request();
    ev.runq_ns = ms(50);
    ev.runq_max_ns = ms(20);
    let a = judge(&ev);
    assert_eq!(classes(&a), [Cpu]);
    assert_eq!(explained(&a, Cpu), Some(ms(50)));
    assert_eq!(a.causes[0].evidence["runq_max_ns"], ms(20));

    ev.runq_ns = ms(50) - 1;
    assert!(judge(&ev).unexplained());
}

#[test]
fn cpu_fires_on_a_stage_that_fills_the_gpu_idle_gap() {
    let mut ev = slow_request();
    ev.request.gpu_idle_before_start_ns = Some(ms(300));
    ev.cpu_stage_oncpu_ns = ms(60);
    ev.cpu_stage_blocked_ns = ms(40);
    let a = judge(&ev);
    assert_eq!(classes(&a), [Cpu]);
    assert_eq!(explained(&a, Cpu), Some(ms(100)));

    ev.cpu_stage_blocked_ns = ms(39);
    assert!(judge(&ev).unexplained());

    // Only the part inside the idle gap counts ...
    ev.cpu_stage_blocked_ns = ms(440);
    ev.request.gpu_idle_before_start_ns = Some(ms(120));
    assert_eq!(explained(&judge(&ev), Cpu), Some(ms(120)));
    // ... and it must pass the threshold itself: a busy CPU beside a busy GPU is no cause.
    ev.request.gpu_idle_before_start_ns = Some(ms(99));
    assert!(judge(&ev).unexplained());
}

#[test]
fn cpu_fires_on_one_stalled_stage_while_the_gpu_is_busy_with_others() {
    let mut ev = slow_request();
    // The GPU ran others' steps the whole queue; many threads each did a little.
    ev.request.gpu_idle_before_start_ns = Some(0);
    ev.cpu_stage_oncpu_ns = ms(300);
    ev.cpu_stage_thread_max_ns = ms(99);
    assert!(judge(&ev).unexplained(), "spread thin: no stalled stage");
    // One tokenizer thread stalled 400 ms inside a 420 ms queue.
    ev.request.queue_ns = Some(ms(420));
    ev.cpu_stage_thread_max_ns = ms(400);
    let a = judge(&ev);
    assert_eq!(classes(&a), [Cpu]);
    assert_eq!(explained(&a, Cpu), Some(ms(400)));
    // Never more than the queue.
    ev.cpu_stage_thread_max_ns = ms(900);
    assert_eq!(explained(&judge(&ev), Cpu), Some(ms(420)));
}

#[test]
fn network_makes_a_fast_request_slow_by_the_clients_estimate() {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(200));
    // The first token, sent at +200 ms, was acknowledged at +450 ms (SRTT 1 ms).
    acked(&mut ev, ms(250), ms(1));
    ev.add_retransmit(T0 + ms(210));
    ev.add_retransmit(T0 + ms(420));
    ev.resets = 1;
    let a = judge(&ev);
    assert!(a.slow && !a.slo_violation);
    assert_eq!(a.client_ttft_estimate_ns, Some(ms(450)));
    assert_eq!(a.judged_ttft_ns(), Some(ms(450)));
    assert_eq!(classes(&a), [Network]);
    assert_eq!(explained(&a, Network), Some(ms(249)));
    let e = &a.causes[0].evidence;
    assert_eq!(e["retransmits"], 2);
    assert_eq!(e["resets"], 1);
    assert_eq!(e["first_token_delivery_ns"], ms(250));
    assert_eq!(e["srtt_ns"], ms(1));
    assert_eq!(e["client_ttft_estimate_ns"], ms(450));

    // An estimate at the threshold is not slow.
    let mut at = slow_request();
    at.request.ttft_ns = Some(ms(200));
    acked(&mut at, ms(150), 0);
    at.add_retransmit(T0 + ms(300));
    let a = judge(&at);
    assert!(!a.slow && a.causes.is_empty());
    assert_eq!(a.judged_ttft_ns(), Some(ms(350)));
}

/// Under a tight SLO, half of it is enough: a tail loss repaired in 66 ms by the probe
/// makes a 43 ms request 109 ms at the client.
#[test]
fn a_tight_slo_names_a_shorter_network_delay() {
    let tight = CauseConfig {
        slow_ttft_ns: ms(100),
        ..CauseConfig::default()
    };
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(43));
    acked(&mut ev, ms(66), 0);
    ev.add_retransmit(T0 + ms(108));
    let a = attribute(&ev, &tight);
    assert!(a.slow && !a.slo_violation);
    assert_eq!(classes(&a), [Network]);
    assert_eq!(explained(&a, Network), Some(ms(66)));
    // Slow by 5 ms, 45 of them the network's: under half the SLO, no cause.
    ev.request.ttft_ns = Some(ms(60));
    acked(&mut ev, ms(45), 0);
    let a = attribute(&ev, &tight);
    assert!(a.slow && a.causes.is_empty());
    // The default SLO keeps 100 ms: 66 ms of a request slow for its own reasons is none.
    ev.request.ttft_ns = Some(ms(400));
    acked(&mut ev, ms(66), 0);
    let a = judge(&ev);
    assert!(a.slo_violation && !classes(&a).contains(&Network));
}

#[test]
fn without_an_ack_only_the_servers_ttft_is_judged() {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(200));
    ev.add_retransmit(T0 + ms(210));
    let a = judge(&ev);
    assert!(!a.slow && a.client_ttft_estimate_ns.is_none());
    assert_eq!(a.judged_ttft_ns(), Some(ms(200)));
}

#[test]
fn a_first_token_never_acknowledged_through_loss_is_network() {
    // Sent at +20 ms; still unacknowledged when the 5 s wait for it ended, the connection
    // retransmitting meanwhile (the RTO doubling from 200 ms).
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(20));
    let sent = T0 + ms(20);
    ev.request.t_first_token_unacked_ns = Some(sent + ms(5000));
    assert!(
        !judge(&ev).slow,
        "no retransmit: a client that stopped reading, not loss"
    );
    for backoff in [200, 600, 1400, 3000] {
        ev.add_retransmit(sent + ms(backoff));
    }
    let a = judge(&ev);
    assert!(a.slow && !a.slo_violation);
    assert_eq!(a.client_ttft_estimate_ns, None, "not known, only its bound");
    assert_eq!(classes(&a), [Network]);
    assert_eq!(explained(&a, Network), Some(ms(5000)));
    let e = &a.causes[0].evidence;
    assert_eq!(e["first_token_unacked"], true);
    assert_eq!(e["retransmits"], 4);
    assert_eq!(e["first_token_delivery_ns"], ms(5000));
    assert_eq!(ev.request.t_delivered_ns(), Some(sent + ms(5000)));
}

/// A server that closes right after its response (its last send at +60 ms), 35 % of its
/// packets lost: the first token, sent at +20 ms, lost, retransmitted at +228 ms and read by
/// the client then; its ACK came after the close, unseen, and the state change that says
/// everything was acknowledged came with the tail's own retransmit at +436 ms (issue 34).
fn first_token_acked_by_close(close_ms: u64) -> Evidence {
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(20));
    acked(&mut ev, ms(416), ms(1));
    ev.request.acked_after_ns = Some(T0 + ms(close_ms));
    ev.add_retransmit(T0 + ms(228));
    ev.add_retransmit(T0 + ms(436));
    ev
}

#[test]
fn an_ack_known_only_by_the_close_counts_from_the_close_after_loss() {
    // Only the close is certain: not slow, not network.
    let ev = first_token_acked_by_close(60);
    let a = judge(&ev);
    assert!(!a.slow && a.causes.is_empty(), "{a:?}");
    assert_eq!(a.client_ttft_estimate_ns, Some(ms(60)), "the certain part");
    // A close past the objective: the client waited at least that long, through loss.
    let ev = first_token_acked_by_close(400);
    let a = judge(&ev);
    assert!(a.slow && !a.slo_violation);
    assert_eq!(classes(&a), [Network]);
    assert_eq!(a.client_ttft_estimate_ns, Some(ms(400)));
    assert_eq!(
        a.causes[0].evidence["first_token_delivery_ns"],
        ms(380),
        "from the first token's send to the close"
    );
    // Nothing retransmitted: the whole response went through at once, the bound is the ACK.
    let mut ev = first_token_acked_by_close(60);
    ev.retransmits = 0;
    ev.retransmit_times_ns.clear();
    let a = judge(&ev);
    assert_eq!(a.client_ttft_estimate_ns, Some(ms(436)));
    assert!(a.slow && a.unexplained());
}

#[test]
fn a_late_ack_without_loss_is_not_network() {
    // A client that reads late or delays its ACK: slow by its estimate, but no loss.
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(200));
    acked(&mut ev, ms(250), 0);
    let a = judge(&ev);
    assert!(a.slow && a.unexplained());
}

#[test]
fn loss_that_did_not_delay_the_first_token_is_not_network() {
    // Slow by its own TTFT, a retransmit on the connection, the token acknowledged at once.
    let mut ev = slow_request();
    ev.runq_ns = ms(80);
    acked(&mut ev, ms(1), ms(1));
    ev.add_retransmit(T0 + ms(100));
    assert_eq!(classes(&judge(&ev)), [Cpu]);
    // Late by just under the threshold beyond one round trip: still not.
    acked(&mut ev, ms(100) + ms(20) - 1, ms(20));
    assert_eq!(classes(&judge(&ev)), [Cpu]);
    acked(&mut ev, ms(100) + ms(20), ms(20));
    let a = judge(&ev);
    assert_eq!(classes(&a), [Network, Cpu], "longest first");
    assert_eq!(explained(&a, Network), Some(ms(100)));
}

#[test]
fn an_ack_stamped_before_the_send_returned_is_no_delay() {
    // The ACK was processed inside the first token's own send: its time precedes the
    // send's return.
    let mut ev = slow_request();
    ev.request.t_first_token_acked_ns = Some(T0 + ms(600) - 30_000);
    ev.request.client_ttft_estimate_ns = Some(ms(600) - 30_000);
    ev.add_retransmit(T0 + ms(100));
    assert!(judge(&ev).unexplained());
    assert_eq!(ev.request.t_delivered_ns(), Some(T0 + ms(600)));
}

#[test]
fn a_reset_alone_is_not_a_cause() {
    let mut ev = slow_request();
    ev.resets = 2;
    assert!(judge(&ev).unexplained());
}

fn readings(used_ratio: f64, throttle: ThrottleReasons) -> WindowReadings {
    WindowReadings {
        gpus: vec![0],
        samples: 3,
        mem_used_max_ratio: Some(used_ratio),
        mem_used_max_bytes: Some((used_ratio * 80e9) as u64),
        mem_total_bytes: Some(80_000_000_000),
        sm_clock_min_hz: Some(1_200_000_000),
        throttle_reasons: throttle.names(),
        throttle_mask: throttle,
        ..WindowReadings::default()
    }
}

#[test]
fn gpu_memory_fires_on_memory_near_full_with_throttling_as_evidence() {
    let mut ev = slow_request();
    let mask = ThrottleReasons::GPU_IDLE.union(ThrottleReasons::HW_THERMAL_SLOWDOWN);
    ev.gpu = Some(readings(0.95, mask));
    let a = judge(&ev);
    assert_eq!(classes(&a), [GpuMemory]);
    assert_eq!(explained(&a, GpuMemory), Some(ms(450)));
    let e = &a.causes[0].evidence;
    assert_eq!(e["mem_used_max_ratio"], 0.95);
    assert_eq!(
        e["gpu_throttle"],
        serde_json::json!(["hw_thermal_slowdown"])
    );
    assert_eq!(e["sm_clock_min_hz"], 1_200_000_000u64);

    ev.gpu = Some(readings(0.9499, ThrottleReasons::NONE));
    assert!(judge(&ev).unexplained());
}

#[test]
fn gpu_memory_fires_on_swap_traffic_and_counts_its_span_in_the_queue() {
    let mut ev = slow_request();
    ev.large_copies = 64;
    ev.large_copy_bytes = 256 << 20;
    ev.large_copy_queue_span_ns = ms(70);
    let a = judge(&ev);
    assert_eq!(classes(&a), [GpuMemory]);
    assert_eq!(explained(&a, GpuMemory), Some(ms(450 + 70)));
    assert_eq!(a.causes[0].evidence["large_copy_queue_span_ns"], ms(70));
    assert!(!a.causes[0].evidence.contains_key("gpu_throttle"));

    ev.large_copy_bytes = (256 << 20) - 1;
    assert!(judge(&ev).unexplained());
}

#[test]
fn cold_start_fires_on_first_work_or_a_young_process() {
    let mut ev = slow_request();
    ev.first_gpu_work_in_window = true;
    let a = judge(&ev);
    assert_eq!(classes(&a), [ColdStart]);
    assert_eq!(explained(&a, ColdStart), Some(ms(550)));

    // Process age counts only when configured.
    let mut young = slow_request();
    young.gpu_process_age_ns = Some(ms(1_000));
    assert!(judge(&young).unexplained(), "off by default");
    let aged = CauseConfig {
        cold_start_window_ns: ms(60_000),
        ..CauseConfig::default()
    };
    young.gpu_process_age_ns = Some(ms(60_000) - 1);
    assert_eq!(classes(&attribute(&young, &aged)), [ColdStart]);
    young.gpu_process_age_ns = Some(ms(60_000));
    assert!(attribute(&young, &aged).unexplained());

    // Without a breakdown, the whole TTFT.
    young.gpu_process_age_ns = Some(ms(1_000));
    young.request.queue_ns = None;
    young.request.gpu_ns = None;
    assert_eq!(
        explained(&attribute(&young, &aged), ColdStart),
        Some(ms(600))
    );
}

#[test]
fn one_way_host_to_device_traffic_is_loading_two_way_is_swapping() {
    let mut ev = slow_request();
    ev.large_copies = 200;
    ev.large_copy_bytes = 2 << 30;
    ev.large_copy_h2d_bytes = 2 << 30;
    assert_eq!(classes(&judge(&ev)), [ColdStart]);
    // A swap: half out, half back in.
    ev.large_copy_h2d_bytes = 1 << 30;
    ev.large_copy_d2h_bytes = 1 << 30;
    assert_eq!(classes(&judge(&ev)), [GpuMemory]);
    // Under the loading threshold one way: a swap-in.
    ev.large_copy_bytes = 512 << 20;
    ev.large_copy_h2d_bytes = 512 << 20;
    ev.large_copy_d2h_bytes = 0;
    assert_eq!(classes(&judge(&ev)), [GpuMemory]);
}

#[test]
fn in_a_cold_start_large_copies_are_the_model_loading_not_swap() {
    let mut ev = slow_request();
    ev.first_gpu_work_in_window = true;
    ev.large_copies = 300;
    ev.large_copy_bytes = 14 << 30;
    ev.large_copy_queue_span_ns = ms(90);
    assert_eq!(classes(&judge(&ev)), [ColdStart]);
    // Memory near full still counts, without the copies.
    ev.gpu = Some(readings(0.97, ThrottleReasons::NONE));
    let a = judge(&ev);
    assert_eq!(classes(&a), [ColdStart, GpuMemory]);
    assert_eq!(explained(&a, GpuMemory), Some(ms(450)));
}

#[test]
fn several_causes_are_ordered_by_explained_time() {
    let mut ev = starved();
    ev.runq_ns = ms(300);
    ev.first_gpu_work_in_window = true;
    acked(&mut ev, ms(100), 0);
    ev.add_retransmit(T0 + ms(2_550));
    let a = judge(&ev);
    assert_eq!(classes(&a), [ColdStart, Queueing, Cpu, Network]);
    assert_eq!(explained(&a, ColdStart), Some(ms(2_450)));
    assert_eq!(explained(&a, Queueing), Some(ms(1_000)));
    assert_eq!(explained(&a, Cpu), Some(ms(300)));
    assert_eq!(explained(&a, Network), Some(ms(100)));
    assert_eq!(a.labels(), ["cold_start", "queueing", "cpu", "network"]);
}

#[test]
fn equal_explained_times_keep_the_classes_order() {
    let mut ev = slow_request();
    ev.runq_ns = ms(450);
    ev.gpu = Some(readings(0.99, ThrottleReasons::NONE));
    assert_eq!(classes(&judge(&ev)), [Cpu, GpuMemory]);
}

#[test]
fn explained_time_never_exceeds_ttft() {
    let mut ev = slow_request();
    ev.runq_ns = ms(10_000);
    ev.request.gpu_idle_before_start_ns = Some(ms(5_000));
    ev.cpu_stage_blocked_ns = ms(5_000);
    ev.large_copy_bytes = 1 << 30;
    ev.large_copy_queue_span_ns = ms(10_000);
    let a = judge(&ev);
    assert_eq!(classes(&a), [Cpu, GpuMemory]);
    assert!(a.causes.iter().all(|c| c.explained_ns == ms(600)));
}

#[test]
fn every_threshold_can_be_overridden() {
    let cfg = CauseConfig {
        slow_ttft_ns: ms(100),
        queueing_min_ns: ms(100),
        cpu_min_runq_ns: ms(5),
        gpu_memory_share: 0.5,
        cold_start_window_ns: ms(1),
        ..CauseConfig::default()
    };
    let mut ev = slow_request();
    ev.request.ttft_ns = Some(ms(200));
    ev.request.gpu_ns = Some(ms(50));
    ev.request.gpu_idle_before_start_ns = Some(0);
    ev.request.gpu_steps_waited = Some(3);
    ev.runq_ns = ms(5);
    ev.gpu = Some(readings(0.6, ThrottleReasons::NONE));
    ev.gpu_process_age_ns = Some(ms(2));
    assert!(!judge(&ev).slow);
    let a = attribute(&ev, &cfg);
    assert!(a.slow && a.slo_violation);
    assert_eq!(classes(&a), [Queueing, GpuMemory, Cpu]);

    let loose = CauseConfig {
        batching_min_idle_ns: ms(10),
        batching_max_cpu_share: 0.6,
        batching_min_gpu_blocked_share: 0.3,
        cpu_min_stage_ns: ms(10),
        network_min_delivery_ns: ms(200),
        swap_min_bytes: 1 << 20,
        ..CauseConfig::default()
    };
    let mut ev = idle_gpu();
    ev.cpu_stage_blocked_ns = ms(15);
    ev.gpu_thread_blocked_ns = ms(30);
    ev.large_copy_bytes = 1 << 20;
    acked(&mut ev, ms(150), 0);
    ev.add_retransmit(T0 + ms(601));
    assert_eq!(classes(&judge(&ev)), [Network]);
    let a = attribute(&ev, &loose);
    assert_eq!(classes(&a), [GpuMemory, Cpu, Batching]);
    assert_eq!(explained(&a, Cpu), Some(ms(55)));
    assert_eq!(explained(&a, Batching), Some(ms(45)));
}
