//! The /metrics listener's guard: a scrape is one short request, so a
//! client may neither hold a connection long (slowloris: headers sent a
//! byte at a time) nor open many. Each connection lives at most
//! [`CONNECTION_DEADLINE`]; past [`MAX_CONNECTIONS`] open at once, the
//! oldest is closed to make room, so a scraper that comes late is still
//! answered at once. Both are counted in
//! `ttft_trace_metrics_connections_closed_total{reason}`.

use std::{
    collections::VecDeque,
    future::Future as _,
    io,
    net::SocketAddr,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::Duration,
};

use prometheus::{IntCounterVec, Opts, Registry};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    time::{Sleep, sleep},
};

/// Connections open at once; the oldest is closed past it.
pub const MAX_CONNECTIONS: usize = 16;
/// How long one connection may live, whatever it does (a scrape takes
/// milliseconds; Prometheus reconnects for the next one).
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);

/// The open connections, oldest first: an id and a duplicate of the
/// socket, through which the oldest is shut down when a new one comes.
type Open = Arc<Mutex<VecDeque<(u64, OwnedFd)>>>;

/// A [`axum::serve::Listener`] that caps and times out its connections.
pub struct GuardedListener {
    inner: TcpListener,
    open: Open,
    next_id: u64,
    max: usize,
    deadline: Duration,
    closed: IntCounterVec,
}

impl GuardedListener {
    /// Guards `inner` with the given cap and deadline, counting closes in
    /// `registry`.
    pub fn new(
        inner: TcpListener,
        registry: &Registry,
        max: usize,
        deadline: Duration,
    ) -> prometheus::Result<Self> {
        let closed = IntCounterVec::new(
            Opts::new(
                "ttft_trace_metrics_connections_closed_total",
                "Connections to /metrics closed by the daemon: reason=timeout (open longer than \
                 the deadline), over_cap (the oldest, closed to make room for a new one)",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(closed.clone()))?;
        for reason in ["timeout", "over_cap"] {
            closed.with_label_values(&[reason]);
        }
        Ok(Self {
            inner,
            open: Open::default(),
            next_id: 0,
            max: max.max(1),
            deadline,
            closed,
        })
    }

    /// Registers `stream`, closing the oldest connection when at the cap.
    fn admit(&mut self, stream: &TcpStream) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        while open.len() >= self.max {
            let Some((_, oldest)) = open.pop_front() else {
                break;
            };
            // SAFETY: a socket descriptor we own (a duplicate); shutting it
            // down wakes its reader with end of file.
            unsafe { libc::shutdown(oldest.as_raw_fd(), libc::SHUT_RDWR) };
            self.closed.with_label_values(&["over_cap"]).inc();
        }
        // Without a duplicate the connection is still timed out, only not
        // closable early.
        if let Ok(dup) = stream.as_fd().try_clone_to_owned() {
            open.push_back((id, dup));
        }
        id
    }
}

impl axum::serve::Listener for GuardedListener {
    type Io = GuardedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let id = self.admit(&stream);
                    let io = GuardedStream {
                        inner: stream,
                        deadline: Box::pin(sleep(self.deadline)),
                        id,
                        open: self.open.clone(),
                        closed: self.closed.clone(),
                        timed_out: false,
                    };
                    return (io, addr);
                }
                // Out of descriptors, or a connection reset before it was
                // taken: wait a little rather than spin.
                Err(e) => {
                    log::debug!("/metrics: accept: {e}");
                    sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// One connection: fails every operation once its deadline has passed.
pub struct GuardedStream {
    inner: TcpStream,
    deadline: Pin<Box<Sleep>>,
    id: u64,
    open: Open,
    closed: IntCounterVec,
    timed_out: bool,
}

impl GuardedStream {
    /// The error every operation gets past the deadline (counted once).
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if !self.deadline.as_mut().poll(cx).is_ready() {
            return None;
        }
        if !self.timed_out {
            self.timed_out = true;
            self.closed.with_label_values(&["timeout"]).inc();
        }
        Some(io::Error::new(
            io::ErrorKind::TimedOut,
            "/metrics connection deadline",
        ))
    }
}

impl Drop for GuardedStream {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.retain(|(id, _)| *id != self.id);
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.expired(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.expired(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
