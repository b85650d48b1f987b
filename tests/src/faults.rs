//! Real fault injection for the tests and the demo (no GPU needed):
//!
//! - [`PacketLoss`]: random packet drop on a loopback TCP port with
//!   nftables, in a table of our own on the **input** hook, deleted when the
//!   guard drops (also while unwinding from a panic); [`cleanup_stale`]
//!   deletes tables left behind by crashed runs.
//! - [`CpuHog`]: busy-looping child processes pinned to given CPUs, and
//!   [`pin`] to put every thread of a server on the same CPUs, so that the
//!   server's threads wait on the run queue.
//! - Ground truth to check a fault took effect: [`run_delay_ns`] (schedstat),
//!   [`tcp_retrans_segs`] (`/proc/net/snmp`), [`tcp_total_retrans`] (TCP_INFO);
//!   and [`RunDelaySampler`], a server's run-queue delay over any window of
//!   a run (schedstat, sampled), to tell what the machine itself slowed.
//!
//! Why the input hook: on loopback every packet passes the output hook (as the
//! sender) and then the input hook (as the receiver). A drop in the output
//! hook is reported to the sending socket as a local error (no retransmit is
//! counted: TCP just tries again), so it is not what a lossy network does; a
//! drop in the input hook is a real loss: the sender's TCP retransmits after
//! a timeout or a tail loss probe. The input hook alone is enough.
//!
//! Which direction matters (measured by `tests/faults_selfcheck.rs`, several
//! runs: requests of 1 KB each answered with 10 chunks of 100 B 1 ms apart,
//! one connection, about 3 s):
//! - [`Direction::ToServer`] (`tcp dport`, the default), 30 %: requests and
//!   ACKs are lost. The client's socket retransmits its requests (4-14); the
//!   server's only when no later ACK comes in time (0-11). 20-46 requests.
//! - [`Direction::FromServer`] (`tcp sport`), 30 %: responses are lost; the
//!   server's socket retransmits (12-41), the client's never did; RTO backoff
//!   stalls of seconds, 3-19 requests.
//! - [`Direction::Both`]: a round trip fails with 1 - 0.7 * 0.7 = 51 %
//!   probability at 30 %, and RTO backoff stalled the connection past 5 s.
//!   At 10 %: server 38-56, client 0-6 retransmits, 38-53 requests.
//!
//! Drops in an *output* hook chain (e.g. `oifname "lo"`) are not loss: the
//! sender gets a local error and sends again; 51 such drops gave delays but
//! not one retransmission on either socket.

use std::{
    collections::BTreeMap,
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    os::fd::{AsRawFd as _, RawFd},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

/// Every nftables table this module creates is named with this prefix,
/// then `<pid>_<n>` (pid of the creating process, n its counter).
pub const TABLE_PREFIX: &str = "ttft_trace_test_";

/// The process name of [`CpuHog`]'s processes (`comm`).
pub const HOG_COMM: &str = "ttft-cpu-hog";
const HOG_COMM_C: &std::ffi::CStr = c"ttft-cpu-hog";

static NEXT_TABLE: AtomicU32 = AtomicU32::new(0);

/// Which packets of a connection to the port are dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Packets to the port (`tcp dport`): the client's requests and ACKs.
    /// The client retransmits its requests; the server retransmits only
    /// when no later ACK arrives in time (rare with a steady stream).
    ToServer,
    /// Packets from the port (`tcp sport`): the server's responses and ACKs.
    /// The server retransmits its data (`tcp:tcp_retransmit_skb` on the
    /// server's socket) and the client's first token comes late.
    FromServer,
    /// Both, as on a lossy link (a round trip fails with about twice the
    /// probability: keep the percentage small).
    Both,
}

impl Direction {
    fn matches(self) -> &'static [&'static str] {
        match self {
            Direction::ToServer => &["dport"],
            Direction::FromServer => &["sport"],
            Direction::Both => &["dport", "sport"],
        }
    }
}

/// Random packet loss on a loopback TCP port while it lives: an nftables
/// table `inet ttft_trace_test_<pid>_<n>` with one chain on the input hook
/// and the rule `iifname "lo" tcp dport|sport <port> numgen random mod 100 <
/// <percent> counter drop`. Dropping the guard deletes the table.
///
/// Needs root and `nft` (`cargo xtask setup` installs nftables).
#[derive(Debug)]
pub struct PacketLoss {
    table: String,
    port: u16,
    percent: u32,
    direction: Direction,
    nft: PathBuf,
    deleted: bool,
}

impl PacketLoss {
    /// Drops `percent` % of the packets to `port` on loopback
    /// ([`Direction::ToServer`]: `tcp dport <port>`).
    pub fn start(port: u16, percent: u32) -> Result<Self> {
        Self::start_with(port, percent, Direction::ToServer)
    }

    /// Drops `percent` % of the packets of `direction` on loopback port `port`.
    /// Deletes stale tables of crashed runs first ([`cleanup_stale`]).
    pub fn start_with(port: u16, percent: u32, direction: Direction) -> Result<Self> {
        if percent > 100 {
            bail!("packet loss of {percent} %: at most 100");
        }
        if port == 0 {
            bail!("packet loss on port 0: give the port the server listens on");
        }
        let rules: String = direction
            .matches()
            .iter()
            .map(|m| {
                format!(
                    "\t\tiifname \"lo\" tcp {m} {port} numgen random mod 100 < {percent} counter drop\n"
                )
            })
            .collect();
        Self::create(port, percent, direction, &rules)
    }

    /// Drops `percent` % of the server's packets from `port` on loopback
    /// after the handshake (its SYN-ACKs pass): data, ACKs and FINs are lost
    /// and retransmitted, but a connect never waits out the SYN's doubling
    /// timeouts (five lost SYN-ACKs in a row are 31 s, past a client's
    /// timeout, once in about 200 connections at 35 %).
    pub fn from_server_after_handshake(port: u16, percent: u32) -> Result<Self> {
        if percent > 100 || port == 0 {
            bail!("packet loss of {percent} % on port {port}");
        }
        let rules = format!(
            "\t\tiifname \"lo\" tcp sport {port} tcp flags & syn == 0 numgen random mod 100 < {percent} counter drop\n"
        );
        Self::create(port, percent, Direction::FromServer, &rules)
    }

    /// Drops every client's ACK that would complete its handshake with
    /// `port` (its second packet, a bare ACK: conntrack counts it as it
    /// leaves): the client's first data segment then completes it, as when
    /// that ACK is lost on a real network.
    pub fn handshake_acks(port: u16) -> Result<Self> {
        let rules = format!(
            "\t\tiifname \"lo\" tcp dport {port} ct original packets 2 tcp flags == ack counter drop\n"
        );
        Self::create(port, 100, Direction::ToServer, &rules)
    }

    fn create(port: u16, percent: u32, direction: Direction, rules: &str) -> Result<Self> {
        let nft = nft_ready()?;
        if let Err(e) = cleanup_stale() {
            eprintln!("faults: could not clean up stale nftables tables: {e:#}");
        }
        let n = NEXT_TABLE.fetch_add(1, Ordering::Relaxed);
        let table = format!("{TABLE_PREFIX}{}_{n}", std::process::id());
        // Newlines, not "; }": nft 1.0.6 rejects a ';' before a table's '}'.
        let script = format!(
            "table inet {table} {{\n\tchain input {{\n\t\ttype filter hook input priority 0; policy accept;\n{rules}\t}}\n}}\n"
        );
        nft_run(&nft, &["-f", "-"], Some(&script))
            .with_context(|| format!("creating nftables table {table}"))?;
        Ok(Self {
            table,
            port,
            percent,
            direction,
            nft,
            deleted: false,
        })
    }

    /// The table's name (family `inet`).
    pub fn table(&self) -> &str {
        &self.table
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn percent(&self) -> u32 {
        self.percent
    }

    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Packets dropped so far (sum of the rules' counters).
    pub fn dropped(&self) -> Result<u64> {
        let text = nft_run(&self.nft, &["list", "table", "inet", &self.table], None)?;
        Ok(parse_counter_packets(&text))
    }

    /// Deletes the table now, reporting a failure (dropping the guard does
    /// the same but can only print it).
    pub fn stop(mut self) -> Result<()> {
        self.delete()
    }

    fn delete(&mut self) -> Result<()> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        nft_run(&self.nft, &["delete", "table", "inet", &self.table], None)
            .map(drop)
            .with_context(|| format!("deleting nftables table {}", self.table))
    }
}

impl Drop for PacketLoss {
    fn drop(&mut self) {
        if let Err(e) = self.delete() {
            eprintln!("faults: {e:#}");
        }
    }
}

/// Sums `counter packets N` over an `nft list` output.
fn parse_counter_packets(text: &str) -> u64 {
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(3)
        .filter(|w| w[0] == "counter" && w[1] == "packets")
        .filter_map(|w| w[2].parse::<u64>().ok())
        .sum()
}

/// The `nft` binary, when we are root and it is installed; else a clear error.
pub fn nft_ready() -> Result<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("packet loss needs root (it adds an nftables table); run as root");
    }
    nft_path().context(
        "nft not found (in PATH, /usr/sbin or /sbin): install nftables \
         (`cargo xtask setup` does, or `apt-get install -y nftables`)",
    )
}

fn nft_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join("nft"))
        .find(|p| p.is_file())
}

/// Runs nft with `args` (and `stdin`), returning its stdout; its stderr in
/// the error.
fn nft_run(nft: &Path, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let mut child = Command::new(nft)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", nft.display()))?;
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(text.as_bytes())
            .context("writing the nft script")?;
    }
    let out = child.wait_with_output().context("waiting for nft")?;
    if !out.status.success() {
        bail!(
            "nft {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The names of the `inet` tables whose name starts with [`TABLE_PREFIX`].
pub fn our_tables() -> Result<Vec<String>> {
    let nft = nft_ready()?;
    let text = nft_run(&nft, &["list", "tables"], None)?;
    Ok(text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .filter(|name| name.starts_with(TABLE_PREFIX))
        .map(str::to_string)
        .collect())
}

/// Deletes the [`TABLE_PREFIX`] tables left by processes that no longer
/// exist (crashed or killed runs); tables of live processes, this one
/// included, are kept. Returns the names deleted.
pub fn cleanup_stale() -> Result<Vec<String>> {
    let nft = nft_ready()?;
    let mut deleted = Vec::new();
    for table in our_tables()? {
        let pid = table
            .strip_prefix(TABLE_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|p| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|p| Path::new(&format!("/proc/{p}")).exists());
        if alive {
            continue;
        }
        match nft_run(&nft, &["delete", "table", "inet", &table], None) {
            Ok(_) => deleted.push(table),
            // Another process may have deleted it in the meantime.
            Err(e) if our_tables()?.contains(&table) => return Err(e),
            Err(_) => {}
        }
    }
    Ok(deleted)
}

/// Busy-looping child processes (`comm` [`HOG_COMM`]), each pinned to the
/// given CPUs, at normal priority (nice 0, SCHED_OTHER); killed on drop.
/// A hog also exits by itself once its parent process is gone.
#[derive(Debug)]
pub struct CpuHog {
    pids: Vec<libc::pid_t>,
    cpus: Vec<usize>,
}

impl CpuHog {
    /// Starts `threads` busy processes pinned to `cpus`.
    pub fn start(cpus: &[usize], threads: usize) -> Result<Self> {
        if threads == 0 {
            bail!("a CPU hog of 0 threads");
        }
        let set = cpu_set(cpus)?;
        let mut hog = Self {
            pids: Vec::new(),
            cpus: cpus.to_vec(),
        };
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        for _ in 0..threads {
            // The child writes one byte here once pinned and named.
            let (mut ready_r, ready_w) = std::io::pipe().context("pipe for the CPU hog")?;
            // SAFETY: the child only makes async-signal-safe system calls
            // (see `hog_child`) and never returns, so forking from a
            // multi-threaded test process is sound.
            let pid = unsafe { libc::fork() };
            if pid < 0 {
                return Err(std::io::Error::last_os_error()).context("fork for the CPU hog");
            }
            if pid == 0 {
                hog_child(parent, &set, ready_w.as_raw_fd());
            }
            hog.pids.push(pid);
            drop(ready_w);
            let mut byte = [0u8; 1];
            if !matches!(ready_r.read(&mut byte), Ok(1)) {
                bail!("CPU hog {pid} could not pin itself to CPUs {cpus:?}");
            }
        }
        Ok(hog)
    }

    /// The hog processes' pids.
    pub fn pids(&self) -> Vec<u32> {
        self.pids.iter().map(|&p| p as u32).collect()
    }

    /// The CPUs it is pinned to.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// Kills the hogs now (as dropping does).
    pub fn stop(self) {}
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        for &pid in &self.pids {
            // SAFETY: kill and waitpid on our own child processes.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
    }
}

/// The body of a hog process after fork: only raw system calls, no
/// allocation, no locks, never returns. Closes every inherited descriptor
/// (a pipe held open would keep its reader waiting), pins and names itself,
/// reports on `ready`, then spins.
fn hog_child(parent: libc::pid_t, set: &libc::cpu_set_t, ready: RawFd) -> ! {
    let ready_u = ready as u32;
    // SAFETY: plain system calls on this process; the name is NUL-terminated.
    unsafe {
        if ready_u > 0 {
            libc::syscall(libc::SYS_close_range, 0u32, ready_u - 1, 0u32);
        }
        libc::syscall(libc::SYS_close_range, ready_u + 1, u32::MAX, 0u32);
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) != 0 {
            libc::_exit(2);
        }
        libc::setpriority(libc::PRIO_PROCESS, 0, 0);
        libc::prctl(libc::PR_SET_NAME, HOG_COMM_C.as_ptr());
        libc::write(ready, c"k".as_ptr().cast(), 1);
        libc::close(ready);
    }
    let mut x: u64 = 0;
    loop {
        for _ in 0..1_000_000u32 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        // Reparented: the test process is gone, so stop.
        // SAFETY: getppid has no preconditions; _exit ends this process.
        unsafe {
            if libc::getppid() != parent {
                libc::_exit(0);
            }
        }
    }
}

fn cpu_set(cpus: &[usize]) -> Result<libc::cpu_set_t> {
    if cpus.is_empty() {
        bail!("an empty CPU list");
    }
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            bail!("CPU {cpu} is beyond CPU_SETSIZE");
        }
        // SAFETY: `cpu` is below CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    Ok(set)
}

/// The CPUs this process may run on (its affinity mask): where a server
/// started from here runs, and where a hog can share a CPU with it.
pub fn server_cpus() -> Result<Vec<usize>> {
    affinity(0)
}

/// The affinity of thread (or process) `tid`; 0 is the calling thread.
pub fn affinity(tid: u32) -> Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_getaffinity(tid as i32, size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("sched_getaffinity({tid})"));
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Pins every thread of process `pid` (each tid in `/proc/PID/task`) to
/// `cpus`; threads it creates later inherit the mask, and so do child
/// processes it starts later. Passes again until no new thread shows up
/// (bounded). Returns how many threads were pinned.
pub fn pin(pid: u32, cpus: &[usize]) -> Result<usize> {
    let set = cpu_set(cpus)?;
    let mut pinned = std::collections::BTreeSet::new();
    for _ in 0..10 {
        let before = pinned.len();
        for tid in tids(pid)? {
            if pinned.contains(&tid) {
                continue;
            }
            match set_affinity(tid, &set) {
                Ok(()) => {
                    pinned.insert(tid);
                }
                // A thread that exited meanwhile is fine.
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("pinning thread {tid} to {cpus:?}"));
                }
            }
        }
        if pinned.len() == before && before > 0 {
            return Ok(pinned.len());
        }
    }
    if pinned.is_empty() {
        bail!("process {pid} has no thread to pin");
    }
    Ok(pinned.len())
}

/// Pins one thread (or a single-threaded process) `tid` to `cpus`; 0 is the
/// calling thread.
pub fn pin_thread(tid: u32, cpus: &[usize]) -> Result<()> {
    set_affinity(tid, &cpu_set(cpus)?).with_context(|| format!("pinning thread {tid} to {cpus:?}"))
}

fn set_affinity(tid: u32, set: &libc::cpu_set_t) -> std::io::Result<()> {
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_setaffinity(tid as i32, size_of::<libc::cpu_set_t>(), set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The thread ids of process `pid`.
pub fn tids(pid: u32) -> Result<Vec<u32>> {
    let dir = format!("/proc/{pid}/task");
    Ok(fs::read_dir(&dir)
        .with_context(|| format!("reading {dir}"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect())
}

/// Time thread `tid` of `pid` has spent runnable but waiting for a CPU, in
/// ns: field 2 of `/proc/PID/task/TID/schedstat`.
pub fn thread_run_delay_ns(pid: u32, tid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/task/{tid}/schedstat");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    text.split_whitespace()
        .nth(1)
        .and_then(|f| f.parse().ok())
        .with_context(|| format!("odd {path}: {text:?}"))
}

/// The run-queue delay of all present threads of `pid`, in ns (threads that
/// exited are not counted).
pub fn run_delay_ns(pid: u32) -> Result<u64> {
    let mut sum = 0;
    for tid in tids(pid)? {
        match thread_run_delay_ns(pid, tid) {
            Ok(d) => sum += d,
            Err(_) if !Path::new(&format!("/proc/{pid}/task/{tid}")).exists() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(sum)
}

/// Samples the run-queue delay of every thread of a process (field 2 of
/// each `/proc/PID/task/TID/schedstat`) every few milliseconds, on a thread
/// of its own, against CLOCK_MONOTONIC: the kernel's own account, apart
/// from the tracer's, of how long the machine kept the process's runnable
/// threads off a CPU in any window of the run.
pub struct RunDelaySampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<RunDelays>>,
}

/// Sampling period of [`RunDelaySampler`]: the error at each edge of a
/// window.
const RUN_DELAY_PERIOD: Duration = Duration::from_millis(5);

impl RunDelaySampler {
    /// Starts sampling `pid`; its first sample is taken before this
    /// returns.
    pub fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let sample = move || {
            let at = crate::fixtures::monotonic_ns();
            let delays: BTreeMap<u32, u64> = tids(pid)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|tid| Some((tid, thread_run_delay_ns(pid, tid).ok()?)))
                .collect();
            (at, delays)
        };
        let mut samples = vec![sample()];
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                std::thread::sleep(RUN_DELAY_PERIOD);
                samples.push(sample());
            }
            // The last one after the stop: every window before it is covered.
            samples.push(sample());
            RunDelays { samples }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling; what was sampled.
    pub fn finish(mut self) -> RunDelays {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or(RunDelays {
                samples: Vec::new(),
            })
    }
}

impl Drop for RunDelaySampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What a [`RunDelaySampler`] sampled: (CLOCK_MONOTONIC ns, run-queue
/// delay so far of each thread, ns), oldest first.
pub struct RunDelays {
    samples: Vec<(u64, BTreeMap<u32, u64>)>,
}

impl RunDelays {
    /// The run-queue delay of the process's threads between `from` and `to`
    /// (CLOCK_MONOTONIC ns), summed over its threads: per thread, its delay
    /// at the last sample at or before `to` less that at the last sample at
    /// or before `from` (0 for a thread born since). Summed, it bounds from
    /// above how much the run queue can have delayed any one path through
    /// those threads. `None` when no sample precedes `from` or follows `to`.
    pub fn within(&self, from: u64, to: u64) -> Option<u64> {
        let at_or_before = |t: u64| self.samples.iter().rev().find(|(at, _)| *at <= t);
        self.samples.last().filter(|(at, _)| *at >= to)?;
        let (_, start) = at_or_before(from)?;
        let (_, end) = at_or_before(to)?;
        Some(
            end.iter()
                .map(|(tid, d)| d.saturating_sub(start.get(tid).copied().unwrap_or(0)))
                .sum(),
        )
    }
}

/// The calling thread's id.
pub fn gettid() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}

/// `Tcp: RetransSegs` of `/proc/net/snmp`: every TCP retransmission of this
/// network namespace so far.
pub fn tcp_retrans_segs() -> Result<u64> {
    let text = fs::read_to_string("/proc/net/snmp").context("reading /proc/net/snmp")?;
    let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = tcp
        .next()
        .zip(tcp.next())
        .context("no Tcp: lines in /proc/net/snmp")?;
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "RetransSegs")
        .and_then(|(_, v)| v.parse().ok())
        .context("no Tcp: RetransSegs in /proc/net/snmp")
}

/// Retransmissions of one socket so far (`tcpi_total_retrans` of TCP_INFO).
pub fn tcp_total_retrans(s: &TcpStream) -> Result<u32> {
    // SAFETY: tcp_info is plain data.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is writable for `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("getsockopt TCP_INFO");
    }
    Ok(info.tcpi_total_retrans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_summed() {
        let text = "table inet t {\n chain input {\n  iifname \"lo\" tcp dport 1 numgen random mod 100 < 30 counter packets 4 bytes 208 drop\n  iifname \"lo\" tcp sport 1 numgen random mod 100 < 30 counter packets 6 bytes 900 drop\n }\n}\n";
        assert_eq!(parse_counter_packets(text), 10);
    }

    #[test]
    fn hog_names_agree() {
        assert_eq!(HOG_COMM_C.to_str().ok(), Some(HOG_COMM));
    }

    #[test]
    fn cpu_sets() {
        assert!(cpu_set(&[]).is_err());
        assert!(cpu_set(&[usize::MAX]).is_err());
        let cpus = server_cpus().expect("own affinity");
        assert!(!cpus.is_empty());
    }

    #[test]
    fn snmp_and_schedstat_read() {
        tcp_retrans_segs().expect("RetransSegs");
        thread_run_delay_ns(std::process::id(), gettid()).expect("schedstat");
    }

    #[test]
    fn run_delay_over_a_window_is_per_thread_from_the_samples_around_it() {
        let at = |t: u64, d: &[(u32, u64)]| (t, d.iter().copied().collect());
        let delays = RunDelays {
            samples: vec![
                at(100, &[(1, 10), (2, 5)]),
                at(200, &[(1, 30), (2, 5)]),
                // Thread 3 born, thread 2 gone.
                at(300, &[(1, 35), (3, 7)]),
            ],
        };
        assert_eq!(delays.within(150, 250), Some(20));
        assert_eq!(delays.within(100, 300), Some(25 + 7));
        assert_eq!(delays.within(50, 250), None, "no sample before the window");
        assert_eq!(delays.within(150, 350), None, "no sample after the window");
        let sampler = RunDelaySampler::start(std::process::id());
        let from = crate::fixtures::monotonic_ns();
        std::thread::sleep(Duration::from_millis(30));
        let to = crate::fixtures::monotonic_ns();
        std::thread::sleep(Duration::from_millis(30));
        assert!(sampler.finish().within(from, to).is_some());
    }
}
