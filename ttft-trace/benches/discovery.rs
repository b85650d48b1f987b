//! The daemon's discovery cost: one pass over /proc reading every process's
//! mappings (what `ttft-trace daemon` does every `rescan_ms` for untraced
//! processes), on a host made busy with idle Python interpreters and small
//! processes. Prints a JSON line: processes, cold pass (every ELF file
//! inspected once), warm pass (the per-file cache hit: /proc/PID/maps only),
//! and a pass with a comm filter that none of them matches (the daemon
//! checks the filters before reading a process's mappings).

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use ttft_trace::{
    probes::libraries::Scanner,
    workloads::{Filters, discover::processes},
};

const PYTHONS: usize = 100;
const SLEEPERS: usize = 200;
const WARM_PASSES: usize = 20;

fn spawn(program: &str, args: &[&str]) -> std::io::Result<Child> {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
}

fn pass(scanner: &mut Scanner) -> (usize, usize, Duration) {
    let start = Instant::now();
    let (mut scanned, mut cuda) = (0, 0);
    for pid in processes() {
        if let Ok(scan) = scanner.scan(pid) {
            scanned += 1;
            cuda += usize::from(!scan.libraries.is_empty());
        }
    }
    (scanned, cuda, start.elapsed())
}

/// A pass that reads only what the comm filter needs.
fn filtered_pass(filters: &Filters) -> Duration {
    let start = Instant::now();
    let passed = processes()
        .into_iter()
        .filter(|&pid| filters.reject_process(pid).is_none())
        .count();
    std::hint::black_box(passed);
    start.elapsed()
}

fn median_ms(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let mut children = Vec::new();
    for _ in 0..PYTHONS {
        children.push(spawn(
            "python3",
            &["-c", "import json, ssl, sqlite3, time; time.sleep(120)"],
        )?);
    }
    for _ in 0..SLEEPERS {
        children.push(spawn("sleep", &["120"])?);
    }
    // Let the interpreters import their modules (their mappings grow).
    std::thread::sleep(Duration::from_secs(3));
    let mut scanner = Scanner::default();
    let (processes, cuda, cold) = pass(&mut scanner);
    let warm_ms = median_ms(
        (0..WARM_PASSES)
            .map(|_| pass(&mut scanner).2.as_secs_f64() * 1e3)
            .collect(),
    );
    let filters = Filters {
        comm: Some(regex::Regex::new("^(vllm|tritonserver)$")?),
        ..Filters::default()
    };
    let filtered_ms = median_ms(
        (0..WARM_PASSES)
            .map(|_| filtered_pass(&filters).as_secs_f64() * 1e3)
            .collect(),
    );
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    println!(
        "{}",
        serde_json::json!({
            "processes": processes,
            "cuda_processes": cuda,
            "cold_pass_ms": cold.as_secs_f64() * 1e3,
            "warm_pass_ms": warm_ms,
            "warm_us_per_process": warm_ms * 1e3 / processes.max(1) as f64,
            "cpu_share_at_1s_rescan": warm_ms / 1e3,
            "comm_filtered_pass_ms": filtered_ms,
        })
    );
    Ok(())
}
