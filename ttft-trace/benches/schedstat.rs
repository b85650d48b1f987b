//! The daemon's cost of `--sched sampled`: one reading of every traced
//! thread's `/proc` schedstat counters and the spells made of them, per
//! thread, for a process of 300 threads (an inference server's order: its
//! tokenizer, HTTP and NCCL pools), half of them busy. Prints one JSON line.
//! Run: `cargo bench -p ttft-trace --bench schedstat` (or `cargo xtask
//! bench`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use ttft_trace::{host::clock::monotonic_ns, schedstat::SchedSampler};

const THREADS: usize = 300;
const PASSES: u32 = 500;

fn main() -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..THREADS)
        .map(|i| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if i % 2 == 0 {
                        thread::sleep(Duration::from_millis(1));
                    } else {
                        thread::sleep(Duration::from_millis(50));
                    }
                }
            })
        })
        .collect();
    let mut sampler = SchedSampler::new(1_000_000, ttft_trace::schedstat::MAX_THREADS);
    sampler.track([(std::process::id(), None)], monotonic_ns());
    let threads = sampler.threads();
    let mut spells = 0u64;
    let start = Instant::now();
    for _ in 0..PASSES {
        sampler.sample(monotonic_ns(), |_| spells += 1);
    }
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let ns_per_thread = secs * 1e9 / (f64::from(PASSES) * threads as f64);
    println!(
        "{{\"bench\":\"sched_sampler\",\"threads\":{threads},\"passes\":{PASSES},\"spells\":{spells},\"ns_per_thread_read\":{ns_per_thread:.0},\"core_share_at_10ms\":{:.4}}}",
        ns_per_thread * threads as f64 / 10e6
    );
    Ok(())
}
