//! The tonic stack of tests/tests/grpc.rs: the server-streaming method
//! `/ttft.Gen/Stream` and the bidirectional `/ttft.Gen/Chat` of
//! tests/stacks/grpc_stream.py, on tonic (Rust, hyper's HTTP/2) instead of
//! grpcio's C core. Bytes in and out, no
//! protobuf (a pass-through codec, as the grpcio server's generic handler
//! has): the same Python client calls either. Each call streams `MSGS`
//! messages, each after a step of the stub CUDA runtime of tests/fixtures
//! (dlopen): a 20 ms prefill before the first, a 5 ms decode step before
//! each later one, one GPU for all calls (gpu.py's pacing). A cancelled
//! call (its receiver dropped) stops at its next message. A bidirectional
//! call streams the same once it has read its first message (the prompt);
//! the client's later messages are read and dropped. The prompt `fail`
//! is answered with one message, then `RESOURCE_EXHAUSTED` (as by the
//! other two servers).
//!
//! With a pace (the HTTP/2 bench, xtask/src/h2scale.rs), each call streams
//! `MSGS` messages of 32 bytes one every `PACE_MS` instead, from a task of
//! its own, no GPU step (the stub runtime is loaded so that the tracer
//! attaches): thousands of concurrent calls, their frames written by
//! hyper's connection task as they come.
//!
//!   stack-tonic PORT CUDART [PACE_MS MSGS]

use std::{
    convert::Infallible,
    future::Future,
    path::Path,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use anyhow::{Result, bail};
use prost::bytes::{Buf, BufMut, Bytes};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{
    Status,
    body::Body,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::{Service, http},
    server::{Grpc, NamedService, ServerStreamingService, StreamingService},
};
use ttft_trace_tests::stub_gpu::StubGpu;

/// Messages per call (grpc_stream.py's `MSGS`).
const MSGS: u32 = 6;
const PREFILL_NS: u64 = 20_000_000;
const DECODE_NS: u64 = 5_000_000;
const METHOD: &str = "/ttft.Gen/Stream";
const BIDI_METHOD: &str = "/ttft.Gen/Chat";

/// Messages as they are on the wire: bytes.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// The method: one GPU thread per call, its messages through a channel;
/// or, with a pace, `(period, messages)` from a task per call.
#[derive(Clone)]
struct Generate {
    gpu: Arc<Mutex<StubGpu>>,
    pace: Option<(std::time::Duration, u32)>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Generate {
    /// A call's answer: `MSGS` messages from a GPU thread of its own, or
    /// the paced messages.
    fn answer(&self) -> ReceiverStream<Result<Bytes, Status>> {
        if let Some((period, msgs)) = self.pace {
            return paced(period, msgs);
        }
        let gpu = self.gpu.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(MSGS as usize);
        std::thread::spawn(move || {
            for i in 0..MSGS {
                let ns = if i == 0 { PREFILL_NS } else { DECODE_NS };
                let stepped = gpu
                    .lock()
                    .map_err(|_| Status::internal("GPU lock poisoned"))
                    .and_then(|g| g.step(ns).map_err(|e| Status::internal(e.to_string())));
                let msg = stepped.map(|()| Bytes::from(format!("token {i}")));
                let failed = msg.is_err();
                // The client's cancel dropped the stream: stop there.
                if tx.blocking_send(msg).is_err() || failed {
                    return;
                }
            }
        });
        ReceiverStream::new(rx)
    }
}

/// The prompt (grpc_stream.py's `FAIL_PROMPT`) answered with one message,
/// then the status [`FAIL_CODE`] with [`FAIL_MESSAGE`] in the trailers.
const FAIL_PROMPT: &[u8] = b"fail";
const FAIL_MESSAGE: &str = "KV cache full";

fn failing() -> ReceiverStream<Result<Bytes, Status>> {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tokio::spawn(async move {
        if tx.send(Ok(Bytes::from_static(b"token 0"))).await.is_ok() {
            let _ = tx.send(Err(Status::resource_exhausted(FAIL_MESSAGE))).await;
        }
    });
    ReceiverStream::new(rx)
}

/// `msgs` messages of 32 bytes, one every `period`, the first after one.
fn paced(period: std::time::Duration, msgs: u32) -> ReceiverStream<Result<Bytes, Status>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        for i in 0..msgs {
            tick.tick().await;
            let msg = Bytes::from(format!("{i:>32}"));
            if tx.send(Ok(msg)).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

impl ServerStreamingService<Bytes> for Generate {
    type Response = Bytes;
    type ResponseStream = ReceiverStream<Result<Bytes, Status>>;
    type Future = BoxFuture<Result<tonic::Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        if request.get_ref().as_ref() == FAIL_PROMPT {
            return Box::pin(async move { Ok(tonic::Response::new(failing())) });
        }
        let answer = self.answer();
        Box::pin(async move { Ok(tonic::Response::new(answer)) })
    }
}

impl StreamingService<Bytes> for Generate {
    type Response = Bytes;
    type ResponseStream = ReceiverStream<Result<Bytes, Status>>;
    type Future = BoxFuture<Result<tonic::Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Bytes>>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let mut input = request.into_inner();
            input.message().await?;
            // The client's later messages, until it half closes.
            tokio::spawn(async move { while let Ok(Some(_)) = input.message().await {} });
            Ok(tonic::Response::new(this.answer()))
        })
    }
}

/// The service `ttft.Gen`: routes its two methods, refuses the others.
#[derive(Clone)]
struct Gen(Generate);

impl NamedService for Gen {
    const NAME: &'static str = "ttft.Gen";
}

impl<B> Service<http::Request<B>> for Gen
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = self.0.clone();
        Box::pin(async move {
            match req.uri().path() {
                METHOD => Ok(Grpc::new(RawCodec).server_streaming(method, req).await),
                BIDI_METHOD => Ok(Grpc::new(RawCodec).streaming(method, req).await),
                other => Ok(Status::unimplemented(other.to_string()).into_http()),
            }
        })
    }
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(port), Some(cudart)) = (args.next(), args.next()) else {
        bail!("usage: stack-tonic PORT CUDART [PACE_MS MSGS]");
    };
    let pace = match (args.next(), args.next()) {
        (Some(ms), Some(msgs)) => {
            Some((std::time::Duration::from_millis(ms.parse()?), msgs.parse()?))
        }
        _ => None,
    };
    let gpu = Arc::new(Mutex::new(StubGpu::load(Path::new(&cudart))?));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async move {
            let addr = format!("127.0.0.1:{port}").parse()?;
            tonic::transport::Server::builder()
                .add_service(Gen(Generate { gpu, pace }))
                .serve(addr)
                .await?;
            Ok(())
        })
}
