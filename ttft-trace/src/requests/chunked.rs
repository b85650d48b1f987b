//! The chunked transfer coding (RFC 9112 §7.1), decoded incrementally
//! over what the kernel captured of each send.
//!
//! A send is seen as its captured head, a gap of bytes not captured, and
//! its captured tail ([`View`]). While every byte of the body has been seen,
//! or the bytes not seen lie inside chunk data whose size was read (skipped
//! by length), the decoder knows exactly where it is: chunk-size lines,
//! extensions, data, trailers and the final CRLF may be split across sends
//! at any byte. A gap that covers anything but chunk data loses the
//! position; the decoder is then *lost* and falls back on two checks,
//! both at the end of a send:
//!
//! - a send seen whole that reads as the start of a chunk (a complete
//!   chunk-size line first), or as the CRLF that ends a chunk's data and
//!   what follows it, is taken to start there: the decoder is in step
//!   again (the zero-size chunk and the final CRLF sent apart, a size line
//!   or a CRLF sent alone, are seen this way);
//! - the bytes seen last, contiguous across sends, ending with the CRLF of
//!   a chunk then the zero-size chunk and the final CRLF (trailer lines
//!   included when they are seen) end the body.
//!
//! While lost, every send is taken as carrying chunk data unless those
//! checks show it is framing only.
//!
//! The kernel captures a vectored send's tail across its last few buffers
//! (`TAIL_BUFFERS`): a tail shorter than [`TAIL_BYTES`] on a longer send
//! starts at a buffer's start (those buffers ran out, or the one before
//! faulted). Such a tail that reads alone as the body's end (the zero-size
//! chunk through the final CRLF) ends the body, with what came before it
//! unseen: hyper writes each chunk as `size`, data, `\r\n`, and the end as
//! a buffer `0\r\n\r\n` of its own in the same `writev`.

use ttft_trace_common::event::TAIL_BYTES;

/// Most bytes kept of the stream's end for the lost decoder's check.
const RECENT_BYTES: usize = 64;

/// The last bytes of a stream, contiguous up to now: a send's bytes not
/// seen start it again from the bytes seen after them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recent {
    bytes: Vec<u8>,
}

impl Recent {
    /// Adds `view` (the next send's part of the stream), keeping at most
    /// the last `cap` bytes.
    pub fn remember(&mut self, view: View, cap: usize) {
        self.bytes.extend_from_slice(view.first);
        if view.gap > 0 {
            self.bytes.clear();
        }
        self.bytes.extend_from_slice(view.last);
        let excess = self.bytes.len().saturating_sub(cap);
        self.bytes.drain(..excess);
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// What was captured of one send's part of the body: bytes seen, bytes not
/// seen, bytes seen (any of the three may be empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct View<'a> {
    pub first: &'a [u8],
    pub gap: u64,
    pub last: &'a [u8],
    /// `last` starts at a buffer's start in a vectored send, after bytes
    /// not seen (so a chunk boundary may fall right before it).
    pub last_is_buffer: bool,
}

impl<'a> View<'a> {
    /// A send of `bytes` bytes whose first `head` and last `tail` bytes were
    /// captured (either may be empty).
    pub fn of_send(bytes: u64, head: &'a [u8], tail: &'a [u8]) -> Self {
        let (h, t) = (head.len() as u64, tail.len() as u64);
        if h + t >= bytes {
            // Head and tail overlap or meet: the whole send is seen.
            let overlap = usize::try_from(h + t - bytes).unwrap_or(usize::MAX);
            Self {
                first: head,
                gap: 0,
                last: tail.get(overlap..).unwrap_or_default(),
                last_is_buffer: false,
            }
        } else {
            Self {
                first: head,
                gap: bytes - h - t,
                last: tail,
                // Shorter than it could be, the tail the probe gathered
                // starts at a buffer's start (0 is a fault, not a buffer).
                last_is_buffer: t > 0 && t < TAIL_BYTES as u64,
            }
        }
    }

    /// The view without its first `n` bytes.
    pub fn skip(self, n: u64) -> Self {
        let first_len = self.first.len() as u64;
        if n <= first_len {
            return Self {
                first: &self.first[n as usize..],
                ..self
            };
        }
        let n = n - first_len;
        if n <= self.gap {
            return Self {
                first: &[],
                gap: self.gap - n,
                ..self
            };
        }
        let n = usize::try_from(n - self.gap).unwrap_or(usize::MAX);
        Self {
            first: &[],
            gap: 0,
            last: self.last.get(n..).unwrap_or_default(),
            last_is_buffer: false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_empty() && self.gap == 0 && self.last.is_empty()
    }

    fn len(&self) -> u64 {
        self.first.len() as u64 + self.gap + self.last.len() as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a chunk-size line's hex digits.
    Size {
        size: u64,
        digits: u8,
    },
    /// In a chunk extension (`;name=value`), up to the CR.
    Ext {
        size: u64,
    },
    /// After the size line's CR.
    SizeLf {
        size: u64,
    },
    Data {
        left: u64,
    },
    /// After a chunk's data: its CRLF.
    DataCr,
    DataLf,
    /// After the zero-size chunk: at the start of a trailer line or of the
    /// final CRLF.
    LineStart,
    TrailerLine,
    /// After the final CR.
    EndLf,
    Done,
    Lost,
}

/// A chunked body's decoder.
#[derive(Debug, Clone)]
pub(crate) struct Chunked {
    state: State,
    /// The stream's last bytes, contiguous up to now.
    recent: Recent,
    /// A send ended on bytes not seen while lost: its end may have been
    /// missed.
    blind: bool,
    /// In step again by a guess (see [`Chunked::resync`]), not by reading.
    guessed: bool,
}

impl Chunked {
    /// A decoder at the start of the body.
    pub fn new() -> Self {
        Self::at(State::Size { size: 0, digits: 0 })
    }

    /// A decoder that does not know where in the body it is (the header
    /// block's end was not captured).
    pub fn lost() -> Self {
        Self::at(State::Lost)
    }

    fn at(state: State) -> Self {
        Self {
            state,
            recent: Recent::default(),
            blind: false,
            guessed: false,
        }
    }

    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Whether the decoder knows where in the body it is (from every byte
    /// since the body began, or from chunk sizes).
    pub fn in_step(&self) -> bool {
        self.state != State::Lost && !self.guessed
    }

    /// Lost, and a send's end was not seen: the body may have ended unseen.
    pub fn blind(&self) -> bool {
        self.blind && self.state == State::Lost
    }

    /// Feeds one send's part of the body; returns whether it carries chunk
    /// data (a token), as opposed to framing only.
    pub fn on_send(&mut self, view: View) -> bool {
        if view.is_empty() || self.done() {
            return false;
        }
        let lost_before = self.state == State::Lost;
        let data = if lost_before { 0 } else { self.decode(view) };
        self.remember(view);
        if self.done() || (self.state != State::Lost && !self.guessed) {
            return data > 0;
        }
        // Lost, or in step by a guess only: the end of the stream seen so far
        // may close the body.
        if let Some(framing_only) = self.final_chunk(view) {
            self.state = State::Done;
            return !framing_only;
        }
        if self.state != State::Lost {
            return data > 0;
        }
        if lost_before && let Some(data) = self.resync(view) {
            self.guessed = true;
            return data;
        }
        if view.last.is_empty() {
            self.blind = true;
        }
        true
    }

    /// Decodes a view in step; returns the chunk-data bytes in it.
    fn decode(&mut self, view: View) -> u64 {
        let mut data = self.feed(view.first);
        data += self.skip(view.gap);
        data + self.feed(view.last)
    }

    /// Whether the stream seen so far ends with the body's end; if so,
    /// whether this send is framing only (every byte of it in the final
    /// chunk, with the previous chunk's CRLF).
    fn final_chunk(&self, view: View) -> Option<bool> {
        if view.last.is_empty() {
            return None;
        }
        if let Some(start) = final_chunk_at(self.recent.bytes()) {
            let seen = self.recent.bytes().len() - start;
            return Some(view.gap == 0 && view.len() <= seen as u64);
        }
        // The end in a buffer of its own (module docs): framing only when
        // the bytes not seen before it can only be the previous chunk's
        // CRLF (the smallest chunk with data is 6 bytes).
        (view.last_is_buffer && ends_at_done(view.last)).then_some(view.gap <= 2)
    }

    /// A send seen whole, read as starting at a chunk boundary (or at the
    /// CRLF after a chunk's data): if it reads so through a whole size line
    /// (or that CRLF), the decoder is in step again. Returns whether it
    /// carries data, or `None` when it does not read so.
    fn resync(&mut self, view: View) -> Option<bool> {
        if view.gap > 0 {
            return None;
        }
        let bytes = || view.first.iter().chain(view.last).copied();
        let (state, data) = read_from(State::Size { size: 0, digits: 0 }, bytes())
            .or_else(|| read_from(State::DataCr, bytes()))?;
        self.state = state;
        Some(data > 0)
    }

    fn remember(&mut self, view: View) {
        self.recent.remember(view, RECENT_BYTES);
    }

    /// Skips bytes not seen: exact inside chunk data, lost anywhere else.
    fn skip(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        match self.state {
            State::Data { left } if n <= left => {
                self.state = if n == left {
                    State::DataCr
                } else {
                    State::Data { left: left - n }
                };
                n
            }
            State::Data { left } => {
                self.state = State::Lost;
                left
            }
            State::Done => 0,
            _ => {
                self.state = State::Lost;
                0
            }
        }
    }

    /// Feeds bytes seen; returns the chunk-data bytes among them.
    fn feed(&mut self, mut bytes: &[u8]) -> u64 {
        let mut data = 0;
        while let Some((&b, rest)) = bytes.split_first() {
            if let State::Data { left } = self.state {
                let n = left.min(bytes.len() as u64);
                self.state = if n == left {
                    State::DataCr
                } else {
                    State::Data { left: left - n }
                };
                data += n;
                bytes = &bytes[n as usize..];
                continue;
            }
            if matches!(self.state, State::Lost | State::Done) {
                break;
            }
            self.state = step(self.state, b);
            bytes = rest;
        }
        data
    }
}

/// Reads `bytes` from `start`: the state reached and the chunk-data bytes
/// read, if they read as chunked framing past the line `start` is in, with
/// no byte after the end of the body.
fn read_from(start: State, bytes: impl Iterator<Item = u8>) -> Option<(State, u64)> {
    let mut trial = Chunked::at(start);
    let mut data = 0;
    let mut past_line = false;
    for b in bytes {
        if matches!(trial.state, State::Done | State::Lost) {
            return None;
        }
        data += trial.feed(&[b]);
        past_line |= !matches!(
            trial.state,
            State::Size { .. } | State::Ext { .. } | State::SizeLf { .. } | State::DataLf
        ) || (start == State::DataCr && matches!(trial.state, State::Size { .. }));
    }
    (past_line && trial.state != State::Lost).then_some((trial.state, data))
}

/// One byte of framing (not chunk data).
fn step(state: State, b: u8) -> State {
    use State::*;
    match (state, b) {
        (Size { size, digits }, _) if b.is_ascii_hexdigit() => {
            // More than 16 hex digits overflow u64: no real server sends it.
            if digits >= 16 {
                return Lost;
            }
            let v = (b as char).to_digit(16).map_or(0, u64::from);
            Size {
                size: size << 4 | v,
                digits: digits + 1,
            }
        }
        (Size { digits: 0, .. }, _) => Lost,
        (Size { size, .. }, b';' | b' ' | b'\t') => Ext { size },
        (Size { size, .. } | Ext { size }, b'\r') => SizeLf { size },
        (Size { size, .. } | Ext { size } | SizeLf { size }, b'\n') => after_size_line(size),
        (Size { .. } | SizeLf { .. }, _) => Lost,
        (Ext { size }, _) => Ext { size },
        (DataCr, b'\r') => DataLf,
        (DataCr | DataLf, b'\n') => Size { size: 0, digits: 0 },
        (DataCr | DataLf, _) => Lost,
        (LineStart, b'\r') => EndLf,
        (LineStart | EndLf, b'\n') => Done,
        (EndLf, _) => Lost,
        (TrailerLine, b'\n') => LineStart,
        (LineStart | TrailerLine, _) => TrailerLine,
        (Data { .. } | Done | Lost, _) => state,
    }
}

fn after_size_line(size: u64) -> State {
    if size == 0 {
        State::LineStart
    } else {
        State::Data { left: size }
    }
}

/// Where the body's end begins in `recent` (the CRLF of the last data chunk,
/// then the zero-size chunk, trailers and the final CRLF, ending exactly at
/// the end), if it ends so.
fn final_chunk_at(recent: &[u8]) -> Option<usize> {
    (0..recent.len()).find(|&p| recent[p..].starts_with(b"\r\n0") && ends_at_done(&recent[p + 2..]))
}

/// Whether decoding `bytes` from a chunk boundary reaches the end of the
/// body on their last byte (not before).
fn ends_at_done(bytes: &[u8]) -> bool {
    let Some((last, before)) = bytes.split_last() else {
        return false;
    };
    let mut trial = Chunked::new();
    trial.feed(before);
    if trial.done() {
        return false;
    }
    trial.feed(std::slice::from_ref(last));
    trial.done()
}

/// Whether one send, seen alone, ends a chunked body (for a send that is
/// not followed as a response).
pub(crate) fn send_ends_body(view: View) -> bool {
    let mut c = Chunked::lost();
    c.on_send(view);
    c.done()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(b: &[u8]) -> View<'_> {
        View {
            first: b,
            gap: 0,
            last: &[],
            last_is_buffer: false,
        }
    }

    /// A lost decoder fed `tail` as the end of a send of `bytes`.
    fn lost_then(bytes: u64, tail: &[u8]) -> (bool, Chunked) {
        let mut c = Chunked::lost();
        let data = c.on_send(View::of_send(bytes, b"", tail));
        (data, c)
    }

    #[test]
    fn views_of_a_send() {
        let v = View::of_send(10, b"abcdef", b"efghij");
        assert_eq!((v.first, v.gap, v.last), (&b"abcdef"[..], 0, &b"ghij"[..]));
        let v = View::of_send(100, b"abc", b"xyz");
        assert_eq!((v.gap, v.len()), (94, 100));
        let v = v.skip(5);
        assert_eq!((v.first, v.gap, v.last), (&b""[..], 92, &b"xyz"[..]));
        assert_eq!(v.skip(93).last, b"yz");
        assert!(View::of_send(3, b"", b"abc").skip(3).is_empty());
    }

    #[test]
    fn a_body_byte_by_byte() {
        // Extensions, a chunk, the zero-size chunk with trailers: one byte
        // per send, every byte seen.
        let body = b"5;a=\"b\"\r\nhello\r\n0;last\r\nx-usage: 42\r\nx-b: c\r\n\r\n";
        let mut c = Chunked::new();
        let data: Vec<bool> = body
            .iter()
            .map(|b| c.on_send(seen(std::slice::from_ref(b))))
            .collect();
        assert!(c.done());
        let at = body.iter().position(|&b| b == b'h').expect("data");
        let want: Vec<bool> = (0..body.len()).map(|i| (at..at + 5).contains(&i)).collect();
        assert_eq!(data, want);
    }

    #[test]
    fn malformed_framing_loses_the_position() {
        for bad in [
            &b"x\r\n"[..],
            b"\r\n",
            b"5\r\nhello!!",
            b"5\rx",
            b"11111111111111111\r\n",
        ] {
            let mut c = Chunked::new();
            c.on_send(seen(bad));
            assert!(!c.in_step(), "{bad:?}");
        }
    }

    #[test]
    fn lost_then_the_end_in_pieces() {
        // Lost (a size line not seen), then the end in two sends as issue
        // 13's server writes it: in step again at `0\r\n`.
        let mut c = Chunked::new();
        assert!(c.on_send(View {
            first: b"",
            gap: 40,
            last: b"}\n\n\r\n",
            last_is_buffer: false,
        }));
        assert!(!c.in_step());
        assert!(!c.on_send(seen(b"0\r\n")), "framing only");
        assert!(!c.done() && !c.in_step(), "a guess is not in step");
        assert!(!c.on_send(seen(b"\r\n")));
        assert!(c.done());
        // The end split inside the previous chunk's CRLF: read from the
        // stream's last bytes.
        let mut c = Chunked::lost();
        assert!(c.on_send(View {
            first: b"",
            gap: 40,
            last: b"]}\n\n\r",
            last_is_buffer: false,
        }));
        assert!(!c.on_send(seen(b"\n0\r\n\r\n")));
        assert!(c.done());
        // Data that only ends like a CRLF is not the end.
        let mut c = Chunked::lost();
        c.on_send(View {
            first: b"",
            gap: 40,
            last: b"\r\n\r\n\r\n",
            last_is_buffer: false,
        });
        assert!(!c.done());
    }

    #[test]
    fn a_send_ending_unseen_while_lost_blinds() {
        let mut c = Chunked::lost();
        c.on_send(View {
            first: b"3\r\n",
            gap: 40,
            last: b"",
            last_is_buffer: false,
        });
        assert!(c.blind());
        // In step, a gap inside chunk data is skipped by length.
        let mut c = Chunked::new();
        assert!(c.on_send(View {
            first: b"30\r\nab",
            gap: 46,
            last: b"",
            last_is_buffer: false,
        }));
        assert!(c.in_step() && !c.blind());
        assert!(!c.on_send(seen(b"\r\n0\r\n\r\n")));
        assert!(c.done());
    }

    #[test]
    fn one_send_alone() {
        assert!(send_ends_body(View::of_send(99, b"", b"\r\n0\r\n\r\n")));
        assert!(send_ends_body(seen(b"0\r\n\r\n")));
        assert!(
            !send_ends_body(View::of_send(99, b"", b"abc0\r\n\r\n")),
            "needs the CRLF before"
        );
        assert!(!send_ends_body(View::of_send(30, b"", b"\n\n\r\n")));
        assert!(!send_ends_body(View::of_send(30, b"", b"")));
    }

    #[test]
    fn the_end_in_the_last_buffer_of_a_vectored_send() {
        // hyper: the last chunk (size, data, CRLF) and `0\r\n\r\n` in one
        // writev; the probe captured the last buffer only.
        let (data, c) = lost_then(171, b"0\r\n\r\n");
        assert!(data && c.done(), "carries the last token, ends the body");
        // The previous chunk's CRLF and the end in one writev: framing only.
        let (data, c) = lost_then(7, b"0\r\n\r\n");
        assert!(!data && c.done());
        // A last buffer that is only a chunk's CRLF, or a zero-size chunk
        // still missing its final CRLF, is not the end.
        assert!(!lost_then(148, b"\r\n").1.done());
        assert!(!lost_then(148, b"0\r\n").1.done());
        // A full-length tail is no buffer of its own: the CRLF before the
        // zero-size chunk is still needed.
        assert!(!lost_then(148, b"abc0\r\n\r\n").1.done());
        // The decoder in step reads the same send exactly.
        let mut c = Chunked::new();
        assert!(c.on_send(View::of_send(148, b"8E\r\n", b"\r\n")));
        assert!(c.in_step());
        assert!(c.on_send(View::of_send(171, b"", b"0\r\n\r\n")));
        assert!(c.done());
    }
}
