//! Work whose reads a target controls (its /proc files, the files it maps),
//! run off the event loop's thread with a deadline on progress. A read of a
//! file on a stalled FUSE or NFS mount never returns, `O_NONBLOCK` or not,
//! and the loop that reads the ring buffer, serves /metrics and handles
//! signals must go on: past the deadline the work is abandoned on its
//! thread, which is never given work again.

use std::{
    cell::RefCell,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        mpsc::{self, RecvTimeoutError},
    },
    thread,
    time::Duration,
};

use thiserror::Error;

/// Why work given to [`TargetWork::run`] came back with no result.
#[derive(Debug, Error)]
pub enum Overdue {
    #[error("no progress for {0:?}: abandoned on its thread")]
    Stalled(Duration),
    #[error("{0} threads are stuck in a target's reads: no more are started until one returns")]
    WorkersStuck(usize),
    #[error("cannot start a thread: {0}")]
    Spawn(std::io::Error),
    #[error("the thread that ran it panicked")]
    Panicked,
}

/// What [`TargetWork`] gave up on, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WorkStats {
    /// Work abandoned for making no progress (its thread left behind).
    pub abandoned: u64,
    /// Work refused because too many threads were stuck already.
    pub refused: u64,
    /// Threads abandoned and still stuck in their read.
    pub stuck_now: usize,
}

impl WorkStats {
    /// Adds another worker's figures to these.
    pub fn add(&mut self, other: WorkStats) {
        self.abandoned += other.abandoned;
        self.refused += other.refused;
        self.stuck_now += other.stuck_now;
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The one thread that runs work, with what it shares with the loop.
struct Worker {
    jobs: mpsc::Sender<Job>,
    /// Bumped by [`progress`] on the worker's thread.
    progress: Arc<AtomicU64>,
    /// Set when the loop gives up on the worker: its thread then ends when
    /// its work returns, and counts itself out of the stuck ones.
    abandoned: Arc<AtomicBool>,
}

thread_local! {
    /// The progress counter of the worker running on this thread, if any.
    static PROGRESS: RefCell<Option<Arc<AtomicU64>>> = const { RefCell::new(None) };
}

/// Marks progress of the work running on this thread (a read returned), so
/// that long work that advances is not taken for stuck work. Does nothing
/// off a worker thread.
pub fn progress() {
    PROGRESS.with(|p| {
        if let Some(p) = &*p.borrow() {
            p.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Runs work on a thread of its own, one piece at a time, waiting for each
/// as long as it makes progress.
pub struct TargetWork {
    worker: Option<Worker>,
    /// No progress for this long abandons the work.
    stall: Duration,
    /// Threads abandoned whose read has not returned yet.
    stuck: Arc<AtomicUsize>,
    /// Past this many stuck threads, work is refused at once: each holds a
    /// thread's stack and a descriptor of the stalled file.
    max_stuck: usize,
    abandoned: u64,
    refused: u64,
}

impl TargetWork {
    pub fn new(stall: Duration, max_stuck: usize) -> Self {
        Self {
            worker: None,
            stall,
            stuck: Arc::new(AtomicUsize::new(0)),
            max_stuck,
            abandoned: 0,
            refused: 0,
        }
    }

    pub fn stats(&self) -> WorkStats {
        WorkStats {
            abandoned: self.abandoned,
            refused: self.refused,
            stuck_now: self.stuck.load(Ordering::SeqCst),
        }
    }

    /// Runs `f` on the worker's thread and waits for its result while it
    /// makes progress: it returns, or calls [`progress`], at least once a
    /// stall period.
    pub fn run<T: Send + 'static>(
        &mut self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Overdue> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            // The loop may have given up on it: nobody to tell then.
            let _ = tx.send(f());
        });
        let progress = {
            let worker = self.worker()?;
            if worker.jobs.send(job).is_err() {
                // Its thread ended (a panic in earlier work).
                self.worker = None;
                return Err(Overdue::Panicked);
            }
            worker.progress.clone()
        };
        let mut seen = progress.load(Ordering::Relaxed);
        loop {
            match rx.recv_timeout(self.stall) {
                Ok(v) => return Ok(v),
                Err(RecvTimeoutError::Disconnected) => {
                    self.worker = None;
                    return Err(Overdue::Panicked);
                }
                Err(RecvTimeoutError::Timeout) => {
                    let now = progress.load(Ordering::Relaxed);
                    if now == seen {
                        self.abandon();
                        return Err(Overdue::Stalled(self.stall));
                    }
                    seen = now;
                }
            }
        }
    }

    /// The worker, started if there is none and not too many are stuck.
    fn worker(&mut self) -> Result<&Worker, Overdue> {
        if self.worker.is_none() {
            let stuck = self.stuck.load(Ordering::SeqCst);
            if stuck >= self.max_stuck {
                self.refused += 1;
                return Err(Overdue::WorkersStuck(stuck));
            }
            self.worker = Some(spawn(self.stuck.clone()).map_err(Overdue::Spawn)?);
        }
        // Set just above when it was None.
        self.worker.as_ref().ok_or(Overdue::Panicked)
    }

    /// Leaves the worker to its stuck work; the next work gets a new one.
    fn abandon(&mut self) {
        if let Some(w) = self.worker.take() {
            self.abandoned += 1;
            // Counted in before the thread can count itself out: it does so
            // only once `abandoned` is set and its job queue closed (the
            // sender dropped with `w`).
            self.stuck.fetch_add(1, Ordering::SeqCst);
            w.abandoned.store(true, Ordering::SeqCst);
        }
    }
}

fn spawn(stuck: Arc<AtomicUsize>) -> std::io::Result<Worker> {
    let (jobs, queue) = mpsc::channel::<Job>();
    let progress = Arc::new(AtomicU64::new(0));
    let abandoned = Arc::new(AtomicBool::new(false));
    let (p, a) = (progress.clone(), abandoned.clone());
    thread::Builder::new()
        .name("target-reads".into())
        .spawn(move || {
            PROGRESS.with(|cell| *cell.borrow_mut() = Some(p));
            while let Ok(job) = queue.recv() {
                job();
            }
            if a.load(Ordering::SeqCst) {
                stuck.fetch_sub(1, Ordering::SeqCst);
            }
        })?;
    Ok(Worker {
        jobs,
        progress,
        abandoned,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const STALL: Duration = Duration::from_millis(50);

    #[test]
    fn work_that_returns_gives_its_result() {
        let mut work = TargetWork::new(STALL, 2);
        assert_eq!(work.run(|| 6 * 7).expect("ran"), 42);
        assert_eq!(work.run(|| "again").expect("ran"), "again");
        assert_eq!(work.stats(), WorkStats::default());
    }

    #[test]
    fn work_that_advances_is_waited_for_past_the_stall_period() {
        // Progress four times a stall period, for three periods.
        let stall = Duration::from_millis(200);
        let mut work = TargetWork::new(stall, 2);
        let started = Instant::now();
        let n = work
            .run(move || {
                for _ in 0..12 {
                    thread::sleep(stall / 4);
                    progress();
                }
                12
            })
            .expect("advancing work is not abandoned");
        assert_eq!(n, 12);
        assert!(started.elapsed() >= stall * 3);
        assert_eq!(work.stats().abandoned, 0);
    }

    #[test]
    fn stuck_work_is_abandoned_and_its_thread_never_reused() {
        let mut work = TargetWork::new(STALL, 2);
        let (release, stuck) = mpsc::channel::<()>();
        let (tell, told) = mpsc::channel();
        let started = Instant::now();
        let r = work.run(move || {
            let _ = tell.send(thread::current().id());
            stuck.recv().is_ok()
        });
        assert!(matches!(r, Err(Overdue::Stalled(_))), "{r:?}");
        assert!(started.elapsed() < STALL * 10);
        // The next work runs on a new thread while the first is stuck.
        let first = told.recv().expect("the stuck thread's id");
        let other = work.run(|| thread::current().id()).expect("ran");
        assert_ne!(other, first);
        assert_eq!(
            work.stats(),
            WorkStats {
                abandoned: 1,
                refused: 0,
                stuck_now: 1
            }
        );
        // Once its read returns, the stuck thread ends and counts itself out.
        release.send(()).expect("stuck thread waits");
        let deadline = Instant::now() + Duration::from_secs(5);
        while work.stats().stuck_now > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(work.stats().stuck_now, 0);
    }

    #[test]
    fn past_the_stuck_threads_allowed_work_is_refused_at_once() {
        let mut work = TargetWork::new(STALL, 2);
        let mut releases = Vec::new();
        for _ in 0..2 {
            let (release, stuck) = mpsc::channel::<()>();
            releases.push(release);
            assert!(work.run(move || stuck.recv().is_ok()).is_err());
        }
        let started = Instant::now();
        let r = work.run(|| 1);
        assert!(matches!(r, Err(Overdue::WorkersStuck(2))), "{r:?}");
        assert!(started.elapsed() < STALL, "refused without waiting");
        assert_eq!(work.stats().refused, 1);
        drop(releases);
        let deadline = Instant::now() + Duration::from_secs(5);
        while work.stats().stuck_now > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(work.run(|| 1).expect("a thread again"), 1);
    }

    /// What handing work to the thread costs the loop, beside the work:
    /// `cargo test -p ttft-trace --lib round_trip_cost -- --ignored
    /// --nocapture` (a figure, not a check).
    #[test]
    #[ignore]
    fn round_trip_cost() {
        let mut work = TargetWork::new(Duration::from_secs(1), 1);
        let n = 20_000;
        let started = Instant::now();
        for i in 0..n {
            assert_eq!(work.run(move || i).expect("ran"), i);
        }
        let each = started.elapsed() / n;
        let started = Instant::now();
        for i in 0..n {
            std::hint::black_box(i);
        }
        eprintln!(
            "{n} runs: {each:?} each (a loop of the same calls inline: {:?} in all)",
            started.elapsed()
        );
    }

    #[test]
    fn a_panic_in_work_is_an_error_and_the_next_work_runs() {
        // The panic's message and backtrace are printed before the thread
        // unwinds: a stall period that allows for it.
        let mut work = TargetWork::new(Duration::from_secs(5), 2);
        let r: Result<(), _> = work.run(|| panic!("hostile input"));
        assert!(matches!(r, Err(Overdue::Panicked)), "{r:?}");
        assert_eq!(work.run(|| 1).expect("ran"), 1);
    }
}
