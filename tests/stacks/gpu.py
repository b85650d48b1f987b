"""The emulated GPU of the stack servers, and the bodies they stream.

Every server of the matrix (tests/tests/stacks.rs) loads the stub CUDA runtime of
tests/fixtures (path in $STACK_CUDART) and, per request, runs one prefill step, then one
decode step per further token: a kernel launch whose emulated device time is the step's,
a 4-byte device-to-host copy of the token and a stream synchronisation. So every request has
GPU episodes, as on a real inference server. Only this module touches CUDA; the HTTP is all
the stack's own.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time

# Magic of `struct ttft_stub_kernel` (tests/fixtures/cuda_api.h): the bytes "TTFTKERN".
STUB_KERNEL_MAGIC = 0x4E52454B54465454
D2H = 2

PREFILL_MS = float(os.environ.get("STACK_PREFILL_MS", "20"))
# Where the app appends its own stamps of each request (tests/tests/stacks.rs), if set.
STAMPS = os.environ.get("STACK_STAMPS")
DECODE_MS = float(os.environ.get("STACK_DECODE_MS", "5"))


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _Kernel(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint64), ("duration_ns", ctypes.c_uint64)]


class _Gpu:
    def __init__(self, path: str):
        # The stub runtime binds to the stub driver next to it (DT_NEEDED libcuda.so.1).
        drv = os.path.join(os.path.dirname(os.path.abspath(path)), "libcuda.so.1")
        if os.path.exists(drv):
            ctypes.CDLL(drv, mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(path)
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.cudaLaunchKernel.argtypes = [vp, _Dim3, _Dim3, ctypes.POINTER(vp), sz, vp]
        lib.cudaLaunchKernel.restype = i
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, i, vp]
        lib.cudaMemcpyAsync.restype = i
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaStreamSynchronize.restype = i
        lib.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        lib.cudaMalloc.restype = i
        self.lib = lib
        dev = vp()
        self._check(lib.cudaMalloc(ctypes.byref(dev), 4), "cudaMalloc")
        self.dev = dev.value
        self.host = ctypes.c_int32()
        # One device: steps of concurrent requests run one after the other.
        self.lock = threading.Lock()

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    def step(self, ms: float) -> None:
        k = _Kernel(STUB_KERNEL_MAGIC, int(ms * 1e6))
        with self.lock:
            self._check(self.lib.cudaLaunchKernel(ctypes.addressof(k), _Dim3(1, 1, 1),
                                                  _Dim3(128, 1, 1), None, 0, None),
                        "cudaLaunchKernel")
            self._check(self.lib.cudaMemcpyAsync(ctypes.addressof(self.host), self.dev, 4, D2H,
                                                 None), "cudaMemcpyAsync")
            self._check(self.lib.cudaStreamSynchronize(None), "cudaStreamSynchronize")


GPU = _Gpu(os.environ["STACK_CUDART"])


def step(index: int) -> None:
    """The GPU work before token `index`: the prefill for the first, a decode step after."""
    GPU.step(PREFILL_MS if index == 0 else DECODE_MS)


def kind(path: str) -> str:
    """The body a path streams: SSE for the OpenAI endpoints, NDJSON for /api/generate."""
    return "ndjson" if path == "/api/generate" else "sse"


def content_type(path: str) -> str:
    return "application/x-ndjson" if kind(path) == "ndjson" else "text/event-stream"


def tokens(body: bytes) -> int:
    try:
        req = json.loads(body or b"{}")
    except ValueError:
        req = {}
    return max(1, int(req.get("max_tokens", 8)))


def chunk(path: str, i: int, n: int) -> bytes:
    """The body bytes of token `i` of `n` on `path` (the last gives its finish reason, as
    OpenAI's API does)."""
    word = f" tok{i}"
    created = int(time.time())
    finish = "length" if i == n - 1 else None
    if path == "/v1/chat/completions":
        obj = {"id": "chatcmpl-stack", "object": "chat.completion.chunk", "created": created,
               "model": "stack", "choices": [{"index": 0, "delta": {"content": word},
                                              "finish_reason": finish}]}
    elif path == "/v1/completions":
        obj = {"id": "cmpl-stack", "object": "text_completion", "created": created,
               "model": "stack", "choices": [{"index": 0, "text": word, "finish_reason": finish}]}
    else:
        return (json.dumps({"model": "stack", "response": word, "done": False}) + "\n").encode()
    return f"data: {json.dumps(obj)}\n\n".encode()


def last(path: str) -> bytes:
    """What ends the body: `data: [DONE]` for SSE, a done object for NDJSON."""
    if kind(path) == "ndjson":
        return (json.dumps({"model": "stack", "response": "", "done": True}) + "\n").encode()
    return b"data: [DONE]\n\n"


def now() -> int:
    """CLOCK_MONOTONIC (time.monotonic_ns() on Linux), the tracer's clock, in ns."""
    return time.monotonic_ns()


def stamp(port: int, t_read: int, t_send: int) -> None:
    """Appends the app's own stamps of one request to $STACK_STAMPS: `t_read` when the stack
    handed it the request (the handler's first line: after the stack read and parsed it),
    `t_send` just before it handed the stack its first token. Called after that hand-off, so
    that the write costs the response nothing before it."""
    if not STAMPS:
        return
    line = json.dumps({"client_port": port, "t_read": t_read, "t_send": t_send}) + "\n"
    fd = os.open(STAMPS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def stream(path: str, n: int, port: int = 0, t_read: int = 0):
    """The body of one response, a piece per token, with the GPU step before each; with the
    client's `port`, the request's stamps (see `stamp`)."""
    for i in range(n):
        step(i)
        t_send = now()
        yield chunk(path, i, n)
        if i == 0 and port:
            stamp(port, t_read, t_send)
    yield last(path)
