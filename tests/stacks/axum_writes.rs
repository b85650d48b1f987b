//! The axum server's own count of the sends that carry a response's body:
//! a listener whose connections count their writes. A write is one send
//! (`write` or `writev` of the bytes hyper hands over at once); it carries
//! body unless all its bytes are still the header block or it is only the
//! chunked terminator. A response begins with the first write after the
//! request's bytes were read (the clients ask one at a time).
//!
//! Each body write appends a JSON line `{"client_port", "request_index",
//! "writes"}` (the count so far; the last line of a request is its count),
//! so a server killed at the end of the test has written every count.
//!
//! With `STACK_STAMPS` set, the first body write of each response appends
//! there the request's own CLOCK_MONOTONIC stamps `{"client_port",
//! "request_index", "t_read", "t_send"}`: right after the read that returned
//! the request's first bytes, and right before the write that carried its
//! first body bytes.

use std::{
    fs::File,
    io::{self, IoSlice, Write},
    net::SocketAddr,
    path::Path,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use axum::serve::Listener;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};
use ttft_trace_tests::fixtures::monotonic_ns;

const HEADER_END: &[u8] = b"\r\n\r\n";
const CHUNKED_TERMINATOR: &[u8] = b"0\r\n\r\n";

/// The shared logs of every connection's counts, and of its stamps.
#[derive(Clone)]
pub struct Log {
    writes: Arc<Mutex<File>>,
    stamps: Option<Arc<Mutex<File>>>,
}

fn append(file: &Mutex<File>, line: &str) {
    let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
    if let Err(e) = f.write_all(line.as_bytes()) {
        eprintln!("stack-axum: log: {e}");
    }
}

impl Log {
    pub fn create(path: &Path) -> io::Result<Self> {
        let stamps = match std::env::var_os("STACK_STAMPS") {
            Some(p) if !p.is_empty() => Some(Arc::new(Mutex::new(
                File::options().create(true).append(true).open(p)?,
            ))),
            _ => None,
        };
        Ok(Self {
            writes: Arc::new(Mutex::new(File::create(path)?)),
            stamps,
        })
    }

    fn record(&self, client_port: u16, request_index: u64, writes: u64) {
        append(
            &self.writes,
            &format!(
                "{{\"client_port\":{client_port},\"request_index\":{request_index},\"writes\":{writes}}}\n"
            ),
        );
    }

    fn stamp(&self, client_port: u16, request_index: u64, t_read: u64, t_send: u64) {
        if let Some(stamps) = &self.stamps {
            append(
                stamps,
                &format!(
                    "{{\"client_port\":{client_port},\"request_index\":{request_index},\"t_read\":{t_read},\"t_send\":{t_send}}}\n"
                ),
            );
        }
    }
}

pub struct CountingListener {
    inner: TcpListener,
    log: Log,
}

impl CountingListener {
    pub fn new(inner: TcpListener, log: Log) -> Self {
        Self { inner, log }
    }
}

impl Listener for CountingListener {
    type Io = CountingStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = Listener::accept(&mut self.inner).await;
        let stream = CountingStream {
            inner: io,
            log: self.log.clone(),
            client_port: addr.port(),
            request_index: 0,
            t_read: 0,
            responding: false,
            header_done: false,
            writes: 0,
        };
        (stream, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

pub struct CountingStream {
    inner: TcpStream,
    log: Log,
    client_port: u16,
    /// The request being answered on this connection, from 1.
    request_index: u64,
    /// When the read that returned its first bytes returned.
    t_read: u64,
    /// Whether the current request's response has begun.
    responding: bool,
    header_done: bool,
    writes: u64,
}

impl CountingStream {
    /// Bytes of a request read at `t`: the next write begins a new response.
    fn on_read(&mut self, t: u64) {
        if self.responding || self.request_index == 0 {
            self.request_index += 1;
            self.t_read = t;
            (self.responding, self.header_done, self.writes) = (false, false, 0);
        }
    }

    /// The `n` bytes one write begun at `t` moved, the first `n` of `bufs`.
    fn on_write(&mut self, bufs: &[IoSlice<'_>], n: usize, t: u64) {
        let mut sent = Vec::with_capacity(n);
        for b in bufs {
            let take = (n - sent.len()).min(b.len());
            sent.extend_from_slice(&b[..take]);
        }
        self.responding = true;
        let body = if self.header_done {
            &sent[..]
        } else {
            match sent.windows(HEADER_END.len()).position(|w| w == HEADER_END) {
                Some(at) => {
                    self.header_done = true;
                    &sent[at + HEADER_END.len()..]
                }
                None => return,
            }
        };
        if !body.is_empty() && body != CHUNKED_TERMINATOR {
            self.writes += 1;
            self.log
                .record(self.client_port, self.request_index, self.writes);
            if self.writes == 1 {
                self.log
                    .stamp(self.client_port, self.request_index, self.t_read, t);
            }
        }
    }
}

impl AsyncRead for CountingStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.on_read(monotonic_ns());
        }
        polled
    }
}

impl AsyncWrite for CountingStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let t = monotonic_ns();
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled
            && n > 0
        {
            self.on_write(&[IoSlice::new(buf)], n, t);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let t = monotonic_ns();
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled
            && n > 0
        {
            self.on_write(bufs, n, t);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
