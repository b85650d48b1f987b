//! The load generator of the scale bench (`cargo xtask bench --only scale`, see
//! xtask/src/scale.rs): a streaming completion server and a client that
//! holds many keep-alive connections, both on loopback, bounded in count and
//! in time.
//!
//!   loadgen serve --cudart PATH [--port 0] [--chunk-ms 50] [--engines 8] [--step-us 1000]
//!   loadgen load --addr 127.0.0.1:PORT --connections N --seconds S [--max-tokens K]
//!                [--steps-per-chunk N] [--stagger-s S]
//!   loadgen grpc --addr 127.0.0.1:PORT --connections N --streams M --seconds S
//!
//! (`grpc`: HTTP/2 calls against tests/stacks/tonic.rs, see `grpc.rs`.)
//!
//! The server is shaped like a host of continuous-batching engines (`--engines`,
//! as with that many GPUs): each engine runs a decode step (a kernel, the
//! tokens' device-to-host copy, a stream synchronisation, on the stub CUDA
//! runtime so that `ttft-trace attach` accepts and probes the process) every
//! `--chunk-ms`, the engines' steps spread evenly over that period and run by
//! one GPU thread, and every stream in flight on an engine sends one SSE
//! chunk per step of it. So each connection receives one chunk per step (20
//! a second at 50 ms) for as long as the machine keeps up, or one every
//! `steps_per_chunk` steps when the request asks so, and the GPU episodes
//! stay at one per step whatever the number of streams.
//!
//! Responses are HTTP/1.1 `Transfer-Encoding: chunked`, `text/event-stream`:
//! the headers in one send, then one send per step with one chunk of
//! `data: {...}\n\n`; the last step's send also carries `data: [DONE]` and the
//! terminator. The tracer sees each POST as a request whose first token is
//! the first send after the headers.
//!
//! The client connects all `--connections` first (at most 256 connects in
//! flight), says so on a line of JSON, then each connection issues streamed
//! requests back to back for `--seconds`, the first requests spread over
//! `--stagger-s`; requests in flight at the end are finished, none is
//! started after it. Its last line of JSON gives what was achieved:
//! requests completed, chunks received in the window.

use std::{
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpSocket, TcpStream},
    sync::{Semaphore, watch},
    task::JoinSet,
};
use ttft_trace_tests::stub_gpu::StubGpu;

mod grpc;

#[derive(Parser)]
#[command(about = "Loopback load generator of the scale bench")]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Serve streamed completions on 127.0.0.1; prints
    /// `listening on http://ADDR` once it accepts.
    Serve {
        /// The stub CUDA runtime (target/fixtures/libcudart.so.12); its
        /// driver libcuda.so.1 is loaded from the same directory.
        #[arg(long)]
        cudart: PathBuf,
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Period of each engine's decode step, hence of each stream's
        /// chunks.
        #[arg(long, default_value_t = 50)]
        chunk_ms: u64,
        /// Engines (batches, as on a host with that many GPUs), each with
        /// its share of the connections and its own step, their steps
        /// spread evenly over the period.
        #[arg(long, default_value_t = 8)]
        engines: usize,
        /// Emulated device time of one step's kernel.
        #[arg(long, default_value_t = 1000)]
        step_us: u64,
    },
    /// Hold CONNECTIONS keep-alive connections issuing streamed requests
    /// back to back for SECONDS.
    Load {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        connections: usize,
        #[arg(long)]
        seconds: f64,
        /// Chunks per response (the request's `max_tokens`).
        #[arg(long, default_value_t = 100)]
        max_tokens: u64,
        /// One chunk every this many decode steps of the server (the
        /// request's `steps_per_chunk`): 4 at 50 ms steps is 5 a second.
        #[arg(long, default_value_t = 1)]
        steps_per_chunk: u64,
        /// Spread the connections' first requests evenly over this many
        /// seconds, so that requests arrive at a steady rate rather than
        /// all at once (the window still starts at once).
        #[arg(long, default_value_t = 0.0)]
        stagger_s: f64,
    },
    /// Hold CONNECTIONS HTTP/2 connections with STREAMS gRPC calls in
    /// flight on each for SECONDS.
    Grpc {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        connections: usize,
        #[arg(long)]
        streams: usize,
        #[arg(long)]
        seconds: f64,
    },
}

/// Raises the soft open-file limit to the hard one and returns it: each
/// connection is a descriptor, on each side. (Raising the hard limit needs
/// CAP_SYS_RESOURCE, which a container's root may lack.)
fn raise_nofile() -> Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        bail!("getrlimit: {}", std::io::Error::last_os_error());
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        bail!("raising RLIMIT_NOFILE: {}", std::io::Error::last_os_error());
    }
    Ok(lim.rlim_cur)
}

/// Runs each engine's step every `period`, the engines in turn (one step
/// every `period / engines`), and announces each on the engine's `ticks`.
/// A step that overruns its time is not made up for: the streams then get
/// fewer chunks a second, which the client measures.
fn gpu_loop(
    gpu: &StubGpu,
    ticks: &[watch::Sender<u64>],
    period: Duration,
    step: Duration,
) -> Result<()> {
    let step_ns = u64::try_from(step.as_nanos()).context("step time")?;
    let every = period / u32::try_from(ticks.len()).context("engines")?;
    let mut next = Instant::now();
    let mut n = 0u64;
    loop {
        for tick in ticks {
            gpu.step(step_ns)?;
            n += 1;
            tick.send_replace(n);
            next += every;
            match next.checked_duration_since(Instant::now()) {
                Some(wait) => std::thread::sleep(wait),
                None => next = Instant::now(),
            }
        }
    }
}

const RESPONSE_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n";
const NOT_FOUND: &[u8] = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
const DONE: &[u8] = b"data: [DONE]\n\n";
/// A request head larger than this is refused (the connection is closed).
const MAX_HEAD: usize = 64 * 1024;

/// Appends one chunk of `Transfer-Encoding: chunked` holding `data`.
fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Reads from `s` into `buf` until it holds a whole request head; returns
/// its length with the `\r\n\r\n`, or None at a clean end of stream.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<Option<usize>> {
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(Some(i + 4));
        }
        if buf.len() > MAX_HEAD {
            bail!("request head over {MAX_HEAD} bytes");
        }
        if s.read_buf(buf).await? == 0 {
            if buf.is_empty() {
                return Ok(None);
            }
            bail!("end of stream inside a head");
        }
    }
}

/// The value of header `name` (lower case) in `head`.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.split("\r\n").skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Serves one connection: requests one after the other, each streamed.
async fn serve_connection(mut s: TcpStream, mut tick: watch::Receiver<u64>) -> Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut out = Vec::with_capacity(512);
    while let Some(head_len) = read_head(&mut s, &mut buf).await? {
        let head = std::str::from_utf8(&buf[..head_len]).context("request head")?;
        let body_len: usize = header(head, "content-length").map_or(Ok(0), str::parse)?;
        let found = head.starts_with("POST /v1/completions ");
        while buf.len() < head_len + body_len {
            if s.read_buf(&mut buf).await? == 0 {
                bail!("end of stream inside a body");
            }
        }
        let body = serde_json::from_slice::<serde_json::Value>(&buf[head_len..][..body_len])
            .unwrap_or_default();
        let tokens = body["max_tokens"].as_u64().unwrap_or(16).max(1);
        // A stream slower than the steps: one token every n of them.
        let stride = body["steps_per_chunk"].as_u64().unwrap_or(1).clamp(1, 1000);
        buf.drain(..head_len + body_len);
        if !found {
            s.write_all(NOT_FOUND).await?;
            continue;
        }
        s.write_all(RESPONSE_HEAD).await?;
        // The first token comes from the first step after the arrival.
        tick.mark_unchanged();
        for i in 0..tokens {
            for _ in 0..stride {
                tick.changed().await?;
            }
            out.clear();
            let data = format!(
                "data: {{\"id\":\"cmpl-scale\",\"object\":\"text_completion\",\"model\":\"scale\",\
                 \"choices\":[{{\"index\":0,\"text\":\" tok{i}\",\"finish_reason\":null}}]}}\n\n"
            );
            push_chunk(&mut out, data.as_bytes());
            if i + 1 == tokens {
                push_chunk(&mut out, DONE);
                out.extend_from_slice(b"0\r\n\r\n");
            }
            s.write_all(&out).await?;
        }
    }
    Ok(())
}

async fn serve(
    cudart: &Path,
    port: u16,
    engines: usize,
    period: Duration,
    step: Duration,
) -> Result<()> {
    let files = raise_nofile()?;
    let gpu = StubGpu::load(cudart)?;
    let (ticks, tick_rx): (Vec<_>, Vec<_>) =
        (0..engines.max(1)).map(|_| watch::channel(0u64)).unzip();
    std::thread::Builder::new()
        .name("gpu".into())
        .spawn(move || {
            if let Err(e) = gpu_loop(&gpu, &ticks, period, step) {
                eprintln!("loadgen serve: GPU thread: {e:#}");
                std::process::exit(1);
            }
        })?;
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], port)))?;
    // The kernel caps the backlog at net.core.somaxconn; the client
    // connects at most 256 at a time.
    let listener = socket.listen(4096)?;
    println!(
        "listening on http://{} (up to {files} open files)",
        listener.local_addr()?
    );
    std::io::stdout().flush()?;
    let errors = Arc::new(AtomicU64::new(0));
    let mut accepted = 0usize;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        // Connections go to the engines in turn.
        let tick = tick_rx[accepted % tick_rx.len()].clone();
        accepted = accepted.wrapping_add(1);
        let errors = errors.clone();
        tokio::spawn(async move {
            // The first failure says what; the client counts them all.
            if let Err(e) = serve_connection(stream, tick).await
                && errors.fetch_add(1, Relaxed) == 0
            {
                eprintln!("loadgen serve: a connection failed: {e:#}");
            }
        });
    }
}

/// What the client achieved, summed over its connections.
#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    chunks: AtomicU64,
    chunks_in_window: AtomicU64,
    errors: AtomicU64,
}

/// The part of the run whose chunks give the rate achieved: every
/// connection streaming (after the stagger), until the deadline.
#[derive(Clone, Copy)]
struct Window {
    from: Instant,
    deadline: Instant,
}

/// Reads one chunked SSE response from `s` (bytes already read are in
/// `buf`); counts its token chunks. Bytes past the response stay in `buf`.
async fn read_response(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    window: Window,
    tally: &Tally,
) -> Result<()> {
    let head_len = read_head(s, buf)
        .await?
        .context("connection closed before a response")?;
    if !buf.starts_with(b"HTTP/1.1 200 ") {
        bail!("{:?}", String::from_utf8_lossy(&buf[..head_len]));
    }
    buf.drain(..head_len);
    loop {
        // A chunk: its size in hex, CRLF, the data, CRLF.
        let line = loop {
            if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                break i;
            }
            if buf.len() > 32 || s.read_buf(buf).await? == 0 {
                bail!("bad chunk size line");
            }
        };
        let size = usize::from_str_radix(std::str::from_utf8(&buf[..line])?.trim(), 16)?;
        let total = line + 2 + size + 2;
        while buf.len() < total {
            if s.read_buf(buf).await? == 0 {
                bail!("end of stream inside a chunk");
            }
        }
        let data = &buf[line + 2..][..size];
        let token = size > 0 && data != DONE;
        buf.drain(..total);
        if size == 0 {
            return Ok(());
        }
        if token {
            tally.chunks.fetch_add(1, Relaxed);
            let now = Instant::now();
            if now >= window.from && now < window.deadline {
                tally.chunks_in_window.fetch_add(1, Relaxed);
            }
        }
    }
}

/// Streamed requests back to back on one connection from `first` until
/// the window's deadline.
async fn drive(
    mut s: TcpStream,
    first: Instant,
    window: Window,
    shape: Shape,
    tally: &Tally,
) -> Result<()> {
    let body = format!(
        "{{\"model\":\"scale\",\"prompt\":\"Say something.\",\"max_tokens\":{},\
         \"steps_per_chunk\":{},\"stream\":true}}",
        shape.max_tokens, shape.steps_per_chunk
    );
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut buf = Vec::with_capacity(1024);
    tokio::time::sleep_until(first.into()).await;
    while Instant::now() < window.deadline {
        s.write_all(request.as_bytes()).await?;
        read_response(&mut s, &mut buf, window, tally).await?;
        tally.requests.fetch_add(1, Relaxed);
    }
    Ok(())
}

/// What each request asks for, and when each connection's first goes.
#[derive(Clone, Copy)]
struct Shape {
    max_tokens: u64,
    steps_per_chunk: u64,
    stagger_s: f64,
}

async fn load(addr: SocketAddr, connections: usize, seconds: f64, shape: Shape) -> Result<()> {
    // The connections and the runtime's own descriptors.
    let files = raise_nofile()?;
    if u64::try_from(connections)? + 64 > files {
        bail!("{connections} connections need more than the {files} open files allowed");
    }
    let started = Instant::now();
    let connects = Arc::new(Semaphore::new(256));
    let mut pending = JoinSet::new();
    for _ in 0..connections {
        let connects = connects.clone();
        pending.spawn(async move {
            let _permit = connects.acquire_owned().await?;
            let s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            anyhow::Ok(s)
        });
    }
    let mut streams = Vec::with_capacity(connections);
    let mut failed = 0u64;
    while let Some(r) = pending.join_next().await {
        match r? {
            Ok(s) => streams.push(s),
            Err(e) => {
                if failed == 0 {
                    eprintln!("loadgen load: a connect failed: {e:#}");
                }
                failed += 1;
            }
        }
    }
    println!(
        "{}",
        serde_json::json!({"connected": streams.len(), "failed_connects": failed,
            "connect_s": started.elapsed().as_secs_f64()})
    );
    std::io::stdout().flush()?;

    let tally = Arc::new(Tally::default());
    let window = Duration::try_from_secs_f64(seconds)?;
    let start = Instant::now();
    let stagger = Duration::try_from_secs_f64(shape.stagger_s)?;
    if stagger >= window {
        bail!("the stagger is not shorter than the run");
    }
    let window = Window {
        from: start + stagger,
        deadline: start + window,
    };
    let mut running = JoinSet::new();
    let n = streams.len().max(1) as f64;
    for (i, s) in streams.into_iter().enumerate() {
        let tally = tally.clone();
        let first = start + Duration::try_from_secs_f64(shape.stagger_s * i as f64 / n)?;
        running.spawn(async move {
            if let Err(e) = drive(s, first, window, shape, &tally).await
                && tally.errors.fetch_add(1, Relaxed) == 0
            {
                eprintln!("loadgen load: a connection failed: {e:#}");
            }
        });
    }
    while running.join_next().await.transpose()?.is_some() {}
    let elapsed = start.elapsed().as_secs_f64();
    let in_window = tally.chunks_in_window.load(Relaxed);
    println!(
        "{}",
        serde_json::json!({
            "connections": connections, "failed_connects": failed, "seconds": seconds,
            "max_tokens": shape.max_tokens, "steps_per_chunk": shape.steps_per_chunk,
            "elapsed_s": elapsed,
            "requests": tally.requests.load(Relaxed), "chunks": tally.chunks.load(Relaxed),
            "chunks_in_window": in_window,
            "chunks_per_s": in_window as f64 / (seconds - shape.stagger_s),
            "connection_errors": tally.errors.load(Relaxed),
        })
    );
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.mode {
        Mode::Serve {
            cudart,
            port,
            chunk_ms,
            engines,
            step_us,
        } => rt.block_on(serve(
            &cudart,
            port,
            engines,
            Duration::from_millis(chunk_ms),
            Duration::from_micros(step_us),
        )),
        Mode::Load {
            addr,
            connections,
            seconds,
            max_tokens,
            steps_per_chunk,
            stagger_s,
        } => rt.block_on(load(
            addr,
            connections,
            seconds,
            Shape {
                max_tokens,
                steps_per_chunk,
                stagger_s,
            },
        )),
        Mode::Grpc {
            addr,
            connections,
            streams,
            seconds,
        } => rt.block_on(grpc::load(addr, connections, streams, seconds)),
    }
}
