//! The rules' specification: requests built from their figures and signals, and the verdict
//! each must get. Deterministic, no I/O.

mod evidence;
mod output;
mod rules;

use super::{Attribution, CauseClass, CauseConfig, Evidence, RequestTimes, attribute};

/// Milliseconds in nanoseconds.
const fn ms(v: u64) -> u64 {
    v * 1_000_000
}

const T0: u64 = ms(10_000);

/// A slow request (TTFT 600 ms: queue 100, GPU 450, egress 50) with no signal: unexplained.
fn slow_request() -> Evidence {
    Evidence::new(RequestTimes {
        t_arrive_ns: T0,
        ttft_ns: Some(ms(600)),
        queue_ns: Some(ms(100)),
        gpu_ns: Some(ms(450)),
        gpu_steps_waited: Some(1),
        gpu_idle_before_start_ns: Some(ms(50)),
        ..RequestTimes::default()
    })
}

/// The client acknowledged the first token `after` it was sent, with this smoothed RTT; the
/// client's estimate follows (the request segment taken to arrive at `t_arrive`).
fn acked(ev: &mut Evidence, after: u64, srtt: u64) {
    let ttft = ev.request.ttft_ns.expect("a TTFT");
    ev.request.t_first_token_acked_ns = Some(T0 + ttft + after);
    ev.request.client_ttft_estimate_ns = Some(ttft + after);
    ev.request.srtt_ns = Some(srtt);
}

fn judge(ev: &Evidence) -> Attribution {
    attribute(ev, &CauseConfig::default())
}

/// The classes found, in the verdict's order.
fn classes(a: &Attribution) -> Vec<CauseClass> {
    a.causes.iter().map(|c| c.class).collect()
}

/// Time explained by `class`, if it was found.
fn explained(a: &Attribution, class: CauseClass) -> Option<u64> {
    a.causes
        .iter()
        .find(|c| c.class == class)
        .map(|c| c.explained_ns)
}
