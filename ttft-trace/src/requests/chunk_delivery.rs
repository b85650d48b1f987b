//! When each response chunk reached the client (issue 31, item 2: a chunk
//! sent on time whose ACK came late). Pure: the same sequence numbers as the
//! first token's delivery ([`super::delivery`]), for every body send.
//!
//! - A chunk's last byte is `response start + bytes sent up to and including
//!   its send` (`first_token_end`); it reached the client at the first ACK
//!   whose `snd_una` passes it (modulo 2^32).
//! - TCP acknowledges cumulatively and chunks go out in order: the chunks
//!   waiting per connection form a queue, and an ACK dates a prefix of it.
//!   At most [`MAX_PENDING_CHUNKS`] wait per connection; beyond it the
//!   oldest is given up (counted: `ttft_trace_table_evictions_total{table=
//!   "chunk_acks"}`), and its request's dates stop there.
//! - After the server's close `tcp_probe` sees no more ACKs: the state change
//!   that says everything was acknowledged dates the chunks still waiting
//!   (`by close`, an upper bound, as for the first token). Without exact
//!   acknowledgment numbers, chunks sent before the last segment seen may
//!   have been acknowledged by it, unseen: those are given up.
//!
//! A request's dates are kept in order ([`ChunkDates`]); the gaps between
//! them are what `stream_stalls::find_stalls` judges on the delivery side.

use std::collections::VecDeque;

use super::delivery::seq_at_or_after;

/// Chunks waiting for their ACK per connection. A stream that sends this
/// many chunks without one ACK has stood still far longer than any stall
/// threshold; its older chunks are given up rather than held.
pub(crate) const MAX_PENDING_CHUNKS: usize = 4096;

/// ACKs remembered per connection, for a chunk registered after the ACK
/// that covers it was applied (both can fall in one socket-lock release,
/// as for the first token).
const RECENT_ACKS: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sent {
    index: u32,
    end_seq: u32,
    t_ns: u64,
}

/// What became of chunks: request `index`'s next chunk dated `Acked(t)`,
/// `ByClose(t)`, or given up (`Lost`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dated {
    Acked { index: u32, t_ns: u64 },
    ByClose { index: u32, t_ns: u64 },
    Lost { index: u32 },
}

/// Per connection: the chunks sent and not yet acknowledged, in order.
#[derive(Debug, Default)]
pub(crate) struct ChunkAcks {
    pending: VecDeque<Sent>,
    /// `(t_ns, snd_una)` of the last ACKs, oldest first.
    recent: VecDeque<(u64, u32)>,
}

impl ChunkAcks {
    /// A chunk of request `index` was sent at `t_ns`, its last byte ending
    /// at `end_seq`. Returns what it dated: itself when an ACK already seen
    /// covers it, or the oldest chunk given up to make room (`Lost`: the
    /// caller counts it).
    pub fn sent(&mut self, index: u32, end_seq: u32, t_ns: u64) -> Option<Dated> {
        if self.pending.is_empty()
            && let Some(&(t, _)) = self
                .recent
                .iter()
                .find(|(_, una)| seq_at_or_after(*una, end_seq))
        {
            return Some(Dated::Acked { index, t_ns: t });
        }
        let evicted = if self.pending.len() >= MAX_PENDING_CHUNKS {
            self.pending
                .pop_front()
                .map(|s| Dated::Lost { index: s.index })
        } else {
            None
        };
        self.pending.push_back(Sent {
            index,
            end_seq,
            t_ns,
        });
        evicted
    }

    /// An ACK at `t_ns` of every byte before `snd_una`: the chunks it
    /// covers, in order.
    pub fn acked(&mut self, t_ns: u64, snd_una: u32) -> Vec<Dated> {
        if self.recent.len() >= RECENT_ACKS {
            self.recent.pop_front();
        }
        self.recent.push_back((t_ns, snd_una));
        let mut dated = Vec::new();
        while let Some(s) = self.pending.front() {
            if !seq_at_or_after(snd_una, s.end_seq) {
                break;
            }
            dated.push(Dated::Acked {
                index: s.index,
                t_ns,
            });
            self.pending.pop_front();
        }
        dated
    }

    /// The connection closed; the last segment `tcp_probe` saw arrived at
    /// `t_last_segment`. Without exact acknowledgment numbers, chunks sent
    /// before it may have been acknowledged by it, unseen: given up (and
    /// with them every later chunk of their requests, to keep dates in
    /// order: the queue's prefix).
    pub fn closed(&mut self, t_last_segment: u64, exact: bool) -> Vec<Dated> {
        if exact {
            return Vec::new();
        }
        let unseen = self
            .pending
            .iter()
            .take_while(|s| s.t_ns < t_last_segment)
            .count();
        self.pending
            .drain(..unseen)
            .map(|s| Dated::Lost { index: s.index })
            .collect()
    }

    /// Everything sent was acknowledged by `t_ns` (a state change after the
    /// server's close): the chunks still waiting, dated by it.
    pub fn all_acked(&mut self, t_ns: u64) -> Vec<Dated> {
        self.pending
            .drain(..)
            .map(|s| Dated::ByClose {
                index: s.index,
                t_ns,
            })
            .collect()
    }

    /// The connection ended: the chunks still waiting will not be dated.
    pub fn give_up(&mut self) -> Vec<Dated> {
        self.recent.clear();
        self.pending
            .drain(..)
            .map(|s| Dated::Lost { index: s.index })
            .collect()
    }
}

/// One request's chunk deliveries, in sending order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ChunkDates {
    /// Chunks registered (sent with a known sequence number).
    pub sent: u32,
    /// When each chunk was acknowledged, the first ones first; at most `cap`.
    pub acked_ns: Vec<u64>,
    /// The position in `acked_ns` from which the dates are the close's.
    pub by_close_from: Option<usize>,
    /// A chunk was given up: it and later ones are not dated.
    pub lost: bool,
    /// Chunks dated (or given up) so far, listed or not.
    settled: u32,
    cap: usize,
}

impl ChunkDates {
    /// Dates kept for at most `cap` chunks (the request's `itl_cap` + 1).
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    pub fn on_sent(&mut self) {
        self.sent = self.sent.saturating_add(1);
    }

    /// The next chunk's fate, in order.
    pub fn on_dated(&mut self, dated: Dated) {
        self.settled = self.settled.saturating_add(1);
        let (t, by_close) = match dated {
            Dated::Acked { t_ns, .. } => (t_ns, false),
            Dated::ByClose { t_ns, .. } => (t_ns, true),
            Dated::Lost { .. } => {
                self.lost = true;
                return;
            }
        };
        if self.lost || self.acked_ns.len() >= self.cap {
            return;
        }
        if by_close && self.by_close_from.is_none() {
            self.by_close_from = Some(self.acked_ns.len());
        }
        // An ACK is never earlier than one that covered an earlier chunk;
        // an earlier ACK found in the recent ones could be, by a reorder.
        let t = self.acked_ns.last().map_or(t, |&last| t.max(last));
        self.acked_ns.push(t);
    }

    /// Chunks sent and neither acknowledged nor given up yet.
    pub fn pending(&self) -> u32 {
        self.sent.saturating_sub(self.settled)
    }

    /// The gaps between consecutive deliveries (chunk `i + 1`'s ACK after
    /// chunk `i`'s).
    pub fn gaps_ns(&self) -> Vec<u64> {
        self.acked_ns.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indices(d: &[Dated]) -> Vec<(u32, Option<u64>)> {
        d.iter()
            .map(|d| match *d {
                Dated::Acked { index, t_ns } | Dated::ByClose { index, t_ns } => {
                    (index, Some(t_ns))
                }
                Dated::Lost { index } => (index, None),
            })
            .collect()
    }

    #[test]
    fn an_ack_dates_the_chunks_it_covers_in_order() {
        let mut c = ChunkAcks::default();
        assert_eq!(c.sent(0, 100, 10), None);
        assert_eq!(c.sent(0, 150, 20), None);
        assert_eq!(c.sent(1, 200, 30), None);
        // Covers byte 149: the first two chunks (end 150 is exclusive).
        assert_eq!(indices(&c.acked(40, 150)), [(0, Some(40)), (0, Some(40))]);
        assert_eq!(indices(&c.acked(45, 199)), []);
        assert_eq!(indices(&c.acked(50, 260)), [(1, Some(50))]);
    }

    #[test]
    fn sequence_numbers_wrap() {
        let mut c = ChunkAcks::default();
        let start = u32::MAX - 10;
        c.sent(0, start.wrapping_add(5), 10);
        c.sent(0, start.wrapping_add(20), 20);
        // An ACK before the wrap covers the first only.
        assert_eq!(
            indices(&c.acked(30, start.wrapping_add(6))),
            [(0, Some(30))]
        );
        // One past it (a small number) covers the second.
        assert_eq!(start.wrapping_add(20), 9);
        assert_eq!(indices(&c.acked(40, 9)), [(0, Some(40))]);
    }

    #[test]
    fn a_chunk_already_acknowledged_is_dated_at_once() {
        let mut c = ChunkAcks::default();
        c.acked(5, 90);
        c.acked(7, 120);
        assert_eq!(c.sent(3, 100, 10), Some(Dated::Acked { index: 3, t_ns: 7 }));
        assert_eq!(c.sent(3, 130, 11), None);
    }

    #[test]
    fn pending_chunks_are_capped() {
        let mut c = ChunkAcks::default();
        for i in 0..MAX_PENDING_CHUNKS as u32 {
            assert_eq!(c.sent(i, i + 1, u64::from(i)), None);
        }
        assert_eq!(c.sent(9999, 99_999, 99_999), Some(Dated::Lost { index: 0 }));
        assert_eq!(c.pending.len(), MAX_PENDING_CHUNKS);
    }

    #[test]
    fn the_close_dates_what_is_still_waiting() {
        let mut c = ChunkAcks::default();
        c.sent(0, 100, 10);
        c.sent(0, 200, 20);
        c.acked(15, 100);
        assert_eq!(indices(&c.closed(30, true)), []);
        assert_eq!(indices(&c.all_acked(900)), [(0, Some(900))]);
        // Without exact acknowledgment numbers, a chunk sent before the last
        // segment may have been acknowledged by it: given up.
        c.sent(1, 300, 40);
        c.sent(1, 400, 60);
        assert_eq!(indices(&c.closed(50, false)), [(1, None)]);
        assert_eq!(indices(&c.all_acked(950)), [(1, Some(950))]);
        c.sent(2, 500, 70);
        assert_eq!(indices(&c.give_up()), [(2, None)]);
    }

    #[test]
    fn a_request_keeps_its_dates_in_order() {
        let mut d = ChunkDates::new(4);
        for _ in 0..6 {
            d.on_sent();
        }
        d.on_dated(Dated::Acked { index: 0, t_ns: 10 });
        d.on_dated(Dated::Acked { index: 0, t_ns: 10 });
        d.on_dated(Dated::Acked {
            index: 0,
            t_ns: 500,
        });
        assert_eq!(d.pending(), 3);
        d.on_dated(Dated::ByClose {
            index: 0,
            t_ns: 900,
        });
        d.on_dated(Dated::ByClose {
            index: 0,
            t_ns: 900,
        });
        assert_eq!(d.acked_ns, [10, 10, 500, 900], "capped at 4");
        assert_eq!(d.by_close_from, Some(3));
        assert_eq!(d.gaps_ns(), [0, 490, 400]);
        d.on_dated(Dated::Lost { index: 0 });
        assert_eq!((d.pending(), d.lost), (0, true));
    }

    #[test]
    fn dates_stop_at_a_lost_chunk() {
        let mut d = ChunkDates::new(16);
        for _ in 0..3 {
            d.on_sent();
        }
        d.on_dated(Dated::Acked { index: 0, t_ns: 10 });
        d.on_dated(Dated::Lost { index: 0 });
        d.on_dated(Dated::Acked { index: 0, t_ns: 30 });
        assert_eq!(
            (d.acked_ns.as_slice(), d.lost, d.pending()),
            (&[10][..], true, 0)
        );
    }
}
