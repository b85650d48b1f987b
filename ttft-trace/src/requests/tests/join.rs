//! Requests joined to GPU episodes: which episode, the breakdown, the
//! grace for late episodes, GPU idle time.

use super::*;
use crate::requests::{Figure, Outcome};

const SK: u64 = 0x1000;

/// A non-streamed request arriving at 1000 ms, answered at `t_token`.
fn answered_at(w: &mut Wire, t_token: u64) {
    w.open(SK, 0);
    w.recv(SK, ms(1000), 200);
    w.send(SK, t_token, &json_response("200 OK", "{}"));
}

#[test]
fn the_last_episode_before_the_first_token_produced_it() {
    let mut w = Wire::new();
    w.episode(ms(990), ms(1005)); // a running step, done after arrival
    w.episode(ms(1010), ms(1060));
    w.episode(ms(1070), ms(1090)); // the request's own step
    w.episode(ms(1100), ms(1150)); // after the token: not it
    answered_at(&mut w, ms(1095));
    let r = w.one(ms(2000));
    assert_eq!(r.ttft_ns, Some(ms(95)));
    assert_eq!(
        (r.queue_ns, r.gpu_ns, r.egress_ns),
        (Some(ms(70)), Some(ms(20)), Some(ms(5)))
    );
    assert_eq!(
        r.queue_ns.zip(r.gpu_ns).map(|(q, g)| q + g + ms(5)),
        r.ttft_ns
    );
    assert_eq!((r.gpu_pid, r.gpu_tid), (Some(GPU_PID), Some(GPU_PID + 1)));
    assert_eq!(
        (r.gpu_t_first_launch_ns, r.gpu_t_copy_done_ns),
        (Some(ms(1070)), Some(ms(1090)))
    );
    assert_ne!(r.gpu_pid, Some(r.pid), "joined across processes");
    assert_eq!(r.gpu_steps_waited, Some(3));
    // [1000, 1070): busy 1000..1005 and 1010..1060.
    assert_eq!(r.gpu_idle_before_start_ns, Some(ms(15)));
    assert!(r.notes.is_empty(), "{:?}", r.notes);
    let figures: Vec<Figure> = r.observations().map(|(f, _)| f).collect();
    assert_eq!(
        figures,
        [
            Figure::Ttft,
            Figure::Queue,
            Figure::Gpu,
            Figure::Egress,
            Figure::E2e
        ]
    );
}

#[test]
fn an_episode_started_before_arrival_means_no_queue() {
    let mut w = Wire::new();
    w.episode(ms(950), ms(1050));
    answered_at(&mut w, ms(1060));
    let r = w.one(ms(2000));
    assert_eq!(
        (r.queue_ns, r.gpu_ns, r.egress_ns),
        (Some(0), Some(ms(50)), Some(ms(10)))
    );
    assert_eq!(
        r.gpu_t_first_launch_ns,
        Some(ms(950)),
        "the episode as it was"
    );
    assert_eq!(r.gpu_idle_before_start_ns, Some(0));
    assert_eq!(r.notes, ["joined_running_batch"]);
}

#[test]
fn no_episode_in_the_window_means_no_breakdown() {
    let mut w = Wire::new();
    w.episode(ms(900), ms(990)); // before arrival
    answered_at(&mut w, ms(1002)); // a cached answer
    let r = w.one(ms(2000));
    assert_eq!(r.ttft_ns, Some(ms(2)));
    assert_eq!(
        (r.queue_ns, r.gpu_ns, r.egress_ns, r.gpu_pid),
        (None, None, None, None)
    );
    assert_eq!(
        (r.gpu_steps_waited, r.gpu_idle_before_start_ns),
        (Some(0), None)
    );
    assert_eq!(r.notes, ["no_gpu_episode"]);
    let json = serde_json::to_string(&r).expect("json");
    assert!(
        json.contains("\"queue_ns\":null"),
        "absent, not zero: {json}"
    );
}

#[test]
fn an_episode_arriving_within_the_grace_is_joined() {
    let mut w = Wire::new();
    answered_at(&mut w, ms(1100));
    assert!(w.drain(ms(1120)).is_empty(), "held for the join grace");
    // The worker's episode event comes late, from another CPU.
    w.episode(ms(1040), ms(1090));
    let r = w.one(ms(1151));
    assert_eq!((r.queue_ns, r.egress_ns), (Some(ms(40)), Some(ms(10))));
}

#[test]
fn an_episode_arriving_after_the_grace_is_not() {
    let mut w = Wire::new();
    answered_at(&mut w, ms(1100));
    let r = w.one(ms(1151));
    assert_eq!(r.queue_ns, None);
    w.episode(ms(1040), ms(1090));
    assert!(w.drain(ms(2000)).is_empty());
}

#[test]
fn a_long_stream_is_joined_at_its_first_token() {
    // Episodes are kept 1 s; the stream lasts 5 s.
    let mut w = Wire::with(CorrelatorConfig {
        episode_history_ns: ms(1000),
        ..CorrelatorConfig::default()
    });
    w.open(SK, 0);
    w.recv(SK, ms(1000), 200);
    w.episode(ms(1020), ms(1080));
    w.send(SK, ms(1010), SSE_HEADERS);
    w.send(SK, ms(1085), &sse_chunk("a"));
    let mut t = ms(1085);
    while t < ms(6000) {
        t += ms(100);
        w.episode(t - ms(30), t - ms(5));
        w.send(SK, t, &sse_chunk("b"));
        assert!(w.drain(t).is_empty());
    }
    w.send(SK, t + ms(1), b"0\r\n\r\n");
    let r = w.one(t + ms(100));
    assert_eq!(r.outcome, Outcome::Ok);
    assert_eq!(r.gpu_t_copy_done_ns, Some(ms(1080)));
    assert_eq!(
        (r.queue_ns, r.gpu_ns, r.egress_ns),
        (Some(ms(20)), Some(ms(60)), Some(ms(5)))
    );
    assert!(w.c.stats().episodes_held < 20, "old episodes pruned");
}

#[test]
fn gpu_idle_before_the_request_started() {
    // A batching window: the GPU idles 300 ms after arrival before the step.
    let mut w = Wire::new();
    w.episode(ms(980), ms(1010));
    w.episode(ms(1300), ms(1350));
    answered_at(&mut w, ms(1360));
    let r = w.one(ms(2000));
    assert_eq!(r.queue_ns, Some(ms(300)));
    assert_eq!(r.gpu_idle_before_start_ns, Some(ms(290)));
    assert_eq!(r.gpu_steps_waited, Some(2));
}

#[test]
fn flush_finishes_requests_in_flight() {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, ms(1000), 200);
    w.episode(ms(1001), ms(1040));
    w.send(SK, ms(1010), SSE_HEADERS);
    w.send(SK, ms(1050), &sse_chunk("a"));
    w.open(SK + 1, 0);
    w.recv(SK + 1, ms(1060), 200);
    let rs = w.c.flush();
    assert_eq!(rs.len(), 2);
    assert!(rs.iter().all(|r| r.outcome == Outcome::InFlightAtExit));
    let streaming = rs
        .iter()
        .find(|r| r.ttft_ns.is_some())
        .expect("one had a token");
    assert_eq!(
        (streaming.ttft_ns, streaming.queue_ns),
        (Some(ms(50)), Some(ms(1)))
    );
    assert!(streaming.observations().any(|(f, _)| f == Figure::Ttft));
    assert!(streaming.observations().all(|(f, _)| f != Figure::E2e));
    assert_eq!(w.c.stats().connections, 0);
}

/// A server that closes after every response, whose next connection the
/// kernel gives the same socket (`sk`) while the previous request's first
/// token is still queued for its in-flight join: the join must not land on
/// the new request (seen on gunicorn's sync workers and with curl, a
/// connection per request: note `no_gpu_episode` on a request whose
/// episode was there).
#[test]
fn a_reused_socket_does_not_take_the_previous_requests_join() {
    let mut w = Wire::new();
    w.open(SK, ms(999));
    w.recv(SK, ms(1000), 200);
    w.episode(ms(1001), ms(1020));
    w.send(SK, ms(1021), SSE_HEADERS);
    w.send(SK, ms(1022), &sse_chunk("a"));
    w.send(SK, ms(1030), &sse_done());
    w.close(SK, ms(1031));
    // The same socket, a new connection and request, before the previous
    // first token's grace (50 ms) has run out.
    w.open(SK, ms(1060));
    w.recv(SK, ms(1061), 200);
    let first = w.drain(ms(1085));
    assert_eq!(first.len(), 1, "{first:#?}");
    assert!(first[0].gpu_ns.is_some(), "{first:#?}");
    w.episode(ms(1062), ms(1080));
    w.send(SK, ms(1081), SSE_HEADERS);
    w.send(SK, ms(1082), &sse_chunk("b"));
    w.send(SK, ms(1090), &sse_done());
    w.close(SK, ms(1091));
    let r = w.one(ms(2000));
    assert_eq!(r.t_arrive_ns, ms(1061));
    assert_eq!(r.gpu_t_copy_done_ns, Some(ms(1080)), "{r:#?}");
    assert!(!r.notes.contains(&"no_gpu_episode"), "{:?}", r.notes);
}
