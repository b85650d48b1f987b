//! One response, fed its sends: where its body starts (the first token),
//! every body send after that (the chunks and the gaps between them), and
//! whether its framing says it has ended.

use serde::{Serialize, Serializer};

use super::{
    chunked::{self, Chunked, View},
    http::{self, Body, Head, Http1Head},
    stream_end::StreamEnd,
    streams::Stream,
};

/// Longest header block followed over several sends.
const HEADER_BLOCK_MAX: usize = 16 * 1024;

/// How a response was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// HTTP/1.x: status, headers and body told apart.
    Http1,
    /// Not readable as HTTP/1.x (TLS, a binary protocol) or not captured:
    /// every send is taken as body, the first one as the first token.
    Opaque,
    /// HTTP/2 in clear text (prior knowledge or an `h2c` upgrade): one
    /// request per stream where the kernel walked the frames
    /// (`requests/streams.rs`); otherwise requests are not told apart and
    /// it is read as opaque.
    Http2,
    /// TLS records: encrypted, read as opaque.
    Tls,
}

impl Framing {
    pub fn name(self) -> &'static str {
        match self {
            Self::Http1 => "http1",
            Self::Opaque => "opaque",
            Self::Http2 => "http2",
            Self::Tls => "tls",
        }
    }
}

impl Serialize for Framing {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// What the framing says about the end of the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    Complete,
    /// Known to be still going: `Content-Length` not reached, or a chunked
    /// body whose end was not seen (and could have been: see
    /// `requests/chunked.rs`).
    Incomplete,
    /// The framing cannot tell (opaque, body until close, a tail or the
    /// header end not captured): the next receive or the close ends it.
    Unknown,
}

/// One send as the response sees it.
pub(crate) struct Outgoing<'a> {
    pub t_ns: u64,
    pub bytes: u64,
    pub head: &'a [u8],
    pub tail: &'a [u8],
}

#[derive(Debug)]
pub(crate) struct Response {
    pub framing: Framing,
    pub status: Option<u16>,
    pub content_type: Option<String>,
    /// HTTP/2: the trailers' `grpc-status` and `grpc-message`, where the
    /// connection's header blocks were decoded (`header_blocks.rs`).
    pub grpc_status: Option<u32>,
    pub grpc_message: Option<String>,
    header_len: Option<u64>,
    body: Body,
    /// Trailer fields announced: a chunked body's end may be out of sight.
    trailers: bool,
    /// The first send, whole, while its header block continues in the next
    /// send (whose head is captured too): the two are parsed together.
    pending_head: Option<Vec<u8>>,
    /// Bytes of this response sent so far.
    sent: u64,
    pub t_first_byte: u64,
    pub t_first_token: Option<u64>,
    pub t_last_send: u64,
    last_body_send: u64,
    pub chunks: u32,
    pub itl: Vec<u64>,
    /// Body bytes of each chunk, as many as `itl` holds gaps, plus one.
    pub chunk_bytes: Vec<u32>,
    itl_cap: usize,
    pub itl_truncated: bool,
    /// The chunked body's decoder, from the first send that carries body.
    chunked: Option<Chunked>,
    /// How an event stream's body ended (SSE responses only).
    pub stream_end: Option<StreamEnd>,
    /// Why the figures may be off (JSONL `notes`).
    pub notes: Vec<&'static str>,
}

impl Response {
    /// A response whose first send is `send`, with its head already parsed
    /// (not [`Head::Interim`]: interim responses are skipped by the caller).
    pub fn start(head: Head, send: &Outgoing, itl_cap: usize) -> Self {
        let mut r = Self {
            framing: Framing::Opaque,
            status: None,
            content_type: None,
            grpc_status: None,
            grpc_message: None,
            header_len: None,
            body: Body::UntilClose,
            trailers: false,
            pending_head: None,
            sent: 0,
            t_first_byte: send.t_ns,
            t_first_token: None,
            t_last_send: send.t_ns,
            last_body_send: send.t_ns,
            chunks: 0,
            itl: Vec::new(),
            chunk_bytes: Vec::new(),
            itl_cap,
            itl_truncated: false,
            chunked: None,
            stream_end: None,
            notes: Vec::new(),
        };
        match head {
            Head::Http1(h) => {
                r.framing = Framing::Http1;
                r.apply(h);
                if r.header_len.is_none() {
                    if send.head.len() as u64 == send.bytes {
                        r.pending_head = Some(send.head.to_vec());
                    } else {
                        r.notes.push("header_end_not_captured");
                    }
                }
            }
            Head::Http2 => r.framing = Framing::Http2,
            Head::Tls => r.framing = Framing::Tls,
            Head::Missing => r.notes.push("head_not_captured"),
            Head::Opaque | Head::Interim => {}
        }
        r.account(send);
        r
    }

    /// The response of an HTTP/2 stream, from its frames
    /// (`requests/streams.rs`); `None` before its HEADERS were sent.
    pub fn of_stream(s: &Stream) -> Option<Self> {
        let t_first_byte = s.t_first_byte?;
        Some(Self {
            framing: Framing::Http2,
            status: s.status,
            content_type: None,
            grpc_status: s.grpc_status,
            grpc_message: s.grpc_message.clone(),
            header_len: None,
            body: Body::UntilClose,
            trailers: false,
            pending_head: None,
            sent: s.bytes_out,
            t_first_byte,
            t_first_token: s.t_first_token,
            t_last_send: s.t_last_send.unwrap_or(t_first_byte),
            last_body_send: s.t_last_send.unwrap_or(t_first_byte),
            chunks: s.chunks,
            itl: s.itl.clone(),
            // A stream's chunk sizes and end are not read yet: not judged.
            chunk_bytes: Vec::new(),
            itl_cap: s.itl.capacity(),
            itl_truncated: s.itl_truncated,
            chunked: None,
            stream_end: None,
            notes: Vec::new(),
        })
    }

    pub fn on_send(&mut self, send: &Outgoing) {
        if let Some(first) = self.pending_head.take() {
            self.continue_head(first, send);
        }
        self.account(send);
    }

    pub fn end(&self) -> End {
        if self.framing != Framing::Http1 {
            return End::Unknown;
        }
        match (self.body, self.header_len) {
            (Body::Chunked, _) => match &self.chunked {
                Some(c) if c.done() => End::Complete,
                // Trailer lines are not seen while the decoder is lost: the
                // end may have passed unseen.
                Some(c) if c.blind() || (self.trailers && !c.in_step()) => End::Unknown,
                _ => End::Incomplete,
            },
            (Body::Empty, Some(h)) => Self::reached(self.sent, h),
            (Body::Length(n), Some(h)) => Self::reached(self.sent, h.saturating_add(n)),
            (Body::UntilClose, _) | (_, None) => End::Unknown,
        }
    }

    /// An HTTP/1.x body without length or chunking: it ends at the close.
    pub fn until_close(&self) -> bool {
        self.framing == Framing::Http1 && self.body == Body::UntilClose && self.header_len.is_some()
    }

    fn reached(sent: u64, total: u64) -> End {
        if sent >= total {
            End::Complete
        } else {
            End::Incomplete
        }
    }

    fn apply(&mut self, h: Http1Head) {
        self.status = h.status;
        self.header_len = h.header_len;
        self.body = h.body;
        self.trailers = h.trailers;
        self.content_type = h.content_type;
    }

    /// Headers that went on past the first send: parse the sends seen so
    /// far as one. While every send is seen whole and the blank line has
    /// not come, the header block goes on (a server that writes it line by
    /// line); a send not seen whole ends the search.
    fn continue_head(&mut self, mut block: Vec<u8>, send: &Outgoing) {
        let view = View::of_send(send.bytes, send.head, send.tail);
        if view.gap > 0 || view.is_empty() {
            self.notes.push("header_end_not_captured");
            return;
        }
        let sent_before = block.len() as u64;
        block.extend_from_slice(view.first);
        block.extend_from_slice(view.last);
        if let Head::Http1(h) = http::parse_head(&block, sent_before + send.bytes) {
            self.apply(h);
        }
        if self.header_len.is_some() {
            return;
        }
        if block.len() < HEADER_BLOCK_MAX {
            self.pending_head = Some(block);
        } else {
            self.notes.push("header_end_not_captured");
        }
    }

    fn account(&mut self, send: &Outgoing) {
        let before = self.sent;
        self.sent += send.bytes;
        self.t_last_send = send.t_ns;
        let Some(body_at) = self.body_offset(before, send.bytes) else {
            return;
        };
        let view = View::of_send(send.bytes, send.head, send.tail).skip(body_at);
        if self.is_event_stream() {
            self.stream_end
                .get_or_insert_with(StreamEnd::default)
                .on_body(view);
        }
        let data = if self.body == Body::Chunked && self.framing == Framing::Http1 {
            let known_start = self.header_len.is_some();
            self.chunked
                .get_or_insert_with(|| {
                    if known_start {
                        Chunked::new()
                    } else {
                        Chunked::lost()
                    }
                })
                .on_send(view)
        } else {
            true
        };
        if data {
            self.body_send(send.t_ns, send.bytes - body_at);
        }
    }

    /// Whether the response is server-sent events (its end is judged).
    fn is_event_stream(&self) -> bool {
        self.content_type
            .as_deref()
            .and_then(|t| t.trim_start().get(..17))
            .is_some_and(|t| t.eq_ignore_ascii_case("text/event-stream"))
    }

    /// Where the body begins in a send that moved bytes `before .. before +
    /// n` of the response; `None` when the send is all header block.
    fn body_offset(&self, before: u64, n: u64) -> Option<u64> {
        match (self.framing, self.body, self.header_len) {
            (Framing::Opaque | Framing::Http2 | Framing::Tls, _, _) => Some(0),
            (Framing::Http1, Body::Empty, _) => None,
            (Framing::Http1, _, Some(h)) => (before + n > h).then(|| h.saturating_sub(before)),
            // Header end unknown: the first send is taken as the headers.
            (Framing::Http1, _, None) => (before > 0 && self.pending_head.is_none()).then_some(0),
        }
    }

    fn body_send(&mut self, t_ns: u64, bytes: u64) {
        self.chunks += 1;
        if self.t_first_token.is_none() {
            self.t_first_token = Some(t_ns);
            self.chunk_bytes
                .push(u32::try_from(bytes).unwrap_or(u32::MAX));
        } else if self.itl.len() < self.itl_cap {
            self.itl.push(t_ns.saturating_sub(self.last_body_send));
            self.chunk_bytes
                .push(u32::try_from(bytes).unwrap_or(u32::MAX));
        } else {
            self.itl_truncated = true;
        }
        self.last_body_send = t_ns;
    }
}

/// Whether a send that is not followed as a response (pipelining) ends one
/// by itself: a chunked terminator in its tail, or a whole response with a
/// known length in one send.
pub(crate) fn ends_a_response(send: &Outgoing) -> bool {
    if chunked::send_ends_body(View::of_send(send.bytes, send.head, send.tail)) {
        return true;
    }
    match http::parse_head(send.head, send.bytes) {
        Head::Http1(Http1Head {
            header_len: Some(h),
            body,
            ..
        }) => match body {
            Body::Empty => h <= send.bytes,
            Body::Length(n) => h.saturating_add(n) <= send.bytes,
            Body::Chunked | Body::UntilClose => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out<'a>(t_ns: u64, bytes: u64, head: &'a [u8], tail: &'a [u8]) -> Outgoing<'a> {
        Outgoing {
            t_ns,
            bytes,
            head,
            tail,
        }
    }

    fn start(send: &Outgoing) -> Response {
        Response::start(http::parse_head(send.head, send.bytes), send, 8)
    }

    const SSE_HEADERS: &[u8] =
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";

    #[test]
    fn headers_then_chunks_then_terminator() {
        let n = SSE_HEADERS.len() as u64;
        let mut r = start(&out(10, n, SSE_HEADERS, b"\r\n\r\n"));
        assert_eq!((r.t_first_token, r.end()), (None, End::Incomplete));
        r.on_send(&out(20, 30, b"1a\r\ndata: {}", b"}\n\n\r\n"));
        r.on_send(&out(25, 30, b"", b"}\n\n\r\n"));
        r.on_send(&out(40, 5, b"", b"0\r\n\r\n"));
        assert_eq!(r.t_first_token, Some(20));
        assert_eq!((r.chunks, r.itl.as_slice()), (2, &[5][..]));
        assert_eq!((r.end(), r.t_last_send), (End::Complete, 40));
    }

    #[test]
    fn a_missing_tail_makes_the_end_unknown() {
        let n = SSE_HEADERS.len() as u64;
        let mut r = start(&out(10, n, SSE_HEADERS, b"\r\n\r\n"));
        r.on_send(&out(20, 30, b"", b""));
        assert_eq!(r.end(), End::Unknown);
    }

    #[test]
    fn headers_split_over_two_sends() {
        let mut r = start(&out(10, 17, b"HTTP/1.1 200 OK\r\n", b""));
        assert_eq!(r.end(), End::Unknown);
        let rest = b"Content-Length: 4\r\n\r\n";
        r.on_send(&out(11, rest.len() as u64, rest, b""));
        assert_eq!((r.t_first_token, r.end()), (None, End::Incomplete));
        r.on_send(&out(12, 4, b"", b""));
        assert_eq!((r.t_first_token, r.end()), (Some(12), End::Complete));
        assert!(r.notes.is_empty());
    }

    #[test]
    fn header_end_beyond_the_capture() {
        let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b";
        let mut r = start(&out(10, 900, head, b"\n\r\n"));
        assert_eq!(r.notes, ["header_end_not_captured"]);
        assert_eq!(r.t_first_token, None, "the first send is taken as headers");
        r.on_send(&out(20, 30, b"", b"\n\n\r\n0\r\n\r\n"));
        assert_eq!((r.t_first_token, r.end()), (Some(20), End::Complete));
    }

    #[test]
    fn itl_is_capped() {
        let mut r = start(&out(0, 3, b"\x17\x03\x03", b""));
        for t in 1..=20 {
            r.on_send(&out(t * 10, 3, b"", b""));
        }
        assert_eq!((r.chunks, r.itl.len(), r.itl_truncated), (21, 8, true));
        assert_eq!(r.end(), End::Unknown);
    }

    #[test]
    fn whole_responses_in_one_send() {
        let json = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}";
        assert!(ends_a_response(&out(0, json.len() as u64, json, b"")));
        assert!(!ends_a_response(&out(0, 5, json, b"")), "cut short");
        assert!(ends_a_response(&out(0, 99, b"", b"\r\n0\r\n\r\n")));
        assert!(!ends_a_response(&out(0, 99, SSE_HEADERS, b"\r\n\r\n")));
    }
}
