//! HPACK decoding of the header blocks a server sends on one HTTP/2
//! connection (`ttft_trace_common::h2::H2BlockEvent`): the response's
//! `:status` and the trailers' `grpc-status` and `grpc-message`.
//!
//! HPACK is stateful: each block may refer to entries earlier blocks put
//! in the connection's dynamic table. The decoder is only trusted while it
//! has seen every block the server sent from the connection's start: a
//! connection adopted mid-life, a walk that lost its place, a HEADERS frame
//! listed without its block (the event lost, a frame header completed
//! across calls), a block longer than the capture or continued in
//! CONTINUATION frames, or any decoding error stop it for good. From then
//! on nothing is decoded: a field is unknown (`None`), never a wrong one.

use fluke_hpack::Decoder;
use ttft_trace_common::h2::{H2_END_HEADERS, H2_PADDED, H2_PRIORITY_FLAG, H2BlockEvent};

/// The dynamic table's size at most: HPACK's default, which a client
/// raises only by its `SETTINGS_HEADER_TABLE_SIZE` (gRPC's and browsers'
/// clients keep it). A server that grows its table past it stops the
/// decoder; memory stays 4 KiB of entries per connection.
const MAX_TABLE: usize = 4096;
/// `grpc-message` kept, in bytes (a hostile server's text goes to the
/// JSONL record, never to a metric label).
const MAX_MESSAGE: usize = 256;

/// What a header block said, of the fields a record keeps.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct BlockFields {
    pub status: Option<u16>,
    pub grpc_status: Option<u32>,
    pub grpc_message: Option<String>,
}

/// One connection's server-to-client decoder.
pub(crate) struct HeaderBlocks {
    /// `None` once it missed a block or failed: stopped for good.
    decoder: Option<Decoder<'static>>,
}

impl std::fmt::Debug for HeaderBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeaderBlocks")
            .field("decoding", &self.decoder.is_some())
            .finish()
    }
}

/// Stopped: see [`HeaderBlocks::new`].
impl Default for HeaderBlocks {
    fn default() -> Self {
        Self::new(false)
    }
}

impl HeaderBlocks {
    /// A decoder for a connection whose walk starts with the server's
    /// first send (`from_start`), else one stopped already.
    pub fn new(from_start: bool) -> Self {
        Self {
            decoder: from_start.then(|| {
                let mut d = Decoder::new();
                d.set_max_allowed_table_size(MAX_TABLE);
                d
            }),
        }
    }

    /// Whether blocks are still decoded.
    #[cfg(test)]
    pub fn decoding(&self) -> bool {
        self.decoder.is_some()
    }

    /// A block was missed: nothing is decoded from now on.
    pub fn missed(&mut self) {
        self.decoder = None;
    }

    /// Decodes the next block the server sent; `None` where the decoder is
    /// stopped or stops on it.
    pub fn decode(&mut self, ev: &H2BlockEvent) -> Option<BlockFields> {
        let decoder = self.decoder.as_mut()?;
        let Some(block) = fragment(ev) else {
            self.decoder = None;
            return None;
        };
        let mut fields = BlockFields::default();
        let decoded = decoder.decode_with_cb(block, |name, value| {
            let value = value.as_ref();
            match name.as_ref() {
                b":status" => fields.status = digits(value).and_then(|v| u16::try_from(v).ok()),
                b"grpc-status" => fields.grpc_status = digits(value),
                b"grpc-message" => fields.grpc_message = Some(percent_decoded(value)),
                _ => {}
            }
        });
        if decoded.is_err() {
            self.decoder = None;
            return None;
        }
        Some(fields)
    }
}

/// The header block fragment of a whole HEADERS payload that ends its
/// block (END_HEADERS): without the pad length, priority fields and
/// padding.
fn fragment(ev: &H2BlockEvent) -> Option<&[u8]> {
    if !ev.whole() || ev.flags & H2_END_HEADERS == 0 {
        return None;
    }
    let mut b = ev.bytes();
    let mut pad = 0;
    if ev.flags & H2_PADDED != 0 {
        let (&p, rest) = b.split_first()?;
        (pad, b) = (usize::from(p), rest);
    }
    if ev.flags & H2_PRIORITY_FLAG != 0 {
        b = b.get(5..)?;
    }
    b.get(..b.len().checked_sub(pad)?)
}

/// A decimal number of at most 9 digits.
fn digits(v: &[u8]) -> Option<u32> {
    if v.is_empty() || v.len() > 9 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// `grpc-message`'s percent-encoding undone (gRPC's HTTP/2 protocol
/// spec), cut to [`MAX_MESSAGE`] bytes; a malformed escape is kept as is.
fn percent_decoded(v: &[u8]) -> String {
    let mut out = Vec::with_capacity(v.len().min(MAX_MESSAGE));
    let mut i = 0;
    while i < v.len() && out.len() < MAX_MESSAGE {
        let hex = |c: u8| char::from(c).to_digit(16);
        match (v[i], v.get(i + 1).copied(), v.get(i + 2).copied()) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push(((hex(h).unwrap_or(0) << 4) | hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use fluke_hpack::Encoder;
    use ttft_trace_common::h2::{H2_BLOCK_MAX, H2_END_STREAM};

    use super::*;

    fn block(stream: u32, flags: u8, payload: &[u8]) -> H2BlockEvent {
        let mut ev = H2BlockEvent {
            stream,
            flags,
            len: payload.len() as u32,
            ..H2BlockEvent::default()
        };
        let n = payload.len().min(H2_BLOCK_MAX);
        ev.bytes[..n].copy_from_slice(&payload[..n]);
        ev.captured = n as u32;
        ev
    }

    fn encode(enc: &mut Encoder, headers: &[(&str, &str)]) -> Vec<u8> {
        enc.encode(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    /// A real encoder's blocks, in order: response headers, then trailers
    /// whose `grpc-status` the dynamic table holds after the first call.
    #[test]
    fn statuses_through_the_dynamic_table() {
        let mut enc = Encoder::new();
        let mut d = HeaderBlocks::new(true);
        let resp = [(":status", "200"), ("content-type", "application/grpc")];
        let ok = [("grpc-status", "0")];
        let failed = [
            ("grpc-status", "8"),
            ("grpc-message", "out of KV cache: 100%25 used"),
        ];
        let end = H2_END_HEADERS | H2_END_STREAM;
        for (stream, trailers) in [(1, &ok[..]), (3, &ok[..]), (5, &failed[..])] {
            let h = d.decode(&block(stream, H2_END_HEADERS, &encode(&mut enc, &resp)));
            assert_eq!(h.and_then(|f| f.status), Some(200));
            let t = d
                .decode(&block(stream, end, &encode(&mut enc, trailers)))
                .expect("decoded");
            let want = if stream == 5 { 8 } else { 0 };
            assert_eq!(t.grpc_status, Some(want));
        }
        let t = d.decode(&block(7, end, &encode(&mut enc, &failed)));
        assert_eq!(
            t.and_then(|f| f.grpc_message).as_deref(),
            Some("out of KV cache: 100% used")
        );
        // A status outside the static table, as a literal.
        let h = d.decode(&block(9, end, &encode(&mut enc, &[(":status", "503")])));
        assert_eq!(h.and_then(|f| f.status), Some(503));
    }

    /// Once a block is missed (or one cannot be decoded whole), nothing
    /// more is: a later block's index would name another entry.
    #[test]
    fn a_missed_block_stops_the_decoder_for_good() {
        let mut enc = Encoder::new();
        let mut d = HeaderBlocks::new(true);
        let _missed = encode(&mut enc, &[("grpc-status", "14")]);
        d.missed();
        let later = encode(&mut enc, &[("grpc-status", "14")]);
        assert_eq!(d.decode(&block(1, H2_END_HEADERS, &later)), None);
        assert!(!d.decoding());

        let mut late = HeaderBlocks::new(false);
        assert_eq!(late.decode(&block(1, H2_END_HEADERS, &[0x88])), None);

        let mut cut = HeaderBlocks::new(true);
        let mut ev = block(1, H2_END_HEADERS, &[0x88]);
        ev.len = 300;
        assert_eq!(cut.decode(&ev), None);
        assert!(!cut.decoding());

        let mut continued = HeaderBlocks::new(true);
        assert_eq!(continued.decode(&block(1, 0, &[0x88])), None);

        let mut garbage = HeaderBlocks::new(true);
        assert_eq!(garbage.decode(&block(1, H2_END_HEADERS, &[0xff; 12])), None);
        assert!(!garbage.decoding());
    }

    /// Padding and priority fields are not part of the block.
    #[test]
    fn padding_and_priority_are_skipped() {
        let mut d = HeaderBlocks::new(true);
        let padded = [2, 0x8d, 0, 0];
        let f = d.decode(&block(1, H2_END_HEADERS | H2_PADDED, &padded));
        assert_eq!(f.and_then(|f| f.status), Some(404));
        let prio = [0, 0, 0, 0, 16, 0x8e];
        let f = d.decode(&block(3, H2_END_HEADERS | H2_PRIORITY_FLAG, &prio));
        assert_eq!(f.and_then(|f| f.status), Some(500));
        let bad_pad = [9, 0x88];
        assert_eq!(
            d.decode(&block(5, H2_END_HEADERS | H2_PADDED, &bad_pad)),
            None
        );
    }

    /// Hostile blocks (a traced server's bytes): decoded or refused, never
    /// a panic, the table never past its bound.
    #[test]
    fn arbitrary_blocks_never_panic() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2_000 {
            let mut d = HeaderBlocks::new(true);
            for _ in 0..8 {
                let len = (next() % 129) as usize;
                let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                let _ = d.decode(&block(1, H2_END_HEADERS, &bytes));
            }
        }
        // A size update past HPACK's default is refused, not applied.
        let mut d = HeaderBlocks::new(true);
        assert_eq!(
            d.decode(&block(1, H2_END_HEADERS, &[0x3f, 0xe1, 0x7f, 0x88])),
            None
        );
    }

    #[test]
    fn messages_are_percent_decoded_and_capped() {
        assert_eq!(percent_decoded(b"a%20b%zz%4"), "a b%zz%4");
        assert_eq!(percent_decoded(&[b'x'; 1000]).len(), MAX_MESSAGE);
        assert_eq!(digits(b"14"), Some(14));
        assert_eq!(digits(b"1a"), None);
        assert_eq!(digits(b"12345678901"), None);
    }
}
