//! Degradation over a stream, end to end from the kernel's events as the
//! probes capture them (two heads after a receive, every send's tail):
//! chunks that grow, and the three ways a stream is truncated.

use super::{SSE_HEADERS, Wire, ms, sse_done};
use crate::{
    causes::CauseConfig,
    judging::{Judge, JudgedStalls, Truncation, WorkloadSignals},
    requests::stream_stalls::StallConfig,
    signals::SignalStore,
};

const SK: u64 = 0x5e0;
const T0: u64 = ms(1000);

/// One OpenAI completion event per token of `tokens`, as one chunk, with
/// `finish` as the finish reason (JSON: `null` or a string).
fn events(tokens: &[&str], finish: &str) -> Vec<u8> {
    let event: String = tokens
        .iter()
        .map(|t| {
            format!(
                "data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"model\":\"m\",\
                 \"choices\":[{{\"index\":0,\"text\":\"{t}\",\"finish_reason\":{finish}}}]}}\n\n"
            )
        })
        .collect();
    format!("{:x}\r\n{event}\r\n", event.len()).into_bytes()
}

/// A stream of 32 sends of one token each (the last with `last_finish`),
/// the last 8 of them of `tail_tokens` tokens each; then `end`, or a close
/// instead when `cut`.
fn stream(tail_tokens: usize, last_finish: &str, end: &[u8], cut: bool) -> JudgedStalls {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, T0, 300);
    w.send(SK, T0 + ms(1), SSE_HEADERS);
    for i in 0..32u64 {
        let n = if i >= 24 { tail_tokens } else { 1 };
        let finish = if i == 31 { last_finish } else { "null" };
        w.send(SK, T0 + ms(10 + 5 * i), &events(&vec![" tok"; n], finish));
    }
    if cut {
        w.close(SK, T0 + ms(300));
    } else {
        w.send(SK, T0 + ms(300), end);
    }
    let r = w.one(ms(10_000));
    let store = SignalStore::default();
    let signals = WorkloadSignals {
        root: 1,
        store: &store,
        episodes: None,
    };
    let mut judge = Judge::new(CauseConfig::default(), StallConfig::default(), None);
    judge.request(r, &signals, ms(10_000)).stalls
}

#[test]
fn a_stream_that_ends_well_is_not_truncated() {
    let s = stream(1, "\"stop\"", &sse_done(), false);
    assert_eq!(s.truncated, None, "{s:?}");
    assert_eq!(s.finish_reason.as_deref(), Some("stop"));
    assert!(!s.chunks_growing, "{s:?}");
    // The `[DONE]` send is a chunk too, shorter than a token's.
    assert!(
        s.chunk_growth_permille
            .is_some_and(|g| (800..=1200).contains(&g)),
        "{s:?}"
    );
}

#[test]
fn tokens_coalesced_per_send_are_growing_chunks() {
    let s = stream(4, "\"length\"", &sse_done(), false);
    assert!(s.chunks_growing, "{s:?}");
    assert!(s.chunk_growth_permille.is_some_and(|g| g >= 3_000), "{s:?}");
    assert_eq!(s.truncated, None);
}

#[test]
fn each_kind_of_truncation_is_named() {
    let no_done = stream(1, "\"stop\"", b"0\r\n\r\n", false);
    assert_eq!(no_done.truncated, Some(Truncation::MissingTerminator));
    let no_finish = stream(1, "null", &sse_done(), false);
    assert_eq!(no_finish.truncated, Some(Truncation::NoFinishReason));
    assert_eq!(no_finish.finish_reason, None);
    let cut = stream(1, "null", &[], true);
    assert_eq!(cut.truncated, Some(Truncation::Cut));
}

#[test]
fn an_end_not_seen_is_not_judged() {
    // The terminator in a send longer than a tail, with the zero-size chunk
    // in a buffer of its own (hyper's writev): the end is not in sight.
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, T0, 300);
    w.send(SK, T0 + ms(1), SSE_HEADERS);
    for i in 0..4u64 {
        w.send(SK, T0 + ms(10 + i), &events(&[" tok"], "null"));
    }
    let mut last = events(&[" tok"; 3], "\"stop\"");
    last.extend_from_slice(b"e\r\ndata: [DONE]\n\n\r\n");
    w.send_vectored(SK, T0 + ms(20), &[&last, b"0\r\n\r\n"]);
    let r = w.one(ms(10_000));
    assert_eq!(r.outcome, crate::requests::Outcome::Ok);
    assert_eq!(
        r.ending.terminator,
        crate::requests::stream_end::Terminator::Unknown
    );
}
