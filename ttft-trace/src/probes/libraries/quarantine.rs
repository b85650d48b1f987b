//! Targets whose reads did not return in time, set aside: while the read
//! that stalled on them has not returned (so that one target holds at most
//! one stuck thread), then with backoff, so that a target that stalls again
//! costs the event loop at most one deadline per period.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use crate::workloads::quota::Tenant;

/// The first time a target is set aside, and the longest.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Most targets set aside at once; past that, a new one is not (it is
/// counted, and read again at its next scan).
pub const QUARANTINE_MAX: usize = 4096;

/// What is set aside: a process (its /proc files) or a mapped file (by
/// device and inode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Process(u32),
    File(u64, u64),
}

#[derive(Debug, Clone, Copy)]
struct Backoff {
    until: Instant,
    delay: Duration,
}

/// A read abandoned on its thread, what it was reading, and for whom.
#[derive(Debug)]
struct StuckRead {
    targets: Vec<Target>,
    /// The process's tenant (pod, else cgroup), when it could be read.
    tenant: Option<Tenant>,
    /// Set by the read's thread when it returns.
    returned: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
pub struct Quarantine {
    held: HashMap<Target, Backoff>,
    stuck: Vec<StuckRead>,
    /// Targets not set aside because the table was full.
    pub overflowed: u64,
}

impl Quarantine {
    /// Whether `target` is set aside at `now`: a read of it is stuck, or
    /// its backoff runs.
    pub fn holds(&mut self, target: Target, now: Instant) -> bool {
        self.stuck.retain(|s| !s.returned.load(Ordering::SeqCst));
        self.stuck.iter().any(|s| s.targets.contains(&target))
            || self.held.get(&target).is_some_and(|b| now < b.until)
    }

    /// Sets `targets` aside until `returned` is set (by the stuck read's
    /// thread), then for their backoff; the read counts toward `tenant`'s
    /// stuck reads meanwhile. At most [`QUARANTINE_MAX`] reads (the threads
    /// stuck are far fewer: see `TargetWork`).
    pub fn add_stuck(
        &mut self,
        targets: Vec<Target>,
        tenant: Option<Tenant>,
        returned: Arc<AtomicBool>,
    ) {
        self.stuck.retain(|s| !s.returned.load(Ordering::SeqCst));
        if self.stuck.len() >= QUARANTINE_MAX {
            self.overflowed += 1;
            return;
        }
        self.stuck.push(StuckRead {
            targets,
            tenant,
            returned,
        });
    }

    /// The tenants whose reads stuck now are `n` or more.
    pub fn tenants_holding(&mut self, n: usize) -> BTreeSet<Tenant> {
        self.stuck.retain(|s| !s.returned.load(Ordering::SeqCst));
        let mut held: HashMap<&Tenant, usize> = HashMap::new();
        for t in self.stuck.iter().filter_map(|s| s.tenant.as_ref()) {
            *held.entry(t).or_default() += 1;
        }
        held.into_iter()
            .filter(|&(_, h)| h >= n)
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// The reads of `tenant`'s processes stuck now.
    pub fn stuck_of(&self, tenant: &Tenant) -> usize {
        self.stuck
            .iter()
            .filter(|s| !s.returned.load(Ordering::SeqCst) && s.tenant.as_ref() == Some(tenant))
            .count()
    }

    /// Sets `target` aside from `now`, for twice as long as the last time
    /// (if that was recent), from 1 s up to 60 s. Returns for how long.
    pub fn add(&mut self, target: Target, now: Instant) -> Duration {
        if !self.held.contains_key(&target) && self.held.len() >= QUARANTINE_MAX {
            // Forget what has long been free to go before refusing.
            self.held
                .retain(|_, b| now.saturating_duration_since(b.until) < MAX_BACKOFF);
            if self.held.len() >= QUARANTINE_MAX {
                self.overflowed += 1;
                return Duration::ZERO;
            }
        }
        let delay = match self.held.get(&target) {
            // Stalled again soon after its last release: longer.
            Some(b) if now.saturating_duration_since(b.until) < MAX_BACKOFF => {
                (b.delay * 2).min(MAX_BACKOFF)
            }
            _ => FIRST_BACKOFF,
        };
        self.held.insert(
            target,
            Backoff {
                until: now + delay,
                delay,
            },
        );
        delay
    }

    /// Targets set aside now or lately, and reads stuck (for a gauge).
    pub fn held(&self) -> usize {
        self.held.len() + self.stuck.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_set_aside_with_backoff_that_doubles_up_to_a_minute() {
        let mut q = Quarantine::default();
        let t0 = Instant::now();
        let p = Target::Process(7);
        assert!(!q.holds(p, t0));
        assert_eq!(q.add(p, t0), FIRST_BACKOFF);
        assert!(q.holds(p, t0 + Duration::from_millis(999)));
        assert!(!q.holds(p, t0 + FIRST_BACKOFF));
        assert!(!q.holds(Target::File(1, 2), t0), "only what was added");
        // Stalled again at each release: 2, 4, ... 60 s.
        let mut at = t0 + FIRST_BACKOFF;
        let mut delays = Vec::new();
        for _ in 0..8 {
            let d = q.add(p, at);
            delays.push(d.as_secs());
            at += d;
        }
        assert_eq!(delays, vec![2, 4, 8, 16, 32, 60, 60, 60]);
        // Well after its release, it starts over.
        assert_eq!(q.add(p, at + MAX_BACKOFF * 2), FIRST_BACKOFF);
    }

    #[test]
    fn a_target_whose_read_is_stuck_is_held_until_the_read_returns() {
        let mut q = Quarantine::default();
        let t0 = Instant::now();
        let returned = Arc::new(AtomicBool::new(false));
        let (p, f) = (Target::Process(9), Target::File(3, 4));
        q.add(p, t0);
        q.add(f, t0);
        q.add_stuck(vec![p, f], None, returned.clone());
        // Past the backoff, still held: the read has not returned.
        let later = t0 + MAX_BACKOFF * 10;
        assert!(q.holds(p, later) && q.holds(f, later));
        assert!(!q.holds(Target::Process(10), later));
        returned.store(true, Ordering::SeqCst);
        assert!(!q.holds(p, later) && !q.holds(f, later));
        assert_eq!(q.stuck.len(), 0);
    }

    #[test]
    fn the_table_is_bounded_and_what_it_cannot_hold_is_counted() {
        let mut q = Quarantine::default();
        let t0 = Instant::now();
        for pid in 0..QUARANTINE_MAX as u32 {
            q.add(Target::Process(pid), t0);
        }
        assert_eq!(q.add(Target::File(1, 1), t0), Duration::ZERO);
        assert_eq!(q.overflowed, 1);
        assert_eq!(q.held(), QUARANTINE_MAX);
        // Once those have long been released, a new one fits.
        let later = t0 + FIRST_BACKOFF + MAX_BACKOFF;
        assert_eq!(q.add(Target::File(1, 1), later), FIRST_BACKOFF);
        assert_eq!(q.held(), 1);
    }

    #[test]
    fn stuck_reads_are_counted_by_tenant_while_they_are_stuck() {
        let mut q = Quarantine::default();
        let (a, b) = (Tenant::Pod("a".into()), Tenant::Pod("b".into()));
        assert!(q.tenants_holding(1).is_empty());
        let reads: Vec<_> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
        q.add_stuck(vec![Target::Process(1)], Some(a.clone()), reads[0].clone());
        q.add_stuck(vec![Target::Process(2)], Some(a.clone()), reads[1].clone());
        q.add_stuck(vec![Target::Process(3)], Some(b.clone()), reads[2].clone());
        q.add_stuck(
            vec![Target::Process(4)],
            None,
            Arc::new(AtomicBool::new(false)),
        );
        assert_eq!((q.stuck_of(&a), q.stuck_of(&b)), (2, 1));
        assert_eq!(q.tenants_holding(2), BTreeSet::from([a.clone()]));
        assert_eq!(q.tenants_holding(1), BTreeSet::from([a.clone(), b.clone()]));
        reads[0].store(true, Ordering::SeqCst);
        assert_eq!((q.stuck_of(&a), q.stuck_of(&b)), (1, 1));
        assert!(q.tenants_holding(2).is_empty());
        assert_eq!(q.stuck_of(&Tenant::Pod("c".into())), 0);
    }
}
