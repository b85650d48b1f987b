//! Requests joined to the GPU episodes of the traced tree: which episode
//! produced the first token, how many completed while the request waited,
//! and how long the GPU sat idle before the request's work started.
//!
//! The join is by time, across every process of the tree (the HTTP server
//! and the GPU worker are often different processes), never by pid.

use std::collections::VecDeque;

use ttft_trace_common::EpisodeEvent;

use crate::signals::covered_ns;

/// One GPU episode as the join needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Episode {
    pub tgid: u32,
    pub tid: u32,
    pub t_first_launch_ns: u64,
    pub t_copy_done_ns: u64,
}

/// What the episodes say about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Join {
    /// The last episode whose D2H copy completed in `[t_arrive, t_first_token]`.
    pub episode: Option<Episode>,
    /// Episodes that completed in `[t_arrive, t_first_token]`.
    pub steps_waited: u32,
    /// Time in `[t_arrive, t_gpu_start]` covered by no episode's
    /// `[launch, D2H done]`; `None` without an episode.
    pub idle_before_start_ns: Option<u64>,
}

/// Recent episodes ordered by `t_copy_done_ns`, bounded in age and count.
pub(crate) struct EpisodeHistory {
    episodes: VecDeque<Episode>,
    keep_ns: u64,
    cap: usize,
    /// Episodes dropped because the count cap was reached.
    pub dropped: u64,
}

impl EpisodeHistory {
    pub fn new(keep_ns: u64, cap: usize) -> Self {
        Self {
            episodes: VecDeque::new(),
            keep_ns,
            cap: cap.max(1),
            dropped: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.episodes.len()
    }

    pub fn insert(&mut self, ev: &EpisodeEvent) {
        if ev.t_copy_done_ns == 0 {
            return;
        }
        if self.episodes.len() >= self.cap {
            self.episodes.pop_front();
            self.dropped += 1;
        }
        let ep = Episode {
            tgid: ev.tgid,
            tid: ev.tid,
            t_first_launch_ns: ev.t_first_launch_ns.min(ev.t_copy_done_ns),
            t_copy_done_ns: ev.t_copy_done_ns,
        };
        // Nearly always the newest; a late one from another CPU goes in place.
        let at = self
            .episodes
            .partition_point(|e| e.t_copy_done_ns <= ep.t_copy_done_ns);
        self.episodes.insert(at, ep);
    }

    /// Forgets episodes that completed more than the kept age before `now_ns`.
    pub fn prune(&mut self, now_ns: u64) {
        let cutoff = now_ns.saturating_sub(self.keep_ns);
        while self
            .episodes
            .front()
            .is_some_and(|e| e.t_copy_done_ns < cutoff)
        {
            self.episodes.pop_front();
        }
    }

    pub fn join(&self, t_arrive: u64, t_first_token: u64) -> Join {
        let lo = self
            .episodes
            .partition_point(|e| e.t_copy_done_ns < t_arrive);
        let hi = self
            .episodes
            .partition_point(|e| e.t_copy_done_ns <= t_first_token);
        let episode = (hi > lo).then(|| self.episodes[hi - 1]);
        Join {
            episode,
            steps_waited: u32::try_from(hi.saturating_sub(lo)).unwrap_or(u32::MAX),
            idle_before_start_ns: episode
                .map(|e| self.idle_between(t_arrive, e.t_first_launch_ns.max(t_arrive), lo)),
        }
    }

    /// Time in `[start, end)` not covered by any episode, looking at the
    /// episodes from index `from` on (those before it completed before `start`).
    fn idle_between(&self, start: u64, end: u64, from: usize) -> u64 {
        let mut busy: Vec<(u64, u64)> = self
            .episodes
            .range(from..)
            .filter(|e| e.t_first_launch_ns < end && e.t_copy_done_ns > start)
            .map(|e| (e.t_first_launch_ns.max(start), e.t_copy_done_ns.min(end)))
            .collect();
        (end - start) - covered_ns(&mut busy, start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn episode(tgid: u32, launch: u64, done: u64) -> EpisodeEvent {
        EpisodeEvent {
            tgid,
            tid: tgid + 1,
            t_first_launch_ns: launch,
            t_copy_done_ns: done,
            ..EpisodeEvent::default()
        }
    }

    fn history(eps: &[(u64, u64)]) -> EpisodeHistory {
        let mut h = EpisodeHistory::new(1_000_000, 100);
        for &(l, d) in eps {
            h.insert(&episode(7, l, d));
        }
        h
    }

    #[test]
    fn the_last_episode_before_the_first_token() {
        let h = history(&[(50, 90), (100, 130), (140, 170), (180, 260)]);
        let j = h.join(100, 200);
        let ep = j.episode.expect("joined");
        assert_eq!((ep.t_first_launch_ns, ep.t_copy_done_ns), (140, 170));
        assert_eq!(j.steps_waited, 2);
        // [100, 140): busy 100..130, idle 130..140.
        assert_eq!(j.idle_before_start_ns, Some(10));
    }

    #[test]
    fn nothing_in_the_window() {
        let j = history(&[(10, 20), (300, 400)]).join(100, 200);
        assert_eq!(
            j,
            Join {
                episode: None,
                steps_waited: 0,
                idle_before_start_ns: None
            }
        );
    }

    #[test]
    fn overlapping_episodes_count_once_and_late_ones_go_in_order() {
        let mut h = EpisodeHistory::new(1_000, 100);
        for (l, d) in [(0, 40), (150, 170), (20, 60), (30, 50)] {
            h.insert(&episode(1, l, d));
        }
        // Window [10, 150): busy 10..60 (three overlapping), idle 60..150.
        let j = h.join(10, 170);
        assert_eq!(j.episode.map(|e| e.t_copy_done_ns), Some(170));
        assert_eq!(j.steps_waited, 4);
        assert_eq!(j.idle_before_start_ns, Some(90));
    }

    #[test]
    fn started_before_arrival_leaves_no_idle_window() {
        let j = history(&[(50, 150)]).join(100, 200);
        assert_eq!(j.idle_before_start_ns, Some(0));
    }

    #[test]
    fn bounded_by_age_and_count() {
        let mut h = EpisodeHistory::new(100, 3);
        for i in 0..5u64 {
            h.insert(&episode(1, i * 10, i * 10 + 5));
        }
        assert_eq!((h.len(), h.dropped), (3, 2));
        h.prune(140);
        assert_eq!(
            h.len(),
            1,
            "only the one done at 45 is within 100 ns of 140"
        );
        h.insert(&episode(1, 0, 0));
        assert_eq!(h.len(), 1, "an episode without a completed copy is ignored");
    }
}
