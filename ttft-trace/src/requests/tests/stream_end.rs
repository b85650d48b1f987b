//! Degradation over a stream, end to end from the kernel's events as the
//! probes capture them (two heads after a receive, every send's tail):
//! chunks that grow, and the three ways a stream is truncated.

use ttft_trace_common::event::SEND_IOV_WALKED;

use super::{SSE_HEADERS, Wire, ms, sse_done};
use crate::{
    causes::CauseConfig,
    judging::{Judge, JudgedStalls, Truncation, WorkloadSignals},
    requests::{
        stream_end::{Finish, Terminator},
        stream_stalls::StallConfig,
    },
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

/// The chunk of [`events`] as hyper writes it: its size line, and its data
/// without the CRLF after it.
fn size_and_data(tokens: &[&str], finish: &str) -> (Vec<u8>, Vec<u8>) {
    let c = events(tokens, finish);
    let line = c.iter().position(|&b| b == b'\n').unwrap_or(0) + 1;
    (c[..line].to_vec(), c[line..c.len() - 2].to_vec())
}

/// hyper's writes (axum, TGI's router): each chunk as a size line, its
/// data and a CRLF, each a buffer of one `writev`; the openai client's
/// close at `[DONE]` before the body's end.
fn hyper_stream(end: &[&[u8]], close: bool) -> crate::requests::RequestRecord {
    let mut w = Wire::new();
    w.open(SK, 0);
    w.recv(SK, T0, 300);
    w.send_vectored(SK, T0 + ms(1), &[SSE_HEADERS]);
    for i in 0..4u64 {
        let (size, data) = size_and_data(&[" tok"], if i == 3 { "\"stop\"" } else { "null" });
        w.send_vectored(SK, T0 + ms(10 + i), &[&size, &data, b"\r\n"]);
    }
    w.send_vectored(SK, T0 + ms(20), end);
    if close {
        w.close(SK, T0 + ms(21));
    }
    w.one(ms(10_000))
}

#[test]
fn an_end_across_buffers_is_seen() {
    // `[DONE]` as a chunk of three buffers: its tail reads across them
    // (was: the CRLF alone, the protocol never recognised, and a close at
    // `[DONE]` judged a cut).
    let r = hyper_stream(&[b"e\r\n", b"data: [DONE]\n\n", b"\r\n"], true);
    assert_eq!(r.outcome, crate::requests::Outcome::ClosedMidResponse);
    assert_eq!(r.ending.terminator, Terminator::Seen);
    assert_eq!(r.ending.finish, Finish::Reason("stop".into()));
    let r = hyper_stream(
        &[b"e\r\n", b"data: [DONE]\n\n", b"\r\n", b"0\r\n\r\n"],
        false,
    );
    assert_eq!(r.outcome, crate::requests::Outcome::Ok);
    assert_eq!(r.ending.terminator, Terminator::Seen);
    // The last token, `[DONE]` and the end coalesced in one `writev` of
    // seven buffers (the real-stacks test saw it on axum): the last
    // event's finish reason is in the tail still.
    let (size, data) = size_and_data(&[" tok"], "\"length\"");
    let r = hyper_stream(
        &[
            &size,
            &data,
            b"\r\n",
            b"e\r\n",
            b"data: [DONE]\n\n",
            b"\r\n",
            b"0\r\n\r\n",
        ],
        false,
    );
    assert_eq!(r.outcome, crate::requests::Outcome::Ok);
    assert_eq!(r.ending.terminator, Terminator::Seen);
    assert_eq!(r.ending.finish, Finish::Reason("length".into()));
}

#[test]
fn an_end_not_seen_is_not_judged() {
    // The terminator in a `writev` whose last byte lies past the buffers
    // the probe walks (hyper coalescing three chunks and the end under
    // load): no tail, the end is not in sight.
    let chunk: &[&[u8]] = &[b"5\r\n", b"data:", b"\r\n"];
    let done: &[&[u8]] = &[b"e\r\n", b"data: [DONE]\n\n", b"\r\n", b"0\r\n\r\n"];
    let end = [chunk, chunk, done].concat();
    assert!(end.len() > SEND_IOV_WALKED as usize);
    let r = hyper_stream(&end, false);
    assert_eq!(r.outcome, crate::requests::Outcome::Ok);
    assert_eq!(r.ending.terminator, Terminator::Unknown);
}
