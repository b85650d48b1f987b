//! Root-only: a tenant that maps a file whose reads never return (a stalled
//! FUSE or NFS mount; `tests/fixtures/stalled_fuse.py`) neither stops nor
//! blinds the daemon (issue 28 item 1): the read is abandoned on its own
//! thread and the process set aside, another workload started meanwhile is
//! traced in full, /metrics answers within 1 s throughout, and SIGTERM
//! ends the daemon's work within 2 s. Its process then ends when the stuck
//! read returns (here: when the FUSE server is killed): the kernel waits
//! for a FUSE request its server has read regardless of signals, and a
//! process ends with its last thread (docs/hostile-input.md).

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use ttft_trace_tests::{
    container::PodCgroup,
    fixtures::{self, Style, Workload, read_truth, temp_path},
    otlp_receiver::free_addr,
    tracer::{Tracer, metric_total, root_test, workload_daemon_args},
};

/// The answers /metrics owes while a read is stuck, and SIGTERM's.
const METRICS_WITHIN: Duration = Duration::from_secs(1);
const STOP_WITHIN: Duration = Duration::from_secs(2);
/// The other workload's episodes, 25 ms apart.
const EPISODES: u32 = 80;

/// The FUSE server of `stalled_fuse.py`, mounted, and its children that
/// map its files, whose reads never return (one each).
struct StalledMount {
    dir: PathBuf,
    server: Child,
    mappers: Vec<u32>,
    /// Set when dropped: the watchdog then leaves the server alone.
    done: Arc<AtomicBool>,
}

/// How long the server may stall reads at most: past it, a watchdog kills
/// it, so that a daemon stuck in its read (a broken product) fails the test
/// instead of hanging it (a process in a FUSE read its server took waits
/// for the answer, SIGKILL or not).
const WATCHDOG: Duration = Duration::from_secs(90);

impl StalledMount {
    /// Mounted with `files` files, each mapped by a child of its own.
    fn start(files: usize) -> Result<Self> {
        let dir = temp_path("stalled-fuse", "d");
        std::fs::create_dir_all(&dir)?;
        let mut server = Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/fixtures/stalled_fuse.py"
            ))
            .arg(&dir)
            .arg(files.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting stalled_fuse.py")?;
        let mut line = String::new();
        BufReader::new(server.stdout.take().context("fixture stdout")?).read_line(&mut line)?;
        let done = Arc::new(AtomicBool::new(false));
        let (server_pid, watching) = (server.id() as i32, done.clone());
        std::thread::spawn(move || {
            let until = Instant::now() + WATCHDOG;
            while Instant::now() < until {
                if watching.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!("stalled_fuse.py killed by the watchdog after {WATCHDOG:?}");
            // SAFETY: plain kill(2) of our child, not yet reaped (Drop sets
            // `done` before it waits for it).
            unsafe { libc::kill(server_pid, libc::SIGKILL) };
        });
        let mut mount = Self {
            dir,
            server,
            mappers: Vec::new(),
            done,
        };
        mount.mappers = match line.trim().strip_prefix("mapped ") {
            Some(pids) => pids.split(' ').map(str::parse).collect::<Result<_, _>>()?,
            None => bail!("stalled_fuse.py said {line:?}"),
        };
        ensure!(
            mount.mappers.len() == files,
            "stalled_fuse.py said {line:?}"
        );
        Ok(mount)
    }
}

impl Drop for StalledMount {
    fn drop(&mut self) {
        // Killing the server aborts the connection: every stuck read
        // fails; the mapper and the mount go after it.
        self.done.store(true, Ordering::SeqCst);
        let _ = self.server.kill();
        let _ = self.server.wait();
        // SAFETY: plain kill(2) of the fixture's child; umount2(2) of our
        // own mount point, with a NUL-terminated path.
        unsafe {
            for &mapper in &self.mappers {
                libc::kill(mapper as i32, libc::SIGKILL);
            }
            if let Ok(c) = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()) {
                libc::umount2(c.as_ptr(), libc::MNT_DETACH);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// GET /metrics, and how long the answer took; an answer later than 5 s
/// is an error (a daemon whose loop is stuck never answers).
fn timed_metrics(addr: SocketAddr) -> Result<(Duration, String)> {
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .context("no answer from /metrics within 5 s")?;
    Ok((started.elapsed(), text))
}

/// Another tenant's workload, started now: found (while stopped before its
/// first CUDA call), then run to its end while /metrics is asked every
/// 100 ms. Returns its truth file, the slowest answer and how many were
/// asked.
fn another_workload(tracer: &mut Tracer, addr: SocketAddr) -> Result<(PathBuf, Duration, usize)> {
    let truth_path = temp_path("stalled-truth", "jsonl");
    let w = Workload::new(Style::Sync)
        .episodes(EPISODES)
        .gap_us(25_000)
        .stop_before_work(true)
        .truth(&truth_path);
    let mut child = w.spawn_with(Stdio::null(), Stdio::inherit())?;
    fixtures::wait_stopped(child.id())?;
    tracer.wait_for_stderr(
        &format!("tracing workload pid {} ", child.id()),
        1,
        Duration::from_secs(20),
    )?;
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
    let mut slowest = Duration::ZERO;
    let mut asked = 0;
    let status = loop {
        let (took, _) = timed_metrics(addr)?;
        slowest = slowest.max(took);
        asked += 1;
        if let Some(st) = child.try_wait()? {
            break st;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    ensure!(status.success(), "workload: {status}");
    Ok((truth_path, slowest, asked))
}

#[test]
fn a_file_whose_reads_never_return_stops_nothing() -> Result<()> {
    let Some(_g) = root_test("a_file_whose_reads_never_return_stops_nothing") else {
        return Ok(());
    };
    let mount = StalledMount::start(1)?;
    let mapper = mount.mappers[0];
    let addr = free_addr()?;
    let mut tracer = Tracer::start_daemon(&workload_daemon_args(addr))?;
    // Its first scan reads the mapper's file, and gives up on it.
    tracer
        .wait_for_stderr(
            &format!("pid {mapper}: a read of its files"),
            1,
            Duration::from_secs(20),
        )
        .context("the stalled read was never abandoned")?;

    let (truth_path, slowest, asked) = another_workload(&mut tracer, addr)?;
    let (_, metrics) = timed_metrics(addr)?;
    tracer.wait_for_stderr("has exited", 1, Duration::from_secs(10))?;

    // SIGTERM, as a service manager stops it: its work ends (the last
    // summary written, the probes handed to the detaching child) and it
    // says why its process waits.
    let pid = tracer.pid().context("daemon pid")?;
    let stopped = Instant::now();
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    tracer
        .wait_for_stderr("are still stuck in the kernel", 1, Duration::from_secs(20))
        .context("the daemon's work did not end")?;
    let stop_took = stopped.elapsed();
    let server_killed = Instant::now();
    drop(mount);
    let out = tracer.finish(Duration::from_secs(20))?;
    let exit_after_server = out.exited_at.duration_since(server_killed);

    let truth = read_truth(&truth_path)?;
    let _ = std::fs::remove_file(&truth_path);
    let wpid = truth.first().map_or(0, |t| t.pid);
    let traced = out.episodes().iter().filter(|e| e.pid == wpid).count();
    let abandoned = metric_total(
        &metrics,
        "ttft_trace_target_reads_overdue_total{outcome=\"abandoned\"}",
    );
    let stuck = metric_total(&metrics, "ttft_trace_target_reads_stuck_threads");
    eprintln!(
        "/metrics asked {asked} times, slowest {slowest:?}; SIGTERM to the work's end \
         {stop_took:?}, exit {exit_after_server:?} after the FUSE server was killed; \
         {traced} of {} episodes traced; reads abandoned {abandoned}, threads stuck {stuck}",
        truth.len()
    );
    assert!(out.success, "{}", out.stderr);
    assert!(
        slowest < METRICS_WITHIN,
        "/metrics took {slowest:?} (allowed {METRICS_WITHIN:?})"
    );
    assert!(
        stop_took < STOP_WITHIN,
        "SIGTERM took {stop_took:?} to end the work (allowed {STOP_WITHIN:?})"
    );
    assert!(
        exit_after_server < STOP_WITHIN,
        "exit {exit_after_server:?} after the stuck read was released"
    );
    assert_eq!(truth.len(), EPISODES as usize);
    assert_eq!(traced, truth.len(), "every episode of the other workload");
    // One stuck thread for the one stalled file: set aside while its read
    // is stuck, never read again meanwhile.
    assert!(abandoned >= 1, "abandoned reads counted: {abandoned}");
    assert_eq!(stuck, 1, "threads stuck in the stalled file's read");
    assert_eq!(
        out.stderr
            .matches(&format!("pid {mapper}: a read of its files"))
            .count(),
        1,
        "the stalled file read once: {}",
        out.stderr
    );
    Ok(())
}

/// Scans refused to a tenant at its share of the stuck readers, from
/// /metrics.
fn stuck_refused(metrics: &str) -> u64 {
    metric_total(
        metrics,
        "ttft_trace_quota_exceeded_total{resource=\"stuck_reads\"}",
    )
}

/// One tenant's share of the stuck readers the library scan may leave (8),
/// and how many files of one pod stall.
const STUCK_SHARE: u64 = 2;
const POD_STALLED_FILES: usize = 8;

/// One pod's processes on a stalled mount take their tenant's share of the
/// stuck readers, not every one: eight processes of one pod, each mapping
/// a file of its own whose reads never return, leave two threads stuck;
/// the scans of the other six are refused while those are stuck (counted
/// in `ttft_trace_quota_exceeded_total{resource="stuck_reads"}`), and
/// another tenant's workload started after is found and traced in full.
/// Without the share, the eight would take every reader and no new
/// workload would be found until one of their reads returned.
#[test]
fn one_pods_stalled_files_leave_readers_to_the_others() -> Result<()> {
    let Some(_g) = root_test("one_pods_stalled_files_leave_readers_to_the_others") else {
        return Ok(());
    };
    // The pod first: dropped last, once the mount's children are killed.
    let pod = PodCgroup::new()?;
    let mount = StalledMount::start(POD_STALLED_FILES)?;
    for &pid in &mount.mappers {
        pod.adopt(pid)?;
    }
    let addr = free_addr()?;
    let started = Instant::now();
    let mut tracer = Tracer::start_daemon(&workload_daemon_args(addr))?;
    // Until the pod's scans settle: at its share and refused, or (a broken
    // product) every reader taken.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, m) = timed_metrics(addr)?;
        let stuck = metric_total(&m, "ttft_trace_target_reads_stuck_threads");
        if stuck >= POD_STALLED_FILES as u64 || (stuck >= STUCK_SHARE && stuck_refused(&m) > 0) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the pod's reads never settled: {stuck} stuck"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let at_share = started.elapsed();
    let (truth_path, slowest, _) = another_workload(&mut tracer, addr)?;
    let (_, metrics) = timed_metrics(addr)?;
    tracer.wait_for_stderr("has exited", 1, Duration::from_secs(10))?;
    let stuck = metric_total(&metrics, "ttft_trace_target_reads_stuck_threads");
    let refused = stuck_refused(&metrics);
    drop(mount);
    let out = tracer.interrupt(Duration::from_secs(20))?;
    let truth = read_truth(&truth_path)?;
    let _ = std::fs::remove_file(&truth_path);
    let wpid = truth.first().map_or(0, |t| t.pid);
    let traced = out.episodes().iter().filter(|e| e.pid == wpid).count();
    eprintln!(
        "{POD_STALLED_FILES} stalled files in one pod: at its share {at_share:?} after the \
         start, threads stuck {stuck}, its scans refused {refused}; the other workload: \
         {traced} of {} episodes traced, /metrics slowest {slowest:?}",
        truth.len()
    );
    assert!(out.success, "{}", out.stderr);
    assert!(
        out.stderr
            .contains(&format!("has its share of {STUCK_SHARE} stuck reads")),
        "the pod warned about: {}",
        out.stderr
    );
    assert_eq!(stuck, STUCK_SHARE, "threads stuck: the pod's share");
    assert!(refused > 0, "the pod's other scans refused and counted");
    assert_eq!(truth.len(), EPISODES as usize);
    assert_eq!(traced, truth.len(), "every episode of the other workload");
    assert!(slowest < METRICS_WITHIN, "/metrics took {slowest:?}");
    Ok(())
}
