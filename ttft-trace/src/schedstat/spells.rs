//! One thread's scheduler spells rebuilt from its cumulative counters
//! (`--sched sampled`): the pure part, without `/proc`.
//!
//! The kernel keeps, per thread, the time it ran (`se.sum_exec_runtime`),
//! the time it waited runnable on a run queue (`sched_info.run_delay`) and
//! how often it got the CPU (`sched_info.pcount`); `/proc/PID/task/TID/
//! schedstat` shows the three. Two readings tell how much of the time
//! between them the thread ran, waited and (the rest) slept, exactly in
//! sum, but not when: spells are placed in the order a thread lives them
//! (asleep, woken and waiting, running), ending at the later reading, and
//! never before the end of the spells placed before. A wait shows only once
//! the thread gets the CPU (the kernel adds it then), so it is placed back
//! from there, however many readings it spans.
//!
//! Several switches between two readings are merged into one spell of
//! each kind; as with the exact source, which drops spells shorter than
//! the minimum, merged spells whose mean length (their sum over the
//! switches) is under it are not emitted, only summed.

use ttft_trace_common::signals::{
    EVENT_SCHED, SCHED_BLOCKED, SCHED_ONCPU, SCHED_RUNQ, SchedEvent, SchedTotals,
};

/// One reading of a thread's counters, at `t_ns` (CLOCK_MONOTONIC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reading {
    pub t_ns: u64,
    /// Time on a CPU (ns).
    pub exec_ns: u64,
    /// Time runnable on a run queue (ns).
    pub delay_ns: u64,
    /// Times it got a CPU.
    pub pcount: u64,
}

/// What one new reading added: spells to keep, and the sums for the totals.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// At most one of each kind, in time order.
    pub spells: Vec<SchedEvent>,
    pub totals: SchedTotals,
    /// The run-queue waits: (mean wait, how many).
    pub waits: Option<(u64, u64)>,
}

/// A thread's last reading and where its placed spells end.
#[derive(Debug, Clone)]
pub struct ThreadSpells {
    tgid: u32,
    tid: u32,
    last: Reading,
    /// End of the last spell placed (the first reading at first): no spell
    /// starts before it.
    placed_to: u64,
    /// Time the counters showed beyond the room between readings (a
    /// reading taken a little after its time stamp, a wait counted as
    /// sleep until the kernel added it at the arrival): taken off the next
    /// sleep, so that the sums stay the kernel's.
    debt: u64,
}

impl ThreadSpells {
    /// From a first reading: what came before it is not known.
    pub fn new(tgid: u32, tid: u32, first: Reading) -> Self {
        Self {
            tgid,
            tid,
            last: first,
            placed_to: first.t_ns,
            debt: 0,
        }
    }

    /// The spells between the last reading and `now`; spells shorter than
    /// `min_ns` (as a mean over the switches merged into them) are summed
    /// but not returned.
    pub fn advance(&mut self, now: Reading, min_ns: u64) -> Step {
        let last = self.last;
        if now.t_ns < last.t_ns
            || now.exec_ns < last.exec_ns
            || now.delay_ns < last.delay_ns
            || now.pcount < last.pcount
        {
            // Not the same thread's counters (they only grow): start over.
            *self = Self::new(self.tgid, self.tid, now);
            return Step::default();
        }
        self.last = now;
        let ran = now.exec_ns - last.exec_ns;
        let waited = now.delay_ns - last.delay_ns;
        let arrivals = now.pcount - last.pcount;
        let mut step = Step::default();
        if ran == 0 && waited == 0 && arrivals == 0 {
            // Asleep throughout, or still waiting: told when it runs.
            return step;
        }
        let t = now.t_ns;
        let from = self.placed_to.min(t);
        let switches = arrivals.max(1);
        let mut push = |what: u32, start: u64, end: u64| {
            if end > start && (end - start) / switches >= min_ns {
                step.spells.push(SchedEvent {
                    kind: EVENT_SCHED,
                    what,
                    tgid: self.tgid,
                    tid: self.tid,
                    t_start_ns: start,
                    t_end_ns: end,
                });
            }
        };
        let room = t - from;
        let blocked;
        if arrivals == 0 && waited == 0 {
            // No arrival, no wait: it was on the CPU as the period began
            // and ran on from there; what follows its run is told at its
            // next arrival (asleep, or waiting: the kernel adds a wait
            // then).
            self.debt += ran.saturating_sub(room);
            let on_end = from + ran.min(room);
            push(SCHED_ONCPU, from, on_end);
            self.placed_to = on_end;
            blocked = 0;
        } else {
            // Off the CPU at some point: the room not run nor waited is
            // sleep, less what earlier readings overran.
            let slept = room.saturating_sub(ran + waited);
            self.debt += (ran + waited).saturating_sub(room);
            blocked = slept.saturating_sub(self.debt);
            self.debt -= slept - blocked;
            if arrivals == 0 {
                // A wait without an arrival: one that ended off the CPU
                // (moved to another run queue, or a sleeper the kernel kept
                // queued and took off): ran on first, asleep, then the
                // wait up to now.
                let on_end = from + ran.min(room);
                let runq_start = t.saturating_sub(waited).max(on_end);
                push(SCHED_ONCPU, from, on_end);
                push(SCHED_BLOCKED, on_end, on_end + blocked);
                push(SCHED_RUNQ, runq_start, t);
            } else {
                // Asleep, woken and waiting, then on the CPU up to the
                // reading.
                let on_start = t - ran.min(room);
                let runq_start = on_start.saturating_sub(waited).max(from + blocked);
                push(SCHED_BLOCKED, from, from + blocked);
                push(SCHED_RUNQ, runq_start, on_start);
                push(SCHED_ONCPU, on_start, t);
            }
            self.placed_to = t;
        }
        step.totals = SchedTotals {
            oncpu_ns: ran,
            runq_ns: waited,
            runq_count: arrivals,
            blocked_ns: blocked,
        };
        step.waits = waited.checked_div(arrivals).map(|mean| (mean, arrivals));
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn r(t_ms: u64, exec_ms: u64, delay_ms: u64, pcount: u64) -> Reading {
        Reading {
            t_ns: t_ms * MS,
            exec_ns: exec_ms * MS,
            delay_ns: delay_ms * MS,
            pcount,
        }
    }

    fn spells(step: &Step) -> Vec<(u32, u64, u64)> {
        step.spells
            .iter()
            .map(|e| (e.what, e.t_start_ns / MS, e.t_end_ns / MS))
            .collect()
    }

    #[test]
    fn a_sleeper_woken_waits_then_runs_all_placed_before_the_reading() {
        let mut t = ThreadSpells::new(1, 2, r(100, 50, 5, 10));
        // Asleep: nothing to tell, at any number of readings.
        for at in [110, 120, 130] {
            assert_eq!(t.advance(r(at, 50, 5, 10), MS), Step::default());
        }
        // Woken, waited 3 ms, ran 4 ms by 140.
        let step = t.advance(r(140, 54, 8, 11), MS);
        assert_eq!(
            spells(&step),
            vec![
                (SCHED_BLOCKED, 100, 133),
                (SCHED_RUNQ, 133, 136),
                (SCHED_ONCPU, 136, 140)
            ]
        );
        assert_eq!(
            step.totals,
            SchedTotals {
                oncpu_ns: 4 * MS,
                runq_ns: 3 * MS,
                runq_count: 1,
                blocked_ns: 33 * MS
            }
        );
        assert_eq!(step.waits, Some((3 * MS, 1)));
    }

    #[test]
    fn a_long_wait_shows_at_the_arrival_and_is_placed_back_across_readings() {
        let mut t = ThreadSpells::new(1, 2, r(0, 0, 0, 0));
        t.advance(r(10, 10, 0, 0), MS);
        // Preempted at 10, waiting: the counters stand still...
        assert!(t.advance(r(20, 10, 0, 0), MS).spells.is_empty());
        assert!(t.advance(r(30, 10, 0, 0), MS).spells.is_empty());
        // ...until it runs again at 38: one 28 ms wait, not a sleep.
        let step = t.advance(r(40, 12, 28, 1), MS);
        assert_eq!(
            spells(&step),
            vec![(SCHED_RUNQ, 10, 38), (SCHED_ONCPU, 38, 40)]
        );
        assert_eq!(step.totals.blocked_ns, 0);
    }

    #[test]
    fn a_thread_on_the_cpu_throughout_runs_on_from_the_last_spell() {
        let mut t = ThreadSpells::new(1, 2, r(0, 0, 0, 1));
        assert_eq!(
            spells(&t.advance(r(10, 10, 0, 1), MS)),
            vec![(SCHED_ONCPU, 0, 10)]
        );
        // Ran 6 ms on, then slept (or waits): the run comes first...
        assert_eq!(
            spells(&t.advance(r(20, 16, 0, 1), MS)),
            vec![(SCHED_ONCPU, 10, 16)]
        );
        // ...and the sleep is told at its wakeup: 16 to 27, then 1 ms of
        // waiting and 2 ms on the CPU.
        assert_eq!(
            spells(&t.advance(r(30, 18, 1, 2), MS)),
            vec![
                (SCHED_BLOCKED, 16, 27),
                (SCHED_RUNQ, 27, 28),
                (SCHED_ONCPU, 28, 30)
            ]
        );
    }

    #[test]
    fn a_reading_that_overran_its_stamp_is_taken_off_the_next_sleep() {
        let mut t = ThreadSpells::new(1, 2, r(0, 0, 0, 0));
        // Stamped at 10, read at 11: 11 ms of run and wait in 10 ms.
        let step = t.advance(r(10, 6, 5, 1), MS);
        assert_eq!(step.totals.blocked_ns, 0);
        // The next: 10 ms, 2 of them run, 8 off (1 of it the overrun).
        let step = t.advance(r(20, 8, 5, 2), MS);
        assert_eq!(step.totals.blocked_ns, 7 * MS);
        assert_eq!(
            spells(&step),
            vec![(SCHED_BLOCKED, 10, 17), (SCHED_ONCPU, 18, 20)]
        );
    }

    #[test]
    fn many_short_spells_merged_are_summed_not_kept() {
        let mut t = ThreadSpells::new(1, 2, r(0, 0, 0, 0));
        // Ten wakeups of 0.1 ms runs and 0.05 ms waits in 10 ms.
        let step = t.advance(
            Reading {
                t_ns: 10 * MS,
                exec_ns: MS,
                delay_ns: MS / 2,
                pcount: 10,
            },
            MS,
        );
        assert!(step.spells.is_empty(), "{:?}", step.spells);
        assert_eq!(step.totals.oncpu_ns, MS);
        assert_eq!(step.totals.runq_count, 10);
        assert_eq!(step.waits, Some((MS / 20, 10)));
    }

    #[test]
    fn counters_that_go_back_start_over() {
        let mut t = ThreadSpells::new(1, 2, r(0, 100, 100, 100));
        assert_eq!(t.advance(r(10, 1, 1, 1), MS), Step::default());
        assert_eq!(
            spells(&t.advance(r(20, 3, 1, 1), MS)),
            vec![(SCHED_ONCPU, 10, 12)]
        );
        // An earlier time is refused the same way.
        assert_eq!(t.advance(r(5, 4, 1, 1), MS), Step::default());
    }

    #[test]
    fn a_wait_without_an_arrival_ends_at_the_reading_after_a_sleep() {
        let mut t = ThreadSpells::new(1, 2, r(0, 0, 0, 0));
        let step = t.advance(r(10, 0, 4, 0), MS);
        assert_eq!(
            spells(&step),
            vec![(SCHED_BLOCKED, 0, 6), (SCHED_RUNQ, 6, 10)]
        );
        assert_eq!(
            (step.totals.runq_count, step.totals.blocked_ns),
            (0, 6 * MS)
        );
        // Ran 2 ms first, then slept, then the wait.
        let step = t.advance(r(20, 2, 7, 0), MS);
        assert_eq!(
            spells(&step),
            vec![
                (SCHED_ONCPU, 10, 12),
                (SCHED_BLOCKED, 12, 17),
                (SCHED_RUNQ, 17, 20)
            ]
        );
    }
}
