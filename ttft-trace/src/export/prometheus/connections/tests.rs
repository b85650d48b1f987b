use std::{
    io::{Read, Write},
    net::TcpStream as StdStream,
    time::Instant,
};

use super::*;
use crate::export::prometheus::{render, serve_guarded};

/// A scrape of `/metrics` at `addr`: the time the whole answer took.
fn scrape(addr: SocketAddr) -> (Duration, String) {
    let t = Instant::now();
    let mut s = StdStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("answer");
    (t.elapsed(), body)
}

/// Slowloris: 64 connections that send half a request header and then
/// nothing; a scraper that comes after them is answered at once, and the
/// slow connections are closed, counted by reason.
#[test]
fn slow_clients_neither_block_scrapes_nor_stay() {
    let registry = Registry::new();
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let addr = std_listener.local_addr().expect("addr");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let served = registry.clone();
    rt.spawn(async move { serve_guarded(std_listener, served, 8, Duration::from_secs(2)).await });
    let slow: Vec<StdStream> = (0..64)
        .map(|_| {
            let mut s = StdStream::connect(addr).expect("slow connect");
            s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                .expect("half");
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..5 {
        let (took, body) = scrape(addr);
        assert!(body.starts_with("HTTP/1.1 200"), "{body:.80}");
        assert!(took < Duration::from_secs(1), "a scrape took {took:?}");
    }
    // Past the deadline every slow connection is closed by the daemon.
    std::thread::sleep(Duration::from_millis(2500));
    let mut closed = 0;
    for mut s in slow {
        s.set_read_timeout(Some(Duration::from_secs(1))).ok();
        let mut b = [0u8; 64];
        // End of file or a reset: closed; a read timeout: still open.
        match s.read(&mut b) {
            Ok(0) => closed += 1,
            Err(e)
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                closed += 1
            }
            _ => {}
        }
    }
    assert_eq!(closed, 64, "slow connections left open");
    let text = render(&registry);
    let count = |reason: &str| -> u64 {
        let needle = format!("ttft_trace_metrics_connections_closed_total{{reason=\"{reason}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&needle))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    eprintln!(
        "closed: over_cap {} timeout {}",
        count("over_cap"),
        count("timeout")
    );
    assert!(count("over_cap") >= 56, "{text}");
    assert!(count("timeout") >= 1, "{text}");
    rt.shutdown_background();
}
