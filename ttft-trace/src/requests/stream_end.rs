//! How a streamed body ended (issue 31, item 3): whether it ended with its
//! protocol's terminator, and the last finish reason it gave, read from
//! what the probe captured of each body send (the last `TAIL_BYTES` of
//! every send, the first `HEAD_BYTES` of the first sends after a receive).
//!
//! Only protocols that carry an end are judged, recognised in the body of
//! an SSE response (`Content-Type: text/event-stream`):
//!
//! - OpenAI's (`"choices"` seen: a finish reason alone is not enough, as
//!   TGI's native stream has one and no `[DONE]`): ends with
//!   `data: [DONE]`; every choice event carries `"finish_reason"`, `null`
//!   until the last.
//! - Anthropic's (`message_start` or `content_block_` seen): ends with
//!   the `message_stop` event; the finish is `"stop_reason"`.
//!
//! Nothing is guessed from bytes not seen. The terminator is *missing* only
//! when the body's last [`DECIDE_BYTES`] were seen, contiguous, without it
//! (it and the framing after it fit in fewer). The last finish reason is
//! the value after the last key seen, and is known only while no send
//! after that key had bytes not seen where another key could hide (a send
//! seen whole without a key, such as `data: [DONE]`, keeps it).

use serde::Serialize;

use ttft_trace_common::event::{HEAD_BYTES, TAIL_BYTES};

use super::chunked::{Recent, View};

/// Bytes of the body's end kept, contiguous.
const KEEP_BYTES: usize = 96;

/// The body's last bytes that must have been seen to say its terminator is
/// missing: the longest terminator with the framing that may follow it
/// (`message_stop"}\n\n` then `\r\n0\r\n\r\n`: 23 bytes) fits in them.
const DECIDE_BYTES: usize = 32;

/// Longest finish reason kept; a longer value is not read as one.
const MAX_REASON: usize = 32;

/// A streaming protocol whose end can be judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Openai,
    Anthropic,
}

impl Protocol {
    fn recognise(bytes: &[u8]) -> Option<Self> {
        if contains(bytes, b"\"choices\"") {
            Some(Self::Openai)
        } else if contains(bytes, b"message_start") || contains(bytes, b"content_block_") {
            Some(Self::Anthropic)
        } else {
            None
        }
    }

    fn terminator(self) -> &'static [u8] {
        match self {
            Self::Openai => b"data: [DONE]",
            Self::Anthropic => b"message_stop",
        }
    }

    fn finish_key(self) -> &'static [u8] {
        match self {
            Self::Openai => b"\"finish_reason\"",
            Self::Anthropic => b"\"stop_reason\"",
        }
    }
}

/// The last finish reason seen.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Finish {
    /// No key seen, or bytes not seen since the last one.
    #[default]
    Unknown,
    /// The last key's value was `null`: the stream gave no reason.
    Null,
    Reason(String),
}

/// Whether the terminator ended the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Terminator {
    /// Not judged: no protocol recognised, or the body's end not seen.
    #[default]
    Unknown,
    Seen,
    Missing,
}

/// How a stream ended, as far as was seen.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ending {
    pub protocol: Option<Protocol>,
    pub terminator: Terminator,
    pub finish: Finish,
}

/// What was read of a stream's end so far.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamEnd {
    protocol: Option<Protocol>,
    recent: Recent,
    finish: Finish,
}

impl StreamEnd {
    /// The next send's part of the body.
    pub fn on_body(&mut self, view: View) {
        self.recent.remember(view, KEEP_BYTES);
        if self.protocol.is_none() {
            self.protocol = Protocol::recognise(view.first)
                .or_else(|| Protocol::recognise(view.last))
                .or_else(|| Protocol::recognise(self.recent.bytes()));
        }
        let Some(p) = self.protocol else {
            return;
        };
        // Seen whole, the send's bytes are one run; else only its tail
        // speaks for its end (a key may hide in the bytes not seen).
        // (On the stack: no allocation per send; a send seen whole is at
        // most what the probe captures.)
        let mut whole = [0u8; HEAD_BYTES + TAIL_BYTES];
        let (a, b) = (view.first.len(), view.last.len());
        let tail = if view.gap == 0 && a + b <= whole.len() {
            whole[..a].copy_from_slice(view.first);
            whole[a..a + b].copy_from_slice(view.last);
            &whole[..a + b]
        } else {
            view.last
        };
        match last_value(tail, p.finish_key()) {
            Some(finish) => self.finish = finish,
            None if view.gap > 0 => self.finish = Finish::Unknown,
            None => {}
        }
    }

    /// How the body, as it ends now, ended.
    pub fn ending(&self) -> Ending {
        Ending {
            protocol: self.protocol,
            terminator: self.terminator(),
            finish: self.finish.clone(),
        }
    }

    fn terminator(&self) -> Terminator {
        let Some(p) = self.protocol else {
            return Terminator::Unknown;
        };
        let seen = self.recent.bytes();
        if contains(seen, p.terminator()) {
            Terminator::Seen
        } else if seen.len() >= DECIDE_BYTES {
            Terminator::Missing
        } else {
            Terminator::Unknown
        }
    }
}

/// The value after the last `key` in `bytes`: `null`, a short string of
/// `[A-Za-z0-9_.-]`, or `None` when no key is there or its value is not
/// all in sight.
fn last_value(bytes: &[u8], key: &[u8]) -> Option<Finish> {
    let at = rfind(bytes, key)?;
    let rest = &bytes[at + key.len()..];
    let rest = trim_start(rest).strip_prefix(b":")?;
    let rest = trim_start(rest);
    if rest.starts_with(b"null") {
        return Some(Finish::Null);
    }
    let rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().position(|&b| b == b'"')?;
    let value = &rest[..end];
    let plain = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.');
    (!value.is_empty() && value.len() <= MAX_REASON && value.iter().all(plain)).then(|| {
        // Checked ASCII above.
        Finish::Reason(String::from_utf8_lossy(value).into_owned())
    })
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    rfind(hay, needle).is_some()
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.len() > hay.len() {
        return None;
    }
    (0..=hay.len() - needle.len())
        .rev()
        .find(|&i| &hay[i..i + needle.len()] == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A send of `bytes` seen whole.
    fn whole(bytes: &[u8]) -> View<'_> {
        View::of_send(bytes.len() as u64, bytes, &[])
    }

    /// A send of `n` bytes of which only the tail `tail` was seen.
    fn tail_only(n: u64, tail: &[u8]) -> View<'_> {
        View::of_send(n, &[], tail)
    }

    const EVENT: &[u8] =
        b"3a\r\ndata: {\"choices\":[{\"index\":0,\"text\":\" a\",\"finish_reason\":null}]}\n\n\r\n";

    fn openai_stream(last_finish: &str, done: bool) -> StreamEnd {
        let mut end = StreamEnd::default();
        end.on_body(whole(EVENT));
        for _ in 0..5 {
            end.on_body(tail_only(300, &EVENT[EVENT.len() - 40..]));
        }
        let last = format!(
            "data: {{\"choices\":[{{\"index\":0,\"text\":\" b\",\"finish_reason\":{last_finish}}}]}}\n\n\r\n"
        );
        end.on_body(tail_only(300, &last.as_bytes()[last.len() - 40..]));
        if done {
            end.on_body(whole(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"));
        } else {
            end.on_body(whole(b"0\r\n\r\n"));
        }
        end
    }

    #[test]
    fn an_openai_stream_that_ends_well() {
        let end = openai_stream("\"length\"", true);
        assert_eq!(end.protocol, Some(Protocol::Openai));
        assert_eq!(end.terminator(), Terminator::Seen);
        assert_eq!(&end.finish, &Finish::Reason("length".into()));
    }

    #[test]
    fn a_missing_done_and_a_null_last_finish_are_seen() {
        let end = openai_stream("\"stop\"", false);
        assert_eq!(end.terminator(), Terminator::Missing);
        assert_eq!(&end.finish, &Finish::Reason("stop".into()));
        let end = openai_stream("null", true);
        assert_eq!(end.terminator(), Terminator::Seen);
        assert_eq!(&end.finish, &Finish::Null);
    }

    #[test]
    fn what_was_not_seen_is_not_judged() {
        // The last event's key beyond the tail (vLLM puts stop_reason after it).
        let mut end = openai_stream("null", true);
        let far = b",\"stop_reason\":null,\"token_ids\":[1,2,3,4,5,6,7,8,9]}]}\n\n\r\n";
        end.on_body(tail_only(400, far));
        assert_eq!(&end.finish, &Finish::Unknown);
        // The body's end seen only in part: the terminator cannot be missing.
        let mut end = StreamEnd::default();
        end.on_body(whole(EVENT));
        end.on_body(tail_only(300, b"\n\n\r\n"));
        end.on_body(whole(b"0\r\n\r\n"));
        assert_eq!(end.terminator(), Terminator::Unknown);
        // No protocol: nothing judged.
        let mut end = StreamEnd::default();
        end.on_body(whole(
            b"hello world, a plain body without any event in it at all",
        ));
        assert_eq!(end.protocol, None);
        assert_eq!(end.terminator(), Terminator::Unknown);
    }

    #[test]
    fn a_finish_reason_alone_is_no_openai_stream() {
        // TGI's native stream: its last event gives a finish reason, and
        // there is no `[DONE]` to miss.
        let mut end = StreamEnd::default();
        end.on_body(whole(
            b"data:{\"index\":1,\"token\":{\"id\":3,\"text\":\" a\"}}\n\n",
        ));
        end.on_body(whole(
            b"data:{\"details\":{\"finish_reason\":\"length\",\"generated_tokens\":2}}\n\n",
        ));
        assert_eq!(end.ending(), Ending::default(), "not judged");
    }

    #[test]
    fn anthropic_events_end_with_message_stop() {
        let mut end = StreamEnd::default();
        end.on_body(whole(
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"stop_reason\":null}}\n\n",
        ));
        assert_eq!(&end.finish, &Finish::Null);
        end.on_body(tail_only(
            200,
            b"\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":15}}\n\n",
        ));
        end.on_body(whole(
            b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        ));
        assert_eq!(end.protocol, Some(Protocol::Anthropic));
        assert_eq!(end.terminator(), Terminator::Seen);
        assert_eq!(&end.finish, &Finish::Reason("end_turn".into()));
    }

    #[test]
    fn a_hostile_value_is_not_a_reason() {
        assert_eq!(
            last_value(b"\"finish_reason\":\"a b\"", b"\"finish_reason\""),
            None
        );
        let long = format!("\"finish_reason\":\"{}\"", "x".repeat(40));
        assert_eq!(last_value(long.as_bytes(), b"\"finish_reason\""), None);
        assert_eq!(
            last_value(b"\"finish_reason\":\"sto", b"\"finish_reason\""),
            None
        );
        assert_eq!(
            last_value(b"\"finish_reason\" : \"tool_calls\"", b"\"finish_reason\""),
            Some(Finish::Reason("tool_calls".into()))
        );
    }
}
