//! Self-checks of the fault injection (`ttft_trace_tests::faults`), as root:
//! nftables loss on a loopback port really makes TCP retransmit and its table
//! always goes away; a CPU hog sharing a CPU really delays a thread on the run
//! queue. Skipped (with the reason printed) when not root, failed then if
//! `TTFT_TRACE_REQUIRE_FIXTURES` is set. Loopback only, bounded loops.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    panic::{AssertUnwindSafe, catch_unwind},
    path::Path,
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use ttft_trace_tests::{
    faults::{
        self, CpuHog, Direction, HOG_COMM, PacketLoss, TABLE_PREFIX, cleanup_stale, our_tables,
        pin, run_delay_ns, tcp_retrans_segs, tcp_total_retrans, thread_run_delay_ns,
    },
    fixtures::ChildGuard,
    tracer::root_test,
};

const REQUEST: usize = 1000;
const CHUNK: usize = 100;
const CHUNKS: usize = 10;

/// What one lossy exchange showed.
#[derive(Debug)]
struct LossStats {
    requests: u32,
    stalled: bool,
    server_retrans: u32,
    client_retrans: u32,
    snmp_retrans: u64,
    dropped: u64,
    elapsed: Duration,
}

/// A loopback connection like the demo's: the client sends a 1 KB request,
/// the server answers with 10 chunks of 100 B, 1 ms apart (TCP_NODELAY, so
/// one segment each); repeated for `budget`, with the loss set up on the
/// server's port once the connection is established (so the handshake is not
/// delayed by a lost SYN). A response that takes over 2 s (RTO backoff) ends
/// the exchange early: what counts is that TCP retransmitted.
fn lossy_exchange(percent: u32, direction: Direction, budget: Duration) -> Result<LossStats> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let client = TcpStream::connect(("127.0.0.1", port))?;
    let (server, _) = listener.accept()?;
    client.set_read_timeout(Some(Duration::from_secs(2)))?;
    server.set_read_timeout(Some(Duration::from_millis(200)))?;
    for s in [&client, &server] {
        s.set_nodelay(true)?;
    }
    let loss = PacketLoss::start_with(port, percent, direction)?;
    ensure!(
        our_tables()?.iter().any(|t| t == loss.table()),
        "table {} not listed by nft",
        loss.table()
    );
    let snmp0 = tcp_retrans_segs()?;
    let (srv0, cli0) = (tcp_total_retrans(&server)?, tcp_total_retrans(&client)?);

    let done = Arc::new(AtomicBool::new(false));
    let server_done = done.clone();
    let server_thread = thread::spawn(move || -> Result<TcpStream> {
        let mut s = server;
        let mut req = [0u8; REQUEST];
        let mut have = 0;
        while !server_done.load(Ordering::Relaxed) {
            match s.read(&mut req[have..]) {
                Ok(0) => break,
                Ok(n) => have += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    continue;
                }
                Err(e) => return Err(e).context("server read"),
            }
            if have == REQUEST {
                have = 0;
                for _ in 0..CHUNKS {
                    s.write_all(&[b'x'; CHUNK]).context("server write")?;
                    thread::sleep(Duration::from_millis(1));
                }
            }
        }
        Ok(s)
    });

    let t0 = Instant::now();
    let mut c = client;
    let mut requests = 0;
    let mut stalled = false;
    let mut resp = [0u8; CHUNK * CHUNKS];
    while t0.elapsed() < budget && requests < 1000 {
        c.write_all(&[b'r'; REQUEST]).context("client write")?;
        match c.read_exact(&mut resp) {
            Ok(()) => requests += 1,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                stalled = true;
                break;
            }
            Err(e) => return Err(e).context("client read"),
        }
    }
    let elapsed = t0.elapsed();
    let dropped = loss.dropped()?;
    let client_retrans = tcp_total_retrans(&c)? - cli0;
    done.store(true, Ordering::Relaxed);
    let server = server_thread
        .join()
        .map_err(|_| anyhow::anyhow!("server thread panicked"))??;
    let server_retrans = tcp_total_retrans(&server)? - srv0;
    let snmp_retrans = tcp_retrans_segs()? - snmp0;
    let table = loss.table().to_string();
    loss.stop()?;
    ensure!(
        !our_tables()?.contains(&table),
        "table {table} still there after stop"
    );
    let stats = LossStats {
        requests,
        stalled,
        server_retrans,
        client_retrans,
        snmp_retrans,
        dropped,
        elapsed,
    };
    eprintln!(
        "{percent} % loss {direction:?}: {} requests in {:.2?}{}, {} packets dropped, \
         retransmits: server socket {}, client socket {}, RetransSegs +{}",
        stats.requests,
        stats.elapsed,
        if stats.stalled {
            " (then a 2 s stall)"
        } else {
            ""
        },
        stats.dropped,
        stats.server_retrans,
        stats.client_retrans,
        stats.snmp_retrans
    );
    ensure!(
        stats.snmp_retrans >= u64::from(server_retrans + client_retrans),
        "RetransSegs grew by less than our sockets' retransmits: {stats:?}"
    );
    ensure!(stats.dropped > 0, "nothing dropped: {stats:?}");
    Ok(stats)
}

/// The default: packets to the server's port (requests, ACKs) are dropped.
#[test]
fn packet_loss_makes_tcp_retransmit() -> Result<()> {
    let Some(_serial) = root_test("packet_loss_makes_tcp_retransmit") else {
        let e = PacketLoss::start(8000, 30).expect_err("needs root");
        assert!(format!("{e:#}").contains("root"), "unclear error: {e:#}");
        return Ok(());
    };
    let s = lossy_exchange(30, Direction::ToServer, Duration::from_secs(3))?;
    ensure!(
        s.client_retrans > 0,
        "the client's socket did not retransmit its requests: {s:?}"
    );
    Ok(())
}

/// Dropping packets from the port makes the server retransmit its
/// responses; both directions at a small rate make both retransmit.
#[test]
fn packet_loss_direction_decides_who_retransmits() -> Result<()> {
    let Some(_serial) = root_test("packet_loss_direction_decides_who_retransmits") else {
        return Ok(());
    };
    let from = lossy_exchange(30, Direction::FromServer, Duration::from_secs(3))?;
    ensure!(
        from.server_retrans > 0 && from.server_retrans > from.client_retrans,
        "FromServer: {from:?}"
    );
    let both = lossy_exchange(10, Direction::Both, Duration::from_secs(3))?;
    ensure!(
        both.server_retrans + both.client_retrans > 0,
        "Both: {both:?}"
    );
    Ok(())
}

#[test]
fn packet_loss_table_goes_away_on_panic_and_stale_ones_are_cleaned() -> Result<()> {
    let Some(_serial) =
        root_test("packet_loss_table_goes_away_on_panic_and_stale_ones_are_cleaned")
    else {
        return Ok(());
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();

    // Dropped while unwinding.
    let name = Mutex::new(String::new());
    let r = catch_unwind(AssertUnwindSafe(|| {
        let loss = PacketLoss::start(port, 30).expect("start");
        *name.lock().expect("lock") = loss.table().to_string();
        panic!("injected panic inside the guard's scope (expected)");
    }));
    assert!(r.is_err());
    let name = name.into_inner().expect("lock");
    ensure!(name.starts_with(TABLE_PREFIX), "odd table name {name:?}");
    ensure!(!our_tables()?.contains(&name), "{name} survived the panic");

    // Two guards at once get two tables; dropping one leaves the other.
    let a = PacketLoss::start(port, 10)?;
    let b = PacketLoss::start_with(port, 10, Direction::Both)?;
    ensure!(a.table() != b.table());
    ensure!(b.dropped()? == 0, "dropped packets of an idle port");
    let b_name = b.table().to_string();
    drop(b);
    let tables = our_tables()?;
    ensure!(tables.iter().any(|t| t == a.table()) && !tables.contains(&b_name));

    // A table left by a dead process is removed; ours (live pid) stays.
    let dead = (2..4_000_000u32)
        .rev()
        .find(|p| !Path::new(&format!("/proc/{p}")).exists())
        .context("no free pid")?;
    let stale = format!("{TABLE_PREFIX}{dead}_0");
    let out = Command::new(faults::nft_ready()?)
        .args(["add", "table", "inet", &stale])
        .output()?;
    ensure!(out.status.success(), "nft add table: {out:?}");
    let cleaned = cleanup_stale()?;
    ensure!(cleaned.contains(&stale), "{stale} not cleaned: {cleaned:?}");
    let tables = our_tables()?;
    ensure!(!tables.contains(&stale) && tables.iter().any(|t| t == a.table()));
    drop(a);
    Ok(())
}

/// Spins until this thread has used `cpu` of CPU time.
fn spin_cpu(cpu: Duration) {
    let start = thread_cpu_time();
    while thread_cpu_time() - start < cpu {
        std::hint::spin_loop();
    }
}

fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A thread pinned to `cpu` works 2 ms (CPU time) and sleeps 1 ms, 100
/// times, like a server thread; returns its run-queue delay and wall time.
fn pinned_worker_delay(cpu: usize) -> Result<(Duration, Duration)> {
    thread::spawn(move || -> Result<(Duration, Duration)> {
        let me = faults::gettid();
        faults::pin_thread(0, &[cpu])?;
        let pid = std::process::id();
        let d0 = thread_run_delay_ns(pid, me)?;
        let t0 = Instant::now();
        for _ in 0..100 {
            spin_cpu(Duration::from_millis(2));
            thread::sleep(Duration::from_millis(1));
        }
        let d1 = thread_run_delay_ns(pid, me)?;
        Ok((Duration::from_nanos(d1 - d0), t0.elapsed()))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("worker panicked"))?
}

#[test]
fn cpu_hog_delays_a_thread_sharing_its_cpu() -> Result<()> {
    let Some(_serial) = root_test("cpu_hog_delays_a_thread_sharing_its_cpu") else {
        return Ok(());
    };
    let cpu = *faults::server_cpus()?.last().context("no CPU")?;
    let (base, base_wall) = pinned_worker_delay(cpu)?;

    let hog = CpuHog::start(&[cpu], 1)?;
    let pids = hog.pids();
    for &p in &pids {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm"))?;
        ensure!(comm.trim() == HOG_COMM, "hog {p} is called {comm:?}");
        ensure!(faults::affinity(p)? == [cpu], "hog {p} not pinned to {cpu}");
    }
    let (hogged, hogged_wall) = pinned_worker_delay(cpu)?;
    drop(hog);
    for &p in &pids {
        ensure!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "hog {p} survived its guard"
        );
    }
    eprintln!(
        "CPU {cpu}, 100 x (2 ms CPU + 1 ms sleep): run-queue delay {base:?} (wall {base_wall:?}) \
         without the hog, {hogged:?} (wall {hogged_wall:?}) with it"
    );
    // Each competitor at equal weight adds about the worker's own CPU
    // demand (200 ms here) to its run-queue delay, whatever else runs there.
    ensure!(
        hogged > base + Duration::from_millis(100),
        "hog made no clear difference: {base:?} without, {hogged:?} with"
    );
    Ok(())
}

/// `pin` puts every thread of another process on one CPU, and a hog there
/// then shows up in that process's run-queue delay (the server's case).
#[test]
fn pinned_process_waits_behind_the_hog() -> Result<()> {
    let Some(_serial) = root_test("pinned_process_waits_behind_the_hog") else {
        return Ok(());
    };
    let cpu = *faults::server_cpus()?.last().context("no CPU")?;
    // Two idle threads and a main thread working 2 ms (CPU), sleeping 1 ms.
    let script = "import threading, time\n\
        for _ in range(2): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n\
        end = time.monotonic() + 60\n\
        while time.monotonic() < end:\n    \
            t = time.thread_time()\n    \
            while time.thread_time() - t < 0.002: pass\n    \
            time.sleep(0.001)\n";
    let mut child = ChildGuard::new(
        Command::new("python3")
            .args(["-c", script])
            .stdin(Stdio::null())
            .spawn()?,
    );
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(5);
    while faults::tids(pid)?.len() < 3 {
        ensure!(Instant::now() < deadline, "python never had 3 threads");
        thread::sleep(Duration::from_millis(20));
    }
    let n = pin(pid, &[cpu])?;
    ensure!(n >= 3, "pinned {n} threads");
    for tid in faults::tids(pid)? {
        ensure!(
            faults::affinity(tid)? == [cpu],
            "thread {tid} not pinned to {cpu}"
        );
    }
    let window = Duration::from_secs(1);
    let d0 = run_delay_ns(pid)?;
    thread::sleep(window);
    let base = Duration::from_nanos(run_delay_ns(pid)? - d0);
    let hog = CpuHog::start(&[cpu], 1)?;
    let d1 = run_delay_ns(pid)?;
    thread::sleep(window);
    let hogged = Duration::from_nanos(run_delay_ns(pid)? - d1);
    drop(hog);
    if let Some(c) = child.child_mut() {
        let _ = c.kill();
    }
    eprintln!(
        "pinned python ({n} threads) on CPU {cpu}, {window:?}: run-queue delay {base:?} \
         without the hog, {hogged:?} with it"
    );
    ensure!(
        hogged > base + Duration::from_millis(100),
        "hog made no clear difference: {base:?} without, {hogged:?} with"
    );
    Ok(())
}
