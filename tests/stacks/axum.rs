//! The axum (hyper) stack of tests/tests/stacks.rs: the same streamed
//! completions as tests/stacks/apps.py, with hyper doing all of the HTTP.
//! The GPU steps call the stub CUDA runtime of tests/fixtures (dlopen).
//!
//!   stack-axum PORT CUDART

use std::{
    convert::Infallible,
    ffi::{CString, c_void},
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result, bail};
use axum::{
    Router,
    body::{Body, Bytes},
    http::{Uri, header},
    response::Response,
    routing::post,
};
use tokio_stream::wrappers::ReceiverStream;

/// `struct ttft_stub_kernel` of tests/fixtures/cuda_api.h: "TTFTKERN".
const STUB_KERNEL_MAGIC: u64 = 0x4e52_454b_5446_5454;
const D2H: i32 = 2;
const PREFILL_NS: u64 = 20_000_000;
const DECODE_NS: u64 = 5_000_000;

#[repr(C)]
struct Dim3(u32, u32, u32);

#[repr(C)]
struct Kernel {
    magic: u64,
    duration_ns: u64,
}

type Launch =
    unsafe extern "C" fn(*const c_void, Dim3, Dim3, *mut *mut c_void, usize, *mut c_void) -> i32;
type Copy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, i32, *mut c_void) -> i32;
type Sync = unsafe extern "C" fn(*mut c_void) -> i32;
type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> i32;

/// The emulated device: one step at a time.
struct Gpu {
    launch: Launch,
    copy: Copy,
    sync: Sync,
    dev: usize,
}

fn sym(lib: *mut c_void, name: &str) -> Result<*mut c_void> {
    let c = CString::new(name)?;
    // SAFETY: lib is a handle from dlopen; c is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        bail!("{name} not in the CUDA runtime");
    }
    Ok(p)
}

impl Gpu {
    fn load(path: &str) -> Result<Self> {
        // The stub runtime binds to the stub driver next to it.
        let dir = std::path::Path::new(path)
            .parent()
            .context("runtime path")?;
        let drv = CString::new(dir.join("libcuda.so.1").to_str().context("path")?)?;
        // SAFETY: dlopen of the fixture libraries, kept loaded for the process.
        unsafe { libc::dlopen(drv.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        let rt = CString::new(path)?;
        // SAFETY: as above.
        let lib = unsafe { libc::dlopen(rt.as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            bail!("dlopen {path} failed");
        }
        // SAFETY: the CUDA 12 runtime signatures (tests/fixtures/cuda_api.h).
        let (launch, copy, sync, malloc) = unsafe {
            (
                std::mem::transmute::<*mut c_void, Launch>(sym(lib, "cudaLaunchKernel")?),
                std::mem::transmute::<*mut c_void, Copy>(sym(lib, "cudaMemcpyAsync")?),
                std::mem::transmute::<*mut c_void, Sync>(sym(lib, "cudaStreamSynchronize")?),
                std::mem::transmute::<*mut c_void, Malloc>(sym(lib, "cudaMalloc")?),
            )
        };
        let mut dev = std::ptr::null_mut();
        // SAFETY: cudaMalloc writes the device pointer.
        if unsafe { malloc(&mut dev, 4) } != 0 {
            bail!("cudaMalloc failed");
        }
        Ok(Self {
            launch,
            copy,
            sync,
            dev: dev as usize,
        })
    }

    /// One step: a kernel of `ns`, the token's 4-byte copy back, a sync.
    fn step(&self, ns: u64) -> Result<()> {
        let k = Kernel {
            magic: STUB_KERNEL_MAGIC,
            duration_ns: ns,
        };
        let mut token = 0i32;
        // The default stream, and no kernel arguments.
        let stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: `k` and `token` outlive the synchronisation that ends the step.
        let rc = unsafe {
            [
                (self.launch)(
                    (&raw const k).cast(),
                    Dim3(1, 1, 1),
                    Dim3(128, 1, 1),
                    std::ptr::null_mut(),
                    0,
                    stream,
                ),
                (self.copy)(
                    (&raw mut token).cast(),
                    self.dev as *const c_void,
                    4,
                    D2H,
                    stream,
                ),
                (self.sync)(stream),
            ]
        };
        if rc.iter().any(|&r| r != 0) {
            bail!("CUDA error {rc:?}");
        }
        Ok(())
    }
}

fn chunk(path: &str, i: u64) -> Bytes {
    let word = format!(" tok{i}");
    let body = match path {
        "/v1/chat/completions" => serde_json::json!({
            "id": "chatcmpl-stack", "object": "chat.completion.chunk", "created": 0,
            "model": "stack",
            "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": null}]}),
        "/v1/completions" => serde_json::json!({
            "id": "cmpl-stack", "object": "text_completion", "created": 0, "model": "stack",
            "choices": [{"index": 0, "text": word, "finish_reason": null}]}),
        _ => {
            return Bytes::from(format!(
                "{}\n",
                serde_json::json!({"model": "stack", "response": word, "done": false})
            ));
        }
    };
    Bytes::from(format!("data: {body}\n\n"))
}

fn last(path: &str) -> Bytes {
    if path == "/api/generate" {
        Bytes::from(format!(
            "{}\n",
            serde_json::json!({"model": "stack", "response": "", "done": true})
        ))
    } else {
        Bytes::from_static(b"data: [DONE]\n\n")
    }
}

async fn complete(gpu: Arc<Mutex<Gpu>>, uri: Uri, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let n = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["max_tokens"].as_u64())
        .unwrap_or(8)
        .max(1);
    let content_type = if path == "/api/generate" {
        "application/x-ndjson"
    } else {
        "text/event-stream"
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(4);
    tokio::task::spawn_blocking(move || {
        for i in 0..n {
            let step = gpu
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .step(if i == 0 { PREFILL_NS } else { DECODE_NS });
            if let Err(e) = step {
                eprintln!("stack-axum: {e}");
                return;
            }
            if tx.blocking_send(Ok(chunk(&path, i))).is_err() {
                return;
            }
        }
        let _ = tx.blocking_send(Ok(last(&path)));
    });
    let mut resp = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    resp
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(port), Some(cudart)) = (args.next(), args.next()) else {
        bail!("usage: stack-axum PORT CUDART");
    };
    let gpu = Arc::new(Mutex::new(Gpu::load(&cudart)?));
    let route = |gpu: Arc<Mutex<Gpu>>| post(move |uri: Uri, body: Bytes| complete(gpu, uri, body));
    let app = Router::new()
        .route("/v1/chat/completions", route(gpu.clone()))
        .route("/v1/completions", route(gpu.clone()))
        .route("/api/generate", route(gpu));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async move {
            let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
            axum::serve(listener, app).await?;
            Ok(())
        })
}
