//! Reading the daemon's JSONL (its lines are defined in `jsonl_schema`):
//! request lines kept in the compact form the report needs, everything
//! else counted. A line that is not JSON, lacks a request's required
//! fields or is longer than [`LINE_CAP`] is skipped and counted, never
//! fatal: the file may be cut mid-line by a crash, or rotated.

use std::io::{self, BufRead};

use serde_json::Value;

use crate::jsonl_schema::{Request, kind};

/// The longest line read. A request line is a few KiB; its ITL list is
/// capped by the tracer (`itl_truncated`), so 1 MiB is far beyond any real
/// line and bounds what one broken line can cost.
pub const LINE_CAP: usize = 1 << 20;

/// What the report makes of a request line.
impl Request {
    /// Whether the TTFT, its breakdown and ITL count, as
    /// `RequestRecord::observations` decides: the response started
    /// normally, whether or not it ended.
    pub fn first_token_counts(&self) -> bool {
        matches!(
            self.outcome.as_str(),
            "ok" | "closed_mid_response" | "reset" | "in_flight_at_exit"
        )
    }

    /// Whether E2E and TPOT count: a whole response below 400.
    pub fn whole(&self) -> bool {
        self.outcome == "ok"
    }

    /// The TTFT that enters the figures, if any.
    pub fn counted_ttft_ns(&self) -> Option<u64> {
        self.ttft_ns.filter(|_| self.first_token_counts())
    }
}

/// What was read, line by line; the requests go to the caller as they come,
/// so that memory does not grow with the file.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Lines {
    pub requests: u64,
    pub episodes: u64,
    /// The last `totals` line (a file appended by several runs has several).
    pub totals: Option<Value>,
    pub totals_lines: u64,
    /// Lines of a type the report does not read (`attach`, newer kinds).
    pub other: u64,
    /// Lines that were not JSON objects, or request lines missing fields.
    pub bad: u64,
    /// Lines longer than [`LINE_CAP`], skipped unread.
    pub too_long: u64,
    /// The first bad line's number and why, for the message.
    pub first_bad: Option<(u64, String)>,
}

impl Lines {
    /// Reads every line of `input`, handing each request line to
    /// `request`; only an I/O error fails.
    pub fn read(input: impl BufRead, mut request: impl FnMut(Request)) -> io::Result<Self> {
        let mut lines = Self::default();
        let mut number = 0u64;
        for_each_line(input, LINE_CAP, |line| {
            number += 1;
            match line {
                Line::TooLong => lines.too_long += 1,
                Line::Text(text) => lines.add(number, text, &mut request),
            }
        })?;
        Ok(lines)
    }

    fn add(&mut self, number: u64, text: &[u8], request: &mut impl FnMut(Request)) {
        if text.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        let value: Value = match serde_json::from_slice(text) {
            Ok(v) => v,
            Err(e) => return self.failed(number, e.to_string()),
        };
        match value.get("type").and_then(Value::as_str) {
            Some(kind::REQUEST) => match serde_json::from_value::<Request>(value) {
                Ok(r) => {
                    self.requests += 1;
                    request(r);
                }
                Err(e) => self.failed(number, format!("request line: {e}")),
            },
            Some(kind::EPISODE) => self.episodes += 1,
            Some(kind::TOTALS) => {
                self.totals_lines += 1;
                self.totals = Some(value);
            }
            Some(_) => self.other += 1,
            None => self.failed(number, "no \"type\"".into()),
        }
    }

    fn failed(&mut self, number: u64, why: String) {
        self.bad += 1;
        self.first_bad.get_or_insert((number, why));
    }
}

enum Line<'a> {
    Text(&'a [u8]),
    TooLong,
}

/// Calls `f` with each line of `input` (without its newline), or
/// [`Line::TooLong`] for one over `cap` bytes, whose rest is skipped without
/// being held: memory stays within `cap` whatever the file holds.
fn for_each_line(mut input: impl BufRead, cap: usize, mut f: impl FnMut(Line)) -> io::Result<()> {
    let mut line = Vec::new();
    let mut skipping = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            // The last line may lack its newline (a file cut mid-write).
            if skipping {
                f(Line::TooLong);
            } else if !line.is_empty() {
                f(Line::Text(&line));
            }
            return Ok(());
        }
        let (chunk, ended) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        if !skipping {
            if line.len() + chunk.len() > cap {
                skipping = true;
                line.clear();
            } else {
                line.extend_from_slice(chunk);
            }
        }
        let used = ended.unwrap_or(buf.len());
        input.consume(used);
        if ended.is_some() {
            if skipping {
                f(Line::TooLong);
            } else {
                f(Line::Text(&line));
            }
            line.clear();
            skipping = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(input: &[u8], cap: usize) -> Vec<Option<String>> {
        let mut out = Vec::new();
        for_each_line(io::BufReader::with_capacity(4, input), cap, |l| {
            out.push(match l {
                Line::Text(t) => Some(String::from_utf8_lossy(t).into_owned()),
                Line::TooLong => None,
            })
        })
        .expect("reads");
        out
    }

    #[test]
    fn long_lines_are_skipped_whole_and_a_missing_last_newline_is_fine() {
        let got = lines_of(b"ab\n0123456789\ncd\nef", 5);
        assert_eq!(
            got,
            [
                Some("ab".into()),
                None,
                Some("cd".into()),
                Some("ef".into())
            ]
        );
        assert_eq!(lines_of(b"0123456789", 5), [None]);
        assert_eq!(lines_of(b"", 5), Vec::<Option<String>>::new());
        assert_eq!(lines_of(b"12345\n", 5), [Some("12345".into())]);
    }

    #[test]
    fn bad_and_unknown_lines_are_counted_not_fatal() {
        let text = concat!(
            "{\"type\":\"attach\",\"library\":\"x\"}\n",
            "not json\n",
            "{\"type\":\"request\",\"pid\":1}\n",
            "\n",
            "{\"type\":\"episode\",\"pid\":1}\n",
            "[1,2]\n",
            "{\"type\":\"request\",\"pid\":1,\"t_arrive_ns\":5,\"outcome\":\"ok\",\"ttft_ns\":7}\n",
            "{\"type\":\"future_kind\"}\n",
            "{\"type\":\"totals\",\"requests\":1}\n",
            "{\"type\":\"request\",\"pid\":1,\"t_arrive_ns\":5,\"outcome\":\"ok\",\"ttft_ns\":\"7\"}\n",
        );
        let mut requests = Vec::new();
        let l = Lines::read(text.as_bytes(), |r| requests.push(r)).expect("reads");
        assert_eq!(l.requests, 1);
        assert_eq!(requests.len(), 1);
        assert_eq!(requests[0].ttft_ns, Some(7));
        assert_eq!(l.episodes, 1);
        assert_eq!(l.totals_lines, 1);
        assert_eq!(l.other, 2, "attach and the unknown kind");
        assert_eq!(
            l.bad, 4,
            "not JSON, a request without its fields, an array, a wrong type"
        );
        assert_eq!(l.first_bad.as_ref().map(|b| b.0), Some(2));
    }
}
