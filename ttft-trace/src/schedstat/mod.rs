//! `--sched sampled`: the traced threads' scheduler spells from their
//! `/proc/PID/task/TID/schedstat` counters, read every period, instead of a
//! program on `sched_switch`, which every context switch of every task on
//! the host runs (about one BPF dispatch each: on this project's VMs an
//! empty one alone is +4-5 % on a context-switch loop). Nothing runs on
//! other tasks' switches; the daemon pays one `pread` (about 0.7 µs here)
//! per traced thread and period, and spells are placed to the period (see
//! [`spells`]).
//!
//! The files are the kernel's own (procfs, not the target's root), opened
//! once per thread and kept open; a thread's file stops reading when it
//! exits. Threads beyond [`MAX_THREADS`] are not sampled and are counted;
//! so are a workload's threads past its share of them (a quota: one
//! workload cannot take the host's descriptors).

mod spells;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs::File,
    os::unix::fs::FileExt as _,
};

use ttft_trace_common::signals::{RUNQ_BUCKETS, SchedEvent, SchedTotals, runq_bucket};

use spells::{Reading, ThreadSpells};

use crate::{
    host::targets,
    workloads::quota::{Quota, Resource, Tenant},
};

/// Most threads sampled at once (each holds one open file).
pub const MAX_THREADS: usize = 16_384;
/// A schedstat line is three decimal u64s: at most 62 bytes.
const LINE_MAX: usize = 96;

struct Thread {
    tgid: u32,
    file: File,
    spells: ThreadSpells,
}

/// The sampled threads of the traced processes, and their sums.
pub struct SchedSampler {
    min_ns: u64,
    threads: HashMap<u32, Thread>,
    /// Traced processes whose threads are sampled.
    processes: BTreeMap<u32, ()>,
    /// Per process, and of processes gone (so the counters never go back).
    totals: BTreeMap<u32, SchedTotals>,
    gone: SchedTotals,
    /// Run-queue waits by log2 bucket, and their sum.
    buckets: Vec<u64>,
    sum_ns: u64,
    /// Threads not sampled for the cap.
    pub dropped: u64,
    /// One workload's share of the threads sampled.
    pub quota: Quota<Tenant>,
    /// Threads not sampled at the last listing, their workload at its
    /// share: each counted once.
    refused: BTreeSet<u32>,
    buf: [u8; LINE_MAX],
}

/// The three counters of a schedstat line: run time, run-queue wait (ns)
/// and arrivals on a CPU.
pub fn parse(line: &[u8]) -> Option<(u64, u64, u64)> {
    let text = std::str::from_utf8(line).ok()?;
    let mut it = text.split_ascii_whitespace().map(|v| v.parse::<u64>().ok());
    Some((it.next()??, it.next()??, it.next()??))
}

/// This thread's own counters file: whether it reads tells whether the
/// kernel keeps the counters (CONFIG_SCHED_INFO).
pub fn own_file() -> String {
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    format!("/proc/self/task/{tid}/schedstat")
}

/// Whether this kernel shows the counters the sampler reads.
pub fn readable() -> bool {
    std::fs::read(own_file())
        .ok()
        .and_then(|b| parse(&b))
        .is_some()
}

impl SchedSampler {
    /// Spells shorter than `min_ns` are summed only (as the exact source
    /// does); one workload's threads are sampled up to `share`.
    pub fn new(min_ns: u64, share: usize) -> Self {
        raise_file_limit();
        Self {
            min_ns,
            threads: HashMap::new(),
            processes: BTreeMap::new(),
            totals: BTreeMap::new(),
            gone: SchedTotals::default(),
            buckets: vec![0; RUNQ_BUCKETS as usize],
            sum_ns: 0,
            dropped: 0,
            quota: Quota::new(Resource::SampledThreads, share),
            refused: BTreeSet::new(),
            buf: [0; LINE_MAX],
        }
    }

    /// Follows the threads of `live` (traced processes, each with its
    /// workload's tenant): opens the new ones' files, up to the tenant's
    /// share, and lets go of the processes that are not traced any more. A
    /// thread born after its process was first listed starts from zero
    /// counters at its birth, so that its first spells count.
    pub fn track<'a>(
        &mut self,
        live: impl IntoIterator<Item = (u32, Option<&'a Tenant>)>,
        now_ns: u64,
    ) {
        let live: BTreeMap<u32, Option<&Tenant>> = live.into_iter().collect();
        let ended: Vec<u32> = self
            .processes
            .keys()
            .filter(|p| !live.contains_key(p))
            .copied()
            .collect();
        for tgid in ended {
            self.processes.remove(&tgid);
            self.threads.retain(|_, t| t.tgid != tgid);
            if let Some(t) = self.totals.remove(&tgid) {
                self.gone.add(&t);
            }
        }
        // Each tenant's threads sampled now.
        let mut held: HashMap<&Tenant, usize> = HashMap::new();
        for t in self.threads.values() {
            if let Some(&Some(tenant)) = live.get(&t.tgid) {
                *held.entry(tenant).or_default() += 1;
            }
        }
        let (mut refused, mut over) = (BTreeSet::new(), BTreeSet::new());
        for (&tgid, &tenant) in &live {
            let known = self.processes.insert(tgid, ()).is_some();
            let Ok(dir) = std::fs::read_dir(format!("/proc/{tgid}/task")) else {
                continue;
            };
            let before = self.threads.len();
            for entry in dir.flatten() {
                let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                    continue;
                };
                if self.threads.contains_key(&tid) {
                    continue;
                }
                let Some(tenant) = tenant else {
                    self.open(tgid, tid, known, now_ns);
                    continue;
                };
                let n = held.entry(tenant).or_default();
                if *n >= self.quota.share() {
                    if !self.refused.contains(&tid) {
                        self.quota.refuse(tenant, 1);
                    }
                    refused.insert(tid);
                    over.insert(tenant.clone());
                } else if self.open(tgid, tid, known, now_ns) {
                    *n += 1;
                }
            }
            if !known {
                // The moment its spells are counted from, on the tracer's
                // clock (tests compare it with the target's own account).
                log::info!(
                    "scheduler counters: sampling {} threads of process {tgid} from {now_ns} ns \
                     (CLOCK_MONOTONIC)",
                    self.threads.len() - before
                );
            }
        }
        self.refused = refused;
        self.quota.settle(|t| over.contains(t));
    }

    /// Starts sampling thread `tid` of `tgid`; whether it is sampled.
    fn open(&mut self, tgid: u32, tid: u32, born_since: bool, now_ns: u64) -> bool {
        if self.threads.len() >= MAX_THREADS {
            self.dropped += 1;
            return false;
        }
        let Ok(file) = File::open(format!("/proc/{tgid}/task/{tid}/schedstat")) else {
            return false;
        };
        let first = match born_since.then(|| targets::start_time_ns(tid)).flatten() {
            Some(born) if born <= now_ns => Reading {
                t_ns: born,
                ..Reading::default()
            },
            _ => match read(&file, &mut self.buf, now_ns) {
                Some(r) => r,
                None => return false,
            },
        };
        self.threads.insert(
            tid,
            Thread {
                tgid,
                file,
                spells: ThreadSpells::new(tgid, tid, first),
            },
        );
        true
    }

    /// Reads every sampled thread at `now_ns`; hands each spell to `out`.
    /// A thread whose file no longer reads has exited and is let go.
    pub fn sample(&mut self, now_ns: u64, mut out: impl FnMut(&SchedEvent)) {
        let min_ns = self.min_ns;
        let mut exited = Vec::new();
        for (tid, t) in &mut self.threads {
            let Some(reading) = read(&t.file, &mut self.buf, now_ns) else {
                exited.push(*tid);
                continue;
            };
            let step = t.spells.advance(reading, min_ns);
            for e in &step.spells {
                out(e);
            }
            self.totals.entry(t.tgid).or_default().add(&step.totals);
            if let Some((mean, n)) = step.waits {
                self.buckets[runq_bucket(mean) as usize] += n;
                self.sum_ns = self.sum_ns.wrapping_add(step.totals.runq_ns);
            }
        }
        for tid in exited {
            self.threads.remove(&tid);
        }
    }

    /// Threads sampled now.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Scheduler totals of every sampled process, gone ones included.
    pub fn totals(&self) -> SchedTotals {
        let mut sum = self.gone;
        for t in self.totals.values() {
            sum.add(t);
        }
        sum
    }

    /// The run-queue histogram (log2 buckets) and its sum.
    pub fn histogram(&self) -> (&[u64], u64) {
        (&self.buckets, self.sum_ns)
    }
}

fn read(file: &File, buf: &mut [u8; LINE_MAX], now_ns: u64) -> Option<Reading> {
    let n = file.read_at(buf, 0).ok()?;
    let (exec_ns, delay_ns, pcount) = parse(&buf[..n])?;
    Some(Reading {
        t_ns: now_ns,
        exec_ns,
        delay_ns,
        pcount,
    })
}

/// One file per sampled thread: the soft limit of open files up to the
/// hard one (a failure leaves it; opens beyond it then fail and the
/// thread is not sampled).
fn raise_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit to fill and then pass back.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::clock::{monotonic_ns, thread_cpu_ns};

    #[test]
    fn schedstat_lines_parse_and_junk_is_refused() {
        assert_eq!(parse(b"594496735 264007 7\n"), Some((594496735, 264007, 7)));
        assert_eq!(parse(b"1 2\n"), None);
        assert_eq!(parse(b"1 x 3\n"), None);
        assert_eq!(parse(b"\xff\xfe"), None);
    }

    /// This process's own threads, sampled around a busy spell and a
    /// sleep: the totals follow the kernel's counters.
    #[test]
    fn own_threads_are_sampled_and_summed() {
        let me = std::process::id();
        // Every spell emitted, however short: on a CPU shared with the
        // other tests' threads the spin runs in slices whose mean can fall
        // under a 1 ms minimum (seen once in seven runs), and the minimum
        // is the spells' own unit tests' to check.
        let mut s = SchedSampler::new(0, MAX_THREADS);
        s.track([(me, None)], monotonic_ns());
        assert!(s.threads() >= 1);
        // Spins for 30 ms of its own CPU time (not of wall time: on a
        // loaded machine it waits for the CPU too), then sleeps, so that
        // its spin is read before it exits.
        let spun = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy = std::thread::spawn({
            let spun = spun.clone();
            move || {
                let mut x = 0u64;
                while thread_cpu_ns() < 30_000_000 {
                    x = x.wrapping_add(1);
                }
                std::hint::black_box(x);
                spun.store(true, std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        });
        // Born after the first listing: counted from its birth.
        std::thread::sleep(std::time::Duration::from_millis(5));
        s.track([(me, None)], monotonic_ns());
        let mut spells = Vec::new();
        let mut after = 0;
        while after < 2 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            s.sample(monotonic_ns(), |e| spells.push(*e));
            if spun.load(std::sync::atomic::Ordering::SeqCst) {
                after += 1;
            }
        }
        busy.join().expect("join");
        assert!(
            s.totals().oncpu_ns >= 20_000_000,
            "{:?} {spells:?}",
            s.totals()
        );
        assert!(
            spells
                .iter()
                .any(|e| e.what == ttft_trace_common::signals::SCHED_ONCPU)
        );
        // A process no longer traced is let go, its sums kept.
        let before = s.totals();
        s.track([], monotonic_ns());
        assert_eq!((s.threads(), s.totals()), (0, before));
    }
}
