//! Reading the captured first bytes of a response send: is it HTTP/1.x
//! (or HTTP/2), where do its headers end, how is its body framed (RFC 9112
//! §6.3).
//!
//! Only what the kernel captured is seen: the first [`HEAD_BYTES`] bytes of
//! the first sends after a receive, and the last bytes of every send. A
//! header block longer than the capture leaves the header end unknown.
//!
//! [`HEAD_BYTES`]: ttft_trace_common::event::HEAD_BYTES

/// Longest `Content-Type` value kept (it goes to the JSONL log only).
const CONTENT_TYPE_MAX: usize = 128;

/// What a send's captured head says about the response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Head {
    /// Nothing was captured.
    Missing,
    /// Not HTTP/1.x: a binary protocol.
    Opaque,
    /// TLS records (RFC 8446 §5.1): the connection is encrypted.
    Tls,
    /// The connection speaks HTTP/2 in clear text: the server's connection
    /// preface (a SETTINGS frame, RFC 9113 §3.4), or `101 Switching
    /// Protocols` to `h2c`.
    Http2,
    /// Only informational responses (`100 Continue`, `103 Early Hints`):
    /// the final response is still to come.
    Interim,
    Http1(Http1Head),
}

/// The final response's status line and the headers that frame its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Http1Head {
    pub status: Option<u16>,
    /// Bytes from the start of the send through the blank line that ends
    /// the final response's headers (interim responses before it included);
    /// `None` when the blank line is beyond the captured bytes.
    pub header_len: Option<u64>,
    pub body: Body,
    pub content_type: Option<String>,
    /// A `Trailer` field announces trailer fields after a chunked body.
    pub trailers: bool,
}

/// How the end of the body is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Body {
    /// 1xx (101), 204 and 304 carry no body.
    Empty,
    /// `Content-Length` bytes after the headers.
    Length(u64),
    /// `Transfer-Encoding: chunked`: ends with the zero-size chunk.
    Chunked,
    /// Neither: the body runs until the connection closes (or, for a
    /// protocol switch, is not HTTP any more).
    UntilClose,
}

/// Parses a send's captured head. `send_bytes` is what the send moved:
/// it tells a head that holds the whole send from a truncated one.
pub(crate) fn parse_head(head: &[u8], send_bytes: u64) -> Head {
    if head.is_empty() {
        return Head::Missing;
    }
    let mut offset = 0;
    loop {
        let rest = &head[offset..];
        if rest.is_empty() {
            // Interim responses filled the whole capture. If they were the
            // whole send, the final response is still to come.
            return if offset as u64 >= send_bytes {
                Head::Interim
            } else {
                Head::Http1(Http1Head {
                    status: None,
                    header_len: None,
                    body: Body::UntilClose,
                    content_type: None,
                    trailers: false,
                })
            };
        }
        // A send of only the first bytes of a status line: the rest follows.
        let cut_short = rest.len() < 7 && rest.len() as u64 == send_bytes;
        if cut_short && offset == 0 && b"HTTP/1.".starts_with(rest) {
            return Head::Http1(Http1Head {
                status: None,
                header_len: None,
                body: Body::UntilClose,
                content_type: None,
                trailers: false,
            });
        }
        if !rest.starts_with(b"HTTP/1.") {
            return if offset == 0 && is_settings_frame(rest) {
                Head::Http2
            } else if offset == 0 && is_tls_records(rest, send_bytes) {
                Head::Tls
            } else {
                Head::Opaque
            };
        }
        let end = find(rest, b"\r\n\r\n");
        let status = parse_status(rest);
        match (status, end) {
            (Some(s), Some(end)) if is_interim(s) => offset += end + 4,
            // An interim response longer than the capture: nothing final seen.
            (Some(s), None) if is_interim(s) => return Head::Interim,
            _ => {
                let fields = header_fields(rest, end);
                if status == Some(101) && fields.upgrade_h2c {
                    return Head::Http2;
                }
                return Head::Http1(Http1Head {
                    status,
                    header_len: end.map(|e| (offset + e + 4) as u64),
                    body: body_framing(status, &fields),
                    trailers: fields.trailers,
                    content_type: fields.content_type,
                });
            }
        }
    }
}

/// The 9-byte header of a SETTINGS frame on stream 0 (RFC 9113 §6.5): the
/// first frame a server sends on an HTTP/2 connection. Its payload is a
/// multiple of 6 bytes; an ACK carries none.
fn is_settings_frame(b: &[u8]) -> bool {
    let Some(h) = b.get(..9) else {
        return false;
    };
    let len = u32::from_be_bytes([0, h[0], h[1], h[2]]);
    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
    let (kind, flags) = (h[3], h[4]);
    kind == 4 && stream == 0 && len.is_multiple_of(6) && (flags == 0 || (flags == 1 && len == 0))
}

/// Whether a send of `send_bytes` whose first bytes are `b` is TLS records
/// (RFC 8446 §5.1): each header in sight a content type (20 to 23:
/// change_cipher_spec, alert, handshake, application_data), version 3.0 to
/// 3.4 and a length of 1 to 2^14 + 2048, the records ending within the send
/// (or at its end). A server's first send on a TLS connection is its
/// handshake flight, whole records.
fn is_tls_records(b: &[u8], send_bytes: u64) -> bool {
    let mut at = 0u64;
    let mut records = 0;
    while at < send_bytes {
        let Some(h) = usize::try_from(at).ok().and_then(|i| b.get(i..i + 5)) else {
            break;
        };
        let len = u64::from(u16::from_be_bytes([h[3], h[4]]));
        if !(20..=23).contains(&h[0]) || h[1] != 3 || h[2] > 4 || len == 0 || len > 18_432 {
            return false;
        }
        at += 5 + len;
        records += 1;
    }
    records > 0 && at <= send_bytes
}

/// Informational responses other than `101 Switching Protocols` (after
/// which the connection speaks another protocol: that is the response).
fn is_interim(status: u16) -> bool {
    (100..200).contains(&status) && status != 101
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `HTTP/1.1 200 OK`: the three digits after the first space.
fn parse_status(msg: &[u8]) -> Option<u16> {
    let digits = msg.get(9..12)?;
    if msg.get(8) != Some(&b' ') || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[derive(Default)]
struct Fields {
    content_length: Option<u64>,
    chunked: bool,
    content_type: Option<String>,
    /// `Upgrade: h2c` (with a 101, the connection switches to HTTP/2).
    upgrade_h2c: bool,
    trailers: bool,
}

/// The framing fields among the complete header lines of a message.
fn header_fields(msg: &[u8], end: Option<usize>) -> Fields {
    // Without the blank line, the last line may be cut: drop it.
    let block = match end {
        Some(e) => &msg[..e],
        None => msg
            .windows(2)
            .rposition(|w| w == b"\r\n")
            .map_or(&[][..], |i| &msg[..i]),
    };
    let mut fields = Fields::default();
    let lines = block
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    for line in lines.skip(1) {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let name = &line[..colon];
        let value = String::from_utf8_lossy(&line[colon + 1..]);
        let value = value.trim();
        if name.eq_ignore_ascii_case(b"content-length") {
            fields.content_length = value.parse().ok();
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            // Chunked counts only as the final coding (RFC 9112 §6.3).
            fields.chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
        } else if name.eq_ignore_ascii_case(b"trailer") {
            fields.trailers = true;
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            fields.upgrade_h2c = value
                .split(',')
                .any(|p| p.trim().eq_ignore_ascii_case("h2c"));
        } else if name.eq_ignore_ascii_case(b"content-type") {
            fields.content_type = Some(value.chars().take(CONTENT_TYPE_MAX).collect());
        }
    }
    fields
}

fn body_framing(status: Option<u16>, fields: &Fields) -> Body {
    if matches!(status, Some(s) if (100..200).contains(&s) || s == 204 || s == 304) {
        Body::Empty
    } else if fields.chunked {
        Body::Chunked
    } else if let Some(n) = fields.content_length {
        Body::Length(n)
    } else {
        Body::UntilClose
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http1(head: &[u8]) -> Http1Head {
        match parse_head(head, head.len() as u64) {
            Head::Http1(h) => h,
            other => panic!("not HTTP/1: {other:?}"),
        }
    }

    #[test]
    fn streaming_headers_alone() {
        let head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
                     Transfer-Encoding: chunked\r\n\r\n";
        let h = http1(head);
        assert_eq!(h.status, Some(200));
        assert_eq!(h.header_len, Some(head.len() as u64));
        assert_eq!(h.body, Body::Chunked);
        assert_eq!(h.content_type.as_deref(), Some("text/event-stream"));
    }

    #[test]
    fn content_length_and_case() {
        let h = http1(b"HTTP/1.0 404 Not Found\r\ncontent-length:  12 \r\n\r\n{\"error\":1}\n");
        assert_eq!(
            (h.status, h.body, h.header_len),
            (Some(404), Body::Length(12), Some(48))
        );
    }

    #[test]
    fn chunked_wins_over_length_and_must_be_last() {
        let h = http1(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        );
        assert_eq!(h.body, Body::Chunked);
        let h = http1(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n");
        assert_eq!(h.body, Body::UntilClose);
    }

    #[test]
    fn bodyless_statuses() {
        for s in [
            "204 No Content",
            "304 Not Modified",
            "101 Switching Protocols",
        ] {
            let head = format!("HTTP/1.1 {s}\r\nContent-Length: 9\r\n\r\n");
            assert_eq!(http1(head.as_bytes()).body, Body::Empty, "{s}");
        }
    }

    #[test]
    fn interim_responses() {
        let cont = b"HTTP/1.1 100 Continue\r\n\r\n";
        assert_eq!(parse_head(cont, cont.len() as u64), Head::Interim);
        let mut both = cont.to_vec();
        both.extend_from_slice(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n");
        let n = both.len();
        both.extend_from_slice(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n");
        let h = http1(&both);
        assert_eq!(h.status, Some(201));
        assert_eq!(h.header_len, Some(both.len() as u64));
        assert!(h.header_len > Some(n as u64));
        // The capture ends right after the interim response but the send
        // went on: a final response whose head was not captured.
        assert_eq!(
            parse_head(cont, 100),
            Head::Http1(Http1Head {
                status: None,
                header_len: None,
                body: Body::UntilClose,
                content_type: None,
                trailers: false,
            })
        );
    }

    #[test]
    fn truncated_head_keeps_complete_lines() {
        let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Long: aaaa";
        let h = match parse_head(head, 4000) {
            Head::Http1(h) => h,
            other => panic!("{other:?}"),
        };
        assert_eq!((h.header_len, h.body), (None, Body::Chunked));
        let cut = b"HTTP/1.1 200 OK\r\nContent-Length: 12";
        assert_eq!(
            http1(cut).body,
            Body::UntilClose,
            "a cut line is not trusted"
        );
    }

    #[test]
    fn not_http() {
        assert_eq!(parse_head(&[0x17, 0x03, 0x03, 0x00, 0x20], 37), Head::Tls);
        assert_eq!(
            parse_head(&[0x05, 0x03, 0x03, 0x00, 0x20], 37),
            Head::Opaque
        );
        assert_eq!(parse_head(b"\x00\x00\x12\x04\x00", 99), Head::Opaque);
        assert_eq!(parse_head(b"HTTP/2 200\r\n", 12), Head::Opaque);
        assert_eq!(parse_head(b"", 10), Head::Missing);
        assert_eq!(http1(b"HTTP/1.1 2x0 Odd\r\n\r\n").status, None);
    }

    #[test]
    fn tls_records_are_told_from_other_bytes() {
        // A TLS 1.3 server flight: ServerHello, ChangeCipherSpec, then
        // encrypted handshake records, in one send.
        let mut flight = vec![22, 3, 3, 0, 90];
        flight.extend([2; 90]);
        flight.extend([20, 3, 3, 0, 1, 1]);
        flight.extend([23, 3, 3, 0, 40]);
        flight.extend([0xaa; 40]);
        let n = flight.len() as u64;
        assert_eq!(parse_head(&flight, n), Head::Tls);
        // Longer than the capture: the headers in sight are enough.
        assert_eq!(parse_head(&flight[..100], n + 3000), Head::Tls);
        // Application data alone (a connection adopted mid-life).
        assert_eq!(parse_head(&[23, 3, 3, 0, 2, 7, 7], 7), Head::Tls);
        // A record longer than the send, a bad version or type, no length:
        // not TLS.
        assert_eq!(parse_head(&[22, 3, 3, 1, 0, 2], 100), Head::Opaque);
        assert_eq!(parse_head(&[22, 3, 9, 0, 1, 2], 6), Head::Opaque);
        assert_eq!(parse_head(&[24, 3, 3, 0, 1, 2], 6), Head::Opaque);
        assert_eq!(parse_head(&[22, 3, 3, 0, 0], 5), Head::Opaque);
        // A second header in sight that is not one.
        assert_eq!(
            parse_head(&[23, 3, 3, 0, 1, 7, 0, 0, 0, 0, 0], 11),
            Head::Opaque
        );
    }

    #[test]
    fn http2_server_preface_and_h2c_upgrade() {
        // SETTINGS with two parameters, then a SETTINGS ACK, as servers send
        // them in their first send.
        let mut preface = vec![0, 0, 12, 4, 0, 0, 0, 0, 0];
        preface.extend_from_slice(&[0, 3, 0, 0, 0, 100, 0, 4, 0, 1, 0, 0]);
        preface.extend_from_slice(&[0, 0, 0, 4, 1, 0, 0, 0, 0]);
        assert_eq!(parse_head(&preface, 300), Head::Http2);
        assert_eq!(parse_head(&[0, 0, 0, 4, 0, 0, 0, 0, 0], 9), Head::Http2);
        let upgrade = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n\
                        Upgrade: h2c\r\n\r\n";
        assert_eq!(parse_head(upgrade, 200), Head::Http2);
        // Frames that do not open a connection, and other upgrades.
        for not in [
            &[0, 0, 7, 4, 0, 0, 0, 0, 0][..],  // length not a multiple of 6
            &[0, 0, 6, 4, 0, 0, 0, 0, 1][..],  // not stream 0
            &[0, 0, 6, 4, 1, 0, 0, 0, 0][..],  // an ACK with a payload
            &[0, 0, 12, 0, 1, 0, 0, 0, 1][..], // DATA
            &[0, 0, 6, 4, 0, 0, 0, 0][..],     // cut
        ] {
            assert_eq!(parse_head(not, 50), Head::Opaque, "{not:?}");
        }
        let ws = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n";
        assert_eq!(http1(ws).body, Body::Empty);
    }
}
