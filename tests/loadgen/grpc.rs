//! `loadgen grpc`: the client of the HTTP/2 bench (xtask/src/h2scale.rs).
//! CONNECTIONS HTTP/2 connections (the `h2` crate, prior knowledge), each
//! with STREAMS calls of the server-streaming method `/ttft.Gen/Stream`
//! (tests/stacks/tonic.rs with a pace) in flight at once, each call issued
//! again as soon as the one before it ended, for SECONDS; calls in flight
//! at the end are finished. Prints one line of JSON: calls completed,
//! messages (DATA frames with payload) received and their rate, errors.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use prost::bytes::Bytes;
use tokio::{net::TcpStream, task::JoinSet};

/// What the calls achieved, across connections.
#[derive(Default)]
struct Tally {
    calls: AtomicU64,
    messages: AtomicU64,
    errors: AtomicU64,
}

/// One call's request: the gRPC message `prompt` (5-byte prefix, no
/// compression).
const REQUEST: &[u8] = b"\0\0\0\0\x06prompt";

/// One call on `sender`: its DATA frames with payload, counted as messages.
async fn call(sender: h2::client::SendRequest<Bytes>, addr: SocketAddr) -> Result<u64> {
    let mut sender = sender.ready().await?;
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/ttft.Gen/Stream"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
    let (response, mut body) = sender.send_request(req, false)?;
    body.send_data(Bytes::from_static(REQUEST), true)?;
    let mut recv = response.await?.into_body();
    let mut messages = 0;
    while let Some(data) = recv.data().await {
        let data = data?;
        messages += u64::from(!data.is_empty());
        recv.flow_control().release_capacity(data.len())?;
    }
    recv.trailers().await?;
    Ok(messages)
}

/// One connection's `streams` calls in flight until `until`.
async fn connection(
    addr: SocketAddr,
    streams: usize,
    until: Instant,
    tally: Arc<Tally>,
) -> Result<()> {
    let tcp = TcpStream::connect(addr).await.context("connecting")?;
    tcp.set_nodelay(true)?;
    let (sender, conn) = h2::client::Builder::new()
        .max_concurrent_streams(streams as u32)
        .handshake::<_, Bytes>(tcp)
        .await?;
    tokio::spawn(conn);
    let mut calls = JoinSet::new();
    for _ in 0..streams {
        let (sender, tally) = (sender.clone(), tally.clone());
        calls.spawn(async move {
            while Instant::now() < until {
                match call(sender.clone(), addr).await {
                    Ok(m) => {
                        tally.calls.fetch_add(1, Relaxed);
                        tally.messages.fetch_add(m, Relaxed);
                    }
                    Err(e) => {
                        tally.errors.fetch_add(1, Relaxed);
                        eprintln!("loadgen grpc: {e:#}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
    }
    while calls.join_next().await.is_some() {}
    Ok(())
}

/// The load: `connections` × `streams` calls for `seconds`.
pub async fn load(
    addr: SocketAddr,
    connections: usize,
    streams: usize,
    seconds: f64,
) -> Result<()> {
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let mut conns = JoinSet::new();
    for _ in 0..connections {
        conns.spawn(connection(addr, streams, until, tally.clone()));
    }
    let mut failed = 0u64;
    while let Some(done) = conns.join_next().await {
        if let Err(e) = done.map_err(anyhow::Error::from).and_then(|r| r) {
            failed += 1;
            eprintln!("loadgen grpc: a connection failed: {e:#}");
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let messages = tally.messages.load(Relaxed);
    println!(
        "{}",
        serde_json::json!({
            "connections": connections, "streams_per_connection": streams,
            "seconds": secs, "calls": tally.calls.load(Relaxed),
            "messages": messages, "messages_per_s": messages as f64 / secs,
            "errors": tally.errors.load(Relaxed), "failed_connections": failed,
        })
    );
    Ok(())
}
