#!/usr/bin/env python3
"""ttft-trace demo inference server: OpenAI-compatible streaming over HTTP/1.1 + SSE.

Python 3.11 standard library only. The "GPU" is whatever libcudart.so.12 is loaded with
--cudart (the stub runtime of tests/fixtures emulates device time); every CUDA call goes through
ctypes with the real CUDA 12 signatures, so uprobes on the library see real calls.

Pipeline of one request:
  connection thread (demo-conn-N): recv, parse HTTP/1.1 (keep-alive, many requests per
  connection) -> tokenizer thread (demo-tok-N): CPU work proportional to the prompt length ->
  engine queue -> GPU worker (demo-gpu, in this process or, with --gpu-worker-process, in a child
  process "engine core" talking over pipes): continuous batching in steps of kernel launches +
  cudaMemcpyAsync D2H of the sampled tokens + cudaStreamSynchronize -> the connection thread sends
  each token as one SSE chunk (chunked transfer encoding), one send() per chunk.

Every timestamp in the ground-truth log (--truth FILE, one JSON line per request) is
time.monotonic_ns(), which on Linux is clock_gettime(CLOCK_MONOTONIC): the clock of
bpf_ktime_get_ns(), so truth and tracer line up without conversion. See README.md for the fields.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import json
import os
import queue
import random
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CUDART = REPO_ROOT / "target" / "fixtures" / "libcudart.so.12"
CUDA_API_H = REPO_ROOT / "tests" / "fixtures" / "cuda_api.h"

# Magic of `struct ttft_stub_kernel { uint64_t magic; uint64_t duration_ns; }`, defined in
# tests/fixtures/cuda_api.h: a cudaLaunchKernel `func` pointing at such a struct occupies the
# emulated device for duration_ns. Checked against the header at start when it is present.
STUB_KERNEL_MAGIC = 0x4E52454B54465454  # TTFT_STUB_KERNEL_MAGIC, bytes "TTFTKERN"

FAULTS = ("tokenizer_stall", "batching_mismatch", "cold_start", "gpu_memory", "queueing")
# Mid-stream faults (issue 31's stalls after the first token): each acts once, on the gap before
# output token --midstream-at of the request that asked for it (X-Demo-Fault).
MIDSTREAM_FAULTS = ("midstream_copy", "midstream_cpu")
# A stream's degradation (issue 31, item 3), on streamed responses: from output token
# --midstream-at on, --coalesce-tokens tokens a send (midstream_coalesce); the server's close
# right after sending token --midstream-at (midstream_cut); the end without `data: [DONE]`
# (no_terminator); the last token's finish_reason null (no_finish_reason).
END_FAULTS = ("midstream_coalesce", "midstream_cut", "no_terminator", "no_finish_reason")
FAULTS = FAULTS + MIDSTREAM_FAULTS + END_FAULTS

CUDA_MEMCPY_H2D = 1
CUDA_MEMCPY_D2H = 2
# Large copies are issued as 8 MiB calls: the stub really memmoves the bytes, and 8 MiB stays in
# cache (~60 GB/s here), below the emulated 25 GB/s, so the CPU copy never sets the pace.
COPY_CHUNK = 8 << 20

WORDS = ("the quick brown fox jumps over a lazy dog while tokens stream out of an emulated "
         "accelerator one chunk at a time and every byte is traced").split()


def now_ns() -> int:
    # time.monotonic_ns() is clock_gettime(CLOCK_MONOTONIC) on Linux: same clock as bpf_ktime_get_ns.
    return time.monotonic_ns()


_libc = ctypes.CDLL(None, use_errno=True)


def set_thread_name(name: str) -> None:
    """Set the OS thread name (comm, as sched tracepoints report it), not only Python's."""
    threading.current_thread().name = name
    try:
        _libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def log(msg: str) -> None:
    print(f"[ttft-demo {os.getpid()}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# CUDA runtime through ctypes


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class StubKernel(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint64), ("duration_ns", ctypes.c_uint64)]


def stub_kernel_magic() -> int:
    """STUB_KERNEL_MAGIC, or the value tests/fixtures/cuda_api.h defines if it differs."""
    try:
        text = CUDA_API_H.read_text()
    except OSError:
        return STUB_KERNEL_MAGIC
    m = re.search(r"#define\s+TTFT_STUB_KERNEL_MAGIC\s+\(?\s*(0[xX][0-9a-fA-F]+)", text)
    if not m:
        return STUB_KERNEL_MAGIC
    value = int(m.group(1), 16)
    if value != STUB_KERNEL_MAGIC:
        log(f"note: {CUDA_API_H} defines kernel magic {value:#x}, "
            f"server.py has {STUB_KERNEL_MAGIC:#x}; using the header's")
    return value


class Cuda:
    """The few runtime calls the engine makes, with the real CUDA 12 signatures.

    With ignore_errors (a real libcudart.so.12 on a machine with no GPU: every call fails with
    cudaErrorInsufficientDriver, but the calls still happen and uprobes still fire) the device
    timeline is emulated here instead, so timings stay the same.
    """

    def __init__(self, path: str, ignore_errors: bool = False):
        self.path = path
        # The stub runtime needs the stub driver (DT_NEEDED libcuda.so.1) and may carry no rpath:
        # load the one next to it first, so the runtime binds to it.
        drv = os.path.join(os.path.dirname(os.path.abspath(path)), "libcuda.so.1")
        if os.path.exists(drv):
            ctypes.CDLL(drv, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)
        self.ignore_errors = ignore_errors
        self.errors = 0
        self.magic = stub_kernel_magic()
        self.shadow_free_at = 0
        c_void_p, c_size_t, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        L = self.lib
        L.cudaLaunchKernel.argtypes = [c_void_p, Dim3, Dim3, ctypes.POINTER(c_void_p), c_size_t,
                                       c_void_p]
        L.cudaLaunchKernel.restype = c_int
        L.cudaMemcpyAsync.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_void_p]
        L.cudaMemcpyAsync.restype = c_int
        L.cudaMemcpy.argtypes = [c_void_p, c_void_p, c_size_t, c_int]
        L.cudaMemcpy.restype = c_int
        L.cudaStreamSynchronize.argtypes = [c_void_p]
        L.cudaStreamSynchronize.restype = c_int
        L.cudaMalloc.argtypes = [ctypes.POINTER(c_void_p), c_size_t]
        L.cudaMalloc.restype = c_int
        self.has_free = hasattr(L, "cudaFree")
        if self.has_free:
            L.cudaFree.argtypes = [c_void_p]
            L.cudaFree.restype = c_int
        self.stream = None  # the default (NULL) stream unless cudaStreamCreate works
        if hasattr(L, "cudaStreamCreate"):
            L.cudaStreamCreate.argtypes = [ctypes.POINTER(c_void_p)]
            L.cudaStreamCreate.restype = c_int
            s = c_void_p()
            if L.cudaStreamCreate(ctypes.byref(s)) == 0:
                self.stream = s.value
        self.grid = Dim3(1, 1, 1)
        self.block = Dim3(128, 1, 1)
        self._kernels: list[StubKernel] = []  # kept alive until the next synchronise

    def _rc(self, rc: int, what: str) -> None:
        if rc != 0:
            self.errors += 1
            if not self.ignore_errors:
                raise RuntimeError(f"{what} failed with CUDA error {rc} ({self.path}); "
                                   "--ignore-cuda-errors emulates device time instead")
            if self.errors == 1:
                log(f"{what} returned CUDA error {rc}; emulating device time (--ignore-cuda-errors)")

    def _shadow(self, dur_ns: int) -> None:
        self.shadow_free_at = max(self.shadow_free_at, now_ns()) + dur_ns

    def malloc(self, size: int) -> int:
        p = ctypes.c_void_p()
        self._rc(self.lib.cudaMalloc(ctypes.byref(p), size), "cudaMalloc")
        return p.value or 0

    def free(self, ptr: int) -> None:
        if self.has_free and ptr:
            self._rc(self.lib.cudaFree(ptr), "cudaFree")

    def launch(self, duration_ns: int) -> None:
        k = StubKernel(self.magic, max(0, int(duration_ns)))
        self._kernels.append(k)
        self._shadow(k.duration_ns)
        rc = self.lib.cudaLaunchKernel(ctypes.addressof(k), self.grid, self.block, None, 0,
                                       self.stream)
        self._rc(rc, "cudaLaunchKernel")

    def memcpy_async(self, dst: int, src: int, count: int, kind: int) -> None:
        self._shadow(count // 25)  # 25 GB/s = 25 bytes/ns, as the stub does
        self._rc(self.lib.cudaMemcpyAsync(dst, src, count, kind, self.stream), "cudaMemcpyAsync")

    def memcpy(self, dst: int, src: int, count: int, kind: int) -> None:
        self._shadow(count // 25)
        self._rc(self.lib.cudaMemcpy(dst, src, count, kind), "cudaMemcpy")
        self._drain_shadow()

    def stream_sync(self) -> None:
        self._rc(self.lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self._drain_shadow()
        self._kernels.clear()

    def _drain_shadow(self) -> None:
        if self.errors:
            wait = self.shadow_free_at - now_ns()
            if wait > 0:
                time.sleep(wait / 1e9)


# --------------------------------------------------------------------------------------------
# GPU worker (engine core): continuous batching over the emulated device


class EngineReq:
    __slots__ = ("id", "prompt_tokens", "output_tokens", "faults", "t_queued", "generated",
                 "applied", "info")

    def __init__(self, d: dict):
        self.id = d["id"]
        self.prompt_tokens = int(d["prompt_tokens"])
        self.output_tokens = max(1, int(d["output_tokens"]))
        self.faults = set(d.get("faults", ()))
        self.t_queued = int(d["t_queued"])
        self.generated = 0
        self.applied: set[str] = set()  # faults already acted on
        self.info: dict = {}            # facts about the wait before its first token


class Engine:
    def __init__(self, args, emit):
        self.a = args
        self.emit = emit  # emit(list of output dicts), called from the GPU thread once per step
        self.cond = threading.Condition()
        self.waiting: deque[EngineReq] = deque()
        self.running: list[EngineReq] = []
        self.cancelled: set = set()
        self.stopping = False
        self.loaded = False
        self.ready = threading.Event()
        self.failed: str | None = None
        self.busy: deque[tuple[int, int]] = deque()  # (start, end) of GPU-busy intervals
        self.cuda: Cuda | None = None
        self.thread = threading.Thread(target=self._main, name="demo-gpu", daemon=True)

    # called from other threads
    def start(self):
        self.thread.start()

    def submit(self, d: dict) -> None:
        with self.cond:
            self.waiting.append(EngineReq(d))
            self.cond.notify()

    def cancel(self, rid) -> None:
        with self.cond:
            self.cancelled.add(rid)
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    # GPU thread
    def _main(self):
        set_thread_name("demo-gpu")
        try:
            self.cuda = Cuda(self.a.cudart, self.a.ignore_cuda_errors)
            self.tok_dev = self.cuda.malloc(4 * self.a.max_batch)
            self.tok_host = (ctypes.c_int32 * self.a.max_batch)()
            self.big_host = None
            self.big_dev = 0
            if not self.a.lazy_load:
                self._load_model()
        except Exception as e:  # report instead of dying silently
            self.failed = f"{type(e).__name__}: {e}"
            log(f"GPU worker failed to start: {self.failed}")
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            log(f"GPU worker died: {self.failed}")
            raise

    def _big_buffers(self):
        if self.big_host is None:
            self.big_host = ctypes.create_string_buffer(COPY_CHUNK)
            self.big_dev = self.cuda.malloc(COPY_CHUNK)

    def _copy_bytes(self, total: int, kind: int, sync_copy: bool) -> None:
        self._big_buffers()
        host = ctypes.addressof(self.big_host)
        left = total
        while left > 0:
            n = min(COPY_CHUNK, left)
            if kind == CUDA_MEMCPY_H2D:
                dst, src = self.big_dev, host
            else:
                dst, src = host, self.big_dev
            if sync_copy:
                self.cuda.memcpy(dst, src, n, kind)
            else:
                self.cuda.memcpy_async(dst, src, n, kind)
            left -= n

    def _mark_busy(self, t0: int, t1: int) -> None:
        self.busy.append((t0, t1))
        horizon = t1 - 120 * 10**9
        while self.busy and self.busy[0][1] < horizon:
            self.busy.popleft()

    def _busy_between(self, a: int, b: int) -> int:
        tot = 0
        for s, e in self.busy:
            lo, hi = max(s, a), min(e, b)
            if hi > lo:
                tot += hi - lo
        return tot

    def _load_model(self) -> None:
        """Model load: weights copied host-to-device with synchronous cudaMemcpy, then warm-up
        launches (the process's first kernels) and a synchronise."""
        t0 = now_ns()
        self._copy_bytes(int(self.a.load_gb * 1e9), CUDA_MEMCPY_H2D, sync_copy=True)
        for _ in range(3):
            self.cuda.launch(self.a.warmup_kernel_ms * 1e6)
        self.cuda.memcpy_async(ctypes.addressof(self.tok_host), self.tok_dev, 4, CUDA_MEMCPY_D2H)
        self.cuda.stream_sync()
        t1 = now_ns()
        self._mark_busy(t0, t1)
        self.loaded = True
        log(f"model loaded in {(t1 - t0) / 1e6:.0f} ms")

    def _backlog(self) -> None:
        """Other work hogging the GPU: back-to-back steps that are nobody's request."""
        t_end = now_ns() + int(self.a.backlog_ms * 1e6)
        step_ns = int(self.a.backlog_step_ms * 1e6)
        while now_ns() < t_end and not self.stopping:
            t0 = now_ns()
            for _ in range(self.a.kernels_per_step):
                self.cuda.launch(step_ns // self.a.kernels_per_step)
            self.cuda.memcpy_async(ctypes.addressof(self.tok_host), self.tok_dev,
                                   4 * self.a.max_batch, CUDA_MEMCPY_D2H)
            self.cuda.stream_sync()
            self._mark_busy(t0, now_ns())

    def _drop_cancelled(self) -> None:
        if not self.cancelled:
            return
        self.waiting = deque(r for r in self.waiting if r.id not in self.cancelled)
        self.running = [r for r in self.running if r.id not in self.cancelled]
        self.cancelled.clear()

    def _loop(self):
        a = self.a
        window_ns = int(a.batch_window_ms * 1e6)
        while True:
            with self.cond:
                while not self.stopping and not self.waiting and not self.running:
                    self.cond.wait()
                if self.stopping:
                    return
                if not self.running and window_ns > 0:
                    # Batching window: the GPU is idle; collect more requests before a step.
                    deadline = self.waiting[0].t_queued + window_ns
                    while (not self.stopping and len(self.waiting) < a.max_batch
                           and now_ns() < deadline):
                        self.cond.wait(max(0.0, (deadline - now_ns()) / 1e9))
                self._drop_cancelled()
                if self.stopping:
                    return
                if not self.waiting and not self.running:
                    continue
                room = max(0, a.max_batch - len(self.running))
                admit = list(itertools.islice(self.waiting, room))

            # Faults that act before admission (each once per request), then look again.
            if (not self.loaded) or any("cold_start" in r.faults and "cold_start" not in r.applied
                                        for r in admit):
                with self.cond:
                    payers = list(self.waiting)
                for r in payers:
                    if not self.loaded or "cold_start" in r.faults:
                        r.faults.add("cold_start")
                        r.applied.add("cold_start")
                self.loaded = False
                self._load_model()
                continue
            if any("queueing" in r.faults and "queueing" not in r.applied for r in admit):
                for r in admit:
                    if "queueing" in r.faults:
                        r.applied.add("queueing")
                self._backlog()
                continue
            if any("batching_mismatch" in r.faults and "batching_mismatch" not in r.applied
                   for r in admit):
                for r in admit:
                    if "batching_mismatch" in r.faults:
                        r.applied.add("batching_mismatch")
                # A batching window far too long for the load: GPU idle, requests waiting.
                with self.cond:
                    deadline = now_ns() + int(a.mismatch_window_ms * 1e6)
                    while not self.stopping and now_ns() < deadline:
                        self.cond.wait(max(0.0, (deadline - now_ns()) / 1e9))
                continue

            with self.cond:
                self._drop_cancelled()
                admitted = [r for r in admit if r in self.waiting]
                for r in admitted:
                    self.waiting.remove(r)
                self.running.extend(admitted)
                batch = list(self.running)
            if batch:
                self._step(batch, admitted)

    def _midstream_copy(self, batch: list[EngineReq]) -> None:
        """midstream_copy: before the step that makes output token --midstream-at of such a
        request, --midstream-copy-mb copied out (D2H) and back in (H2D): the step, and so every
        stream in the batch, waits for the copies."""
        n = sum(1 for r in batch
                if "midstream_copy" in r.faults and r.generated == self.a.midstream_at)
        if n:
            total = int(self.a.midstream_copy_mb * 1e6) * n
            self._copy_bytes(total, CUDA_MEMCPY_D2H, sync_copy=False)
            self._copy_bytes(total, CUDA_MEMCPY_H2D, sync_copy=False)

    def _step(self, batch: list[EngineReq], new: list[EngineReq]) -> None:
        a = self.a
        cuda = self.cuda
        newset = set(id(r) for r in new)
        decoding = [r for r in batch if id(r) not in newset]
        work_ns = (a.step_base_us * 1e3
                   + a.prefill_us_per_token * 1e3 * sum(r.prompt_tokens for r in new)
                   + (a.decode_step_ms * 1e6 + a.decode_us_per_seq * 1e3 * len(decoding)
                      if decoding else 0))
        swappers = [r for r in batch if "gpu_memory" in r.faults
                    and (id(r) in newset or r.generated % a.swap_every == 0)]
        t_step_start = now_ns()
        swap_bytes = 0
        if swappers:
            # KV-cache pressure: swap blocks out (D2H) and in (H2D) before the step's kernels.
            swap_bytes = int(a.swap_mb * 1e6) * len(swappers)
            self._copy_bytes(swap_bytes, CUDA_MEMCPY_D2H, sync_copy=False)
            self._copy_bytes(swap_bytes, CUDA_MEMCPY_H2D, sync_copy=False)
        self._midstream_copy(batch)
        t_gpu_start = now_ns()
        k = max(1, a.kernels_per_step)
        for _ in range(k):
            cuda.launch(work_ns / k)
        n = len(batch)
        cuda.memcpy_async(ctypes.addressof(self.tok_host), self.tok_dev, 4 * n, CUDA_MEMCPY_D2H)
        cuda.stream_sync()
        t_ready = now_ns()
        self._mark_busy(t_step_start, t_ready)

        outs = []
        finished = []
        for r in batch:
            i = r.generated
            r.generated += 1
            o = {"id": r.id, "i": i, "tok": (hash((r.id, i)) & 0x7FFFFFFF), "t_ready": t_ready}
            if i == 0:
                busy = self._busy_between(r.t_queued, t_gpu_start)
                o.update({
                    "t_step_start": t_step_start,
                    "t_gpu_start": t_gpu_start,
                    "batch_size": n,
                    "gpu_busy_wait_ns": busy,
                    "gpu_idle_wait_ns": max(0, t_gpu_start - r.t_queued - busy),
                    "swap_bytes": swap_bytes if r in swappers else 0,
                    "faults": sorted(r.applied | (r.faults & {"gpu_memory"})),
                })
            if r.generated >= r.output_tokens:
                o["last"] = True
                finished.append(r)
            outs.append(o)
        if finished:
            with self.cond:
                done = set(id(r) for r in finished)
                self.running = [r for r in self.running if id(r) not in done]
        self.emit(outs)


def engine_core_main(args) -> int:
    """--gpu-worker-process child: JSON lines in on stdin, JSON lines out on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when we stop
    set_thread_name("demo-engine")  # main thread (the process's comm): reads requests on stdin
    out = sys.stdout.buffer
    out_lock = threading.Lock()

    def emit(outs):
        line = (json.dumps({"outs": outs}, separators=(",", ":")) + "\n").encode()
        with out_lock:
            out.write(line)
            out.flush()

    eng = Engine(args, emit)
    eng.start()
    eng.ready.wait()
    with out_lock:
        out.write((json.dumps({"ready": eng.failed is None, "error": eng.failed,
                               "pid": os.getpid()}) + "\n").encode())
        out.flush()
    if eng.failed:
        return 1
    for line in sys.stdin.buffer:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "add":
            eng.submit(msg)
        elif op == "cancel":
            eng.cancel(msg["id"])
        elif op == "stop":
            break
    eng.stop()
    eng.thread.join(timeout=5)
    return 0


# --------------------------------------------------------------------------------------------
# API server side


class Router:
    """Request key -> the queue its connection thread waits on."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queues: dict[int, queue.SimpleQueue] = {}

    def register(self, key: int) -> queue.SimpleQueue:
        q = queue.SimpleQueue()
        with self.lock:
            self.queues[key] = q
        return q

    def unregister(self, key: int) -> None:
        with self.lock:
            self.queues.pop(key, None)

    def deliver(self, outs) -> None:
        with self.lock:
            for o in outs:
                q = self.queues.get(o["id"])
                if q is not None:
                    q.put(("tok", o))

    def abort_all(self, why: str) -> None:
        with self.lock:
            for q in self.queues.values():
                q.put(("abort", why))


class ThreadEngineClient:
    def __init__(self, args, router: Router):
        self.engine = Engine(args, router.deliver)
        self.gpu_pid = os.getpid()

    def start(self) -> None:
        self.engine.start()
        self.engine.ready.wait()
        if self.engine.failed:
            raise RuntimeError(self.engine.failed)

    def submit(self, d):
        self.engine.submit(d)

    def cancel(self, rid):
        self.engine.cancel(rid)

    def alive(self) -> bool:
        return self.engine.failed is None

    def stop(self):
        self.engine.stop()
        self.engine.thread.join(timeout=5)


class ProcessEngineClient:
    """The GPU worker as a child process (like vLLM's API server + engine core), spawned at
    start, or by the first request with --lazy-load (a process started after the tracer
    attached)."""

    def __init__(self, args, router: Router):
        self.args = args
        self.router = router
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.gpu_pid: int | None = None
        self.dead = False

    def _spawn(self) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--engine-core"] + self.args.argv
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        first = self.proc.stdout.readline()
        msg = json.loads(first) if first else {"ready": False, "error": "engine exited"}
        if not msg.get("ready"):
            self.dead = True
            raise RuntimeError(f"engine core failed to start: {msg.get('error')}")
        self.gpu_pid = msg["pid"]
        log(f"engine core process pid {self.gpu_pid}")
        threading.Thread(target=self._reader, name="demo-engine-io", daemon=True).start()

    def _reader(self) -> None:
        set_thread_name("demo-engine-io")
        for line in self.proc.stdout:
            self.router.deliver(json.loads(line)["outs"])
        self.dead = True
        self.router.abort_all("engine core exited")

    def start(self) -> None:
        if not self.args.lazy_load:
            self._spawn()

    def _send(self, msg: dict) -> None:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self.lock:
            if self.proc is None:
                if msg.get("op") != "add":
                    return
                self._spawn()
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def submit(self, d):
        self._send({"op": "add", **d})

    def cancel(self, rid):
        try:
            self._send({"op": "cancel", "id": rid})
        except OSError:
            pass

    def alive(self) -> bool:
        return not self.dead

    def stop(self):
        with self.lock:
            p = self.proc
        if p is None:
            return
        try:
            p.stdin.write(b'{"op":"stop"}\n')
            p.stdin.flush()
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class HttpError(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           411: "Length Required", 413: "Payload Too Large", 501: "Not Implemented",
           503: "Service Unavailable"}


def chunk(data: bytes) -> bytes:
    """One chunk of Transfer-Encoding: chunked."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class CpuWork:
    """A real CPU loop (SHA-256 over 4 KiB blocks; hashlib drops the GIL for blocks this
    size, so tokenizer threads really run in parallel and really compete for CPUs). The amount
    of work is fixed per token, calibrated at start, so a contended CPU makes it take longer."""

    def __init__(self):
        self.block = os.urandom(4096)
        h = hashlib.sha256()
        n = 2000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            h.update(self.block)
        self.ns_per_block = max(1, (time.perf_counter_ns() - t0) // n)

    def run_us(self, us: float) -> None:
        h = hashlib.sha256()
        for _ in range(int(us * 1000 / self.ns_per_block)):
            h.update(self.block)


class Server:
    def __init__(self, args):
        self.a = args
        self.router = Router()
        self.engine = (ProcessEngineClient if args.gpu_worker_process
                       else ThreadEngineClient)(args, self.router)
        self.rng = random.Random(args.seed)
        self.rng_lock = threading.Lock()
        self.keys = itertools.count(1)
        self.truth_lock = threading.Lock()
        self.truth = open(args.truth, "a", buffering=1) if args.truth else None
        self.tok_q: queue.SimpleQueue = queue.SimpleQueue()
        self.cpu = CpuWork()
        self.conns: set[socket.socket] = set()
        self.tls = None
        if args.tls_cert:
            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.load_cert_chain(args.tls_cert, args.tls_key)
        self.conns_lock = threading.Lock()
        self.stopping = False
        self.global_faults = args.fault_probs  # {name: prob}
        self.created = int(time.time())

    # ---- tokenizer stage
    def _tokenizer(self, idx: int) -> None:
        set_thread_name(f"demo-tok-{idx}")
        while True:
            job = self.tok_q.get()
            if job is None:
                return
            key, rec, q = job
            if "tokenizer_stall" in rec["faults"]:
                stall = self.a.stall_ms
                if self.a.stall_mode == "spin":
                    self.cpu.run_us(stall * 1000)
                else:
                    time.sleep(stall / 1000)
            self.cpu.run_us(rec["prompt_tokens"] * self.a.tokenize_us_per_token)
            t = now_ns()
            q.put(("queued", t))
            try:
                self.engine.submit({"id": key, "prompt_tokens": rec["prompt_tokens"],
                                    "output_tokens": rec["requested_output_tokens"],
                                    "faults": [f for f in rec["faults"]
                                               if f != "tokenizer_stall"],
                                    "t_queued": t})
            except Exception as e:
                q.put(("abort", f"engine: {e}"))

    # ---- connections
    def serve_conn(self, sock: socket.socket, addr) -> None:
        set_thread_name(threading.current_thread().name.replace("demo-conn_", "demo-conn-"))
        try:
            if self.tls is not None:
                # The handshake, on this connection's thread (CPython's ssl: OpenSSL with a
                # socket BIO on the connection's descriptor).
                plain = sock
                sock = self.tls.wrap_socket(sock, server_side=True)
                with self.conns_lock:
                    self.conns.discard(plain)
                    self.conns.add(sock)
            self._conn_loop(sock, addr)
        except (ConnectionError, OSError):
            pass
        except Exception as e:
            log(f"connection {addr}: {type(e).__name__}: {e}")
        finally:
            with self.conns_lock:
                self.conns.discard(sock)
            try:
                sock.close()
            except OSError:
                pass

    def _conn_loop(self, sock: socket.socket, addr) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        port = addr[1]
        buf = bytearray()
        rbuf = bytearray(65536)
        seq = 0
        while not self.stopping:
            # ---- read one request head. t_arrive: right after the recv that returned its
            # first bytes (or when processing starts, for a pipelined request already buffered).
            t_arrive = now_ns() if buf else None
            while True:
                end = buf.find(b"\r\n\r\n")
                if end >= 0:
                    break
                if len(buf) > 65536:
                    self._send_simple(sock, 413, {"error": "header too large"}, close=True)
                    return
                n = sock.recv_into(rbuf)
                t = now_ns()
                if n == 0:
                    return
                if t_arrive is None:
                    t_arrive = t
                buf += rbuf[:n]
            head = bytes(buf[:end]).decode("latin-1")
            del buf[:end + 4]
            lines = head.split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
            except ValueError:
                self._send_simple(sock, 400, {"error": "bad request line"}, close=True)
                return
            hdrs: dict[str, str] = {}
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                hdrs[k.strip().lower()] = v.strip()
            conn_hdr = hdrs.get("connection", "").lower()
            close = ("close" in conn_hdr) or (version == "HTTP/1.0" and "keep-alive" not in conn_hdr)
            close = close or self.a.close_after_response
            if "chunked" in hdrs.get("transfer-encoding", "").lower():
                self._send_simple(sock, 501, {"error": "chunked request bodies not supported"},
                                  close=True)
                return
            try:
                clen = int(hdrs.get("content-length", "0"))
            except ValueError:
                self._send_simple(sock, 400, {"error": "bad content-length"}, close=True)
                return
            if clen > 16 << 20:
                self._send_simple(sock, 413, {"error": "body too large"}, close=True)
                return
            if clen > len(buf) and hdrs.get("expect", "").lower() == "100-continue":
                sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            while len(buf) < clen:
                n = sock.recv_into(rbuf)
                if n == 0:
                    return
                buf += rbuf[:n]
            body = bytes(buf[:clen])
            del buf[:clen]
            seq += 1
            path = target.split("?", 1)[0]
            try:
                keep = self._dispatch(sock, method, path, hdrs, body, close, t_arrive, port, seq)
            except HttpError as e:
                self._send_simple(sock, e.status, {"error": {"message": str(e),
                                                             "type": "invalid_request_error"}},
                                  close=close)
                keep = not close
            if not keep:
                if self.a.close_after_response:
                    sock.shutdown(socket.SHUT_WR)  # then close(), as some servers do
                return

    def _send_simple(self, sock, status: int, obj, close: bool = False,
                     ctype: str = "application/json") -> None:
        body = b"" if obj is None else json.dumps(obj).encode()
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n").encode()
        sock.sendall(head + body)

    def _dispatch(self, sock, method, path, hdrs, body, close, t_arrive, port, seq) -> bool:
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                raise HttpError(405, "use POST")
            return self._completion(sock, path.endswith("chat/completions"), hdrs, body, close,
                                    t_arrive, port, seq)
        if path == "/v1/models" and method == "GET":
            self._send_simple(sock, 200, {"object": "list", "data": [
                {"id": self.a.model, "object": "model", "created": self.created,
                 "owned_by": "ttft-demo", "max_model_len": 1 << 16}]}, close=close)
            return not close
        if path == "/health" and method == "GET":
            ok = self.engine.alive()
            self._send_simple(sock, 200 if ok else 503, None, close=close)
            return not close
        raise HttpError(404, f"no route {method} {path}")

    def _faults_for(self, hdrs) -> list[str]:
        faults = []
        for name in hdrs.get("x-demo-fault", "").split(","):
            name = name.strip()
            if not name:
                continue
            if name not in FAULTS:
                raise HttpError(400, f"unknown X-Demo-Fault {name!r}; known: {', '.join(FAULTS)}")
            faults.append(name)
        with self.rng_lock:
            for name, p in self.global_faults.items():
                if name not in faults and self.rng.random() < p:
                    faults.append(name)
        return sorted(set(faults))

    def _completion(self, sock, chat, hdrs, body, close, t_arrive, port, seq) -> bool:
        a = self.a
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise HttpError(400, f"bad JSON body: {e}")
        if chat:
            if not isinstance(req.get("messages"), list):
                raise HttpError(400, "'messages' must be a list")
        elif "prompt" not in req:
            raise HttpError(400, "'prompt' is required")
        stream = bool(req.get("stream", False))
        # Prompt length: demo_prompt_tokens, else a list of token ids, else --prompt-tokens.
        prompt = req.get("prompt")
        if "demo_prompt_tokens" in req:
            prompt_tokens = int(req["demo_prompt_tokens"])
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            prompt_tokens = len(prompt)
        else:
            prompt_tokens = a.prompt_tokens
        max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
        out_tokens = a.output_tokens if max_tokens is None else int(max_tokens)
        if out_tokens < 1 or out_tokens > a.max_output_tokens or prompt_tokens < 0:
            raise HttpError(400, f"max_tokens must be in 1..{a.max_output_tokens}")
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        faults = self._faults_for(hdrs)
        if not self.engine.alive():
            raise HttpError(503, "GPU worker is not running")
        key = next(self.keys)
        rid = hdrs.get("x-request-id") or f"req-{key}"
        model = req.get("model") or a.model
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        rec = {"id": rid, "conn_port": port, "conn_seq": seq,
               "endpoint": "chat" if chat else "completions", "stream": stream,
               "t_arrive": t_arrive, "t_tokenized": None, "t_step_start": None,
               "t_gpu_start": None, "t_first_token_ready": None, "t_headers_sent": None,
               "t_first_body_sent": None, "t_first_body_send_start": None,
               "t_first_token_send_start": None,
               "t_first_token_sent": None, "t_done": None,
               "prompt_tokens": prompt_tokens, "requested_output_tokens": out_tokens,
               "output_tokens": 0, "outcome": None, "faults": faults,
               "batch_size": None, "gpu_busy_wait_ns": None, "gpu_idle_wait_ns": None,
               "swap_bytes": None, "http_pid": os.getpid(), "gpu_pid": None}
        q = self.router.register(key)
        if self.stopping:
            q.put(("abort", "server shutdown"))
        else:
            self.tok_q.put((key, rec, q))
        headers = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                   b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
                   b"X-Request-Id: " + rid.encode() + b"\r\nConnection: "
                   + (b"close" if close else b"keep-alive") + b"\r\n\r\n")
        created = int(time.time())

        def send(data: bytes) -> int:
            nonlocal t_send_start
            t_send_start = now_ns()
            sock.sendall(data)
            return now_ns()

        t_send_start = 0

        def piece(text, finish, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                obj = "text_completion"
            return {"id": oid, "object": obj, "created": created, "model": model,
                    "choices": [choice]}

        usage = lambda n: {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                           "total_tokens": prompt_tokens + n}
        texts: list[str] = []
        held: list[bytes] = []  # midstream_coalesce: token chunks not sent yet
        outcome = "ok"
        keep = not close
        def send_headers():
            rec["t_headers_sent"] = send(headers)
            if chat and a.role_chunk == "with-headers":
                rec["t_first_body_sent"] = send(chunk(sse(piece("", None, role=True))))
                rec["t_first_body_send_start"] = t_send_start

        try:
            if stream and a.headers_at == "parsed":
                send_headers()
            while True:
                ev = q.get()
                if ev[0] == "queued":
                    rec["t_tokenized"] = ev[1]
                    if stream and a.headers_at == "queued" and rec["t_headers_sent"] is None:
                        send_headers()
                    continue
                if ev[0] == "abort":
                    outcome = "aborted"
                    keep = False
                    break
                o = ev[1]
                if o["i"] == 0:
                    for k in ("t_step_start", "t_gpu_start", "batch_size", "gpu_busy_wait_ns",
                              "gpu_idle_wait_ns", "swap_bytes"):
                        rec[k] = o[k]
                    rec["t_first_token_ready"] = o["t_ready"]
                    rec["faults"] = sorted(set(rec["faults"]) | set(o["faults"]))
                    rec["gpu_pid"] = self.engine.gpu_pid
                text = " " + WORDS[o["tok"] % len(WORDS)]
                texts.append(text)
                last = bool(o.get("last"))
                if stream:
                    if rec["t_headers_sent"] is None:
                        send_headers()
                    if chat and a.role_chunk == "at-first-token" and o["i"] == 0:
                        rec["t_first_body_sent"] = send(chunk(sse(piece("", None, role=True))))
                        rec["t_first_body_send_start"] = t_send_start
                    finish = "length" if last and "no_finish_reason" not in faults else None
                    held.append(chunk(sse(piece(text, finish))))
                    coalesce = "midstream_coalesce" in faults and o["i"] >= a.midstream_at
                    if not coalesce or len(held) >= a.coalesce_tokens or last:
                        t = send(b"".join(held))
                        held.clear()
                        if rec["t_first_token_sent"] is None:
                            rec["t_first_token_sent"] = t
                            rec["t_first_token_send_start"] = t_send_start
                            if rec["t_first_body_sent"] is None:
                                rec["t_first_body_sent"] = t
                                rec["t_first_body_send_start"] = t_send_start
                    self._midstream_cpu(rec, o["i"])
                    rec["output_tokens"] += 1
                    if "midstream_cut" in faults and o["i"] == a.midstream_at and not last:
                        outcome = "server_cut"
                        keep = False
                        self.engine.cancel(key)
                        sock.shutdown(socket.SHUT_RDWR)
                        break
                if last:
                    break
            if outcome == "ok":
                if stream:
                    tail = b""
                    if include_usage:
                        u = {"id": oid, "object": "chat.completion.chunk" if chat
                             else "text_completion", "created": created, "model": model,
                             "choices": [], "usage": usage(len(texts))}
                        tail += chunk(sse(u))
                    if "no_terminator" not in faults:
                        tail += chunk(b"data: [DONE]\n\n")
                    if a.split_terminator:
                        send(tail)
                        send(b"0\r\n")
                        rec["t_done"] = send(b"\r\n")
                    else:
                        rec["t_done"] = send(tail + b"0\r\n\r\n")
                else:
                    full = "".join(texts)
                    if chat:
                        ch = {"index": 0, "message": {"role": "assistant", "content": full},
                              "logprobs": None, "finish_reason": "length"}
                    else:
                        ch = {"index": 0, "text": full, "logprobs": None,
                              "finish_reason": "length"}
                    bod = json.dumps({"id": oid, "object": "chat.completion" if chat
                                      else "text_completion", "created": created,
                                      "model": model, "choices": [ch],
                                      "usage": usage(len(texts))}).encode()
                    t = send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nX-Request-Id: %s\r\nConnection: %s\r\n\r\n"
                             % (len(bod), rid.encode(), b"close" if close else b"keep-alive")
                             + bod)
                    rec["output_tokens"] = len(texts)
                    rec["t_headers_sent"] = rec["t_first_body_sent"] = t
                    rec["t_first_token_sent"] = rec["t_done"] = t
                    rec["t_first_token_send_start"] = t_send_start
                    rec["t_first_body_send_start"] = t_send_start
        except OSError:
            # our own shutdown() of the socket at server stop, or the client went away
            outcome = "aborted" if self.stopping else "client_closed"
            keep = False
            self.engine.cancel(key)
        finally:
            self.router.unregister(key)
            if rec["t_done"] is None:
                rec["t_done"] = now_ns()
            rec["outcome"] = outcome
            self._write_truth(rec)
        return keep

    def _midstream_cpu(self, rec, i: int) -> None:
        """midstream_cpu: after sending output token --midstream-at - 1, the connection thread
        burns --midstream-cpu-ms of CPU (calibrated work) before it reads the next token: its
        stream stands still while the GPU runs on."""
        if "midstream_cpu" in rec["faults"] and i == self.a.midstream_at - 1:
            self.cpu.run_us(self.a.midstream_cpu_ms * 1000)

    def _write_truth(self, rec) -> None:
        if self.truth is None:
            return
        with self.truth_lock:
            self.truth.write(json.dumps(rec, separators=(",", ":")) + "\n")

    # ---- main
    def run(self) -> int:
        a = self.a
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lsock.bind(("127.0.0.1", a.port))
        except OSError as e:
            print(f"error: cannot listen on 127.0.0.1:{a.port}: {e.strerror}"
                  + (" (the port is in use)" if e.errno == 98 else ""), file=sys.stderr)
            return 2
        # Stop flag through the wakeup fd, so the accept loop sees signals without polling.
        rpipe, wpipe = os.pipe()
        os.set_blocking(wpipe, False)
        signal.set_wakeup_fd(wpipe)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda *_: None)
        for i in range(a.tokenizer_threads):
            threading.Thread(target=self._tokenizer, args=(i,), daemon=True,
                             name=f"demo-tok-{i}").start()
        try:
            self.engine.start()
        except Exception as e:
            print(f"error: GPU worker: {e}", file=sys.stderr)
            return 1
        lsock.listen(1024)
        port = lsock.getsockname()[1]
        print(f"ttft-demo listening on {'https' if self.tls else 'http'}://127.0.0.1:{port} pid={os.getpid()} "
              f"gpu_worker={'process' if a.gpu_worker_process else 'thread'}"
              f"{' gpu_pid=' + str(self.engine.gpu_pid) if self.engine.gpu_pid else ''} "
              f"cudart={a.cudart}", flush=True)
        pool = ThreadPoolExecutor(max_workers=a.threads, thread_name_prefix="demo-conn")
        set_thread_name("demo-api")  # the main thread: its name is the process's comm
        try:
            while True:
                r, _, _ = select.select([lsock, rpipe], [], [])
                if rpipe in r:
                    break
                try:
                    sock, addr = lsock.accept()
                except OSError:
                    continue
                with self.conns_lock:
                    self.conns.add(sock)
                pool.submit(self.serve_conn, sock, addr)
        finally:
            log("shutting down")
            self.stopping = True
            lsock.close()
            with self.conns_lock:
                conns = list(self.conns)
            for s in conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.router.abort_all("server shutdown")
            pool.shutdown(wait=True, cancel_futures=True)
            for _ in range(a.tokenizer_threads):
                self.tok_q.put(None)
            self.engine.stop()
            if self.truth:
                with self.truth_lock:
                    self.truth.flush()
                    self.truth.close()
                    self.truth = None
        return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--port", type=int, default=8000, help="TCP port on 127.0.0.1 (0: any free)")
    p.add_argument("--tls-cert", help="serve HTTPS: the certificate chain (PEM); with --tls-key")
    p.add_argument("--tls-key", help="serve HTTPS: the private key (PEM)")
    p.add_argument("--cudart", default=str(DEFAULT_CUDART), help="CUDA runtime library to load")
    p.add_argument("--ignore-cuda-errors", action="store_true",
                   help="keep going when CUDA calls fail (real libcudart, no GPU): device time "
                        "is then emulated in Python")
    p.add_argument("--truth", help="ground-truth JSONL file (appended)")
    p.add_argument("--model", default="ttft-demo")
    p.add_argument("--threads", type=int, default=64, help="connection threads")
    p.add_argument("--tokenizer-threads", type=int, default=4)
    p.add_argument("--gpu-worker-process", action="store_true",
                   help="run the GPU worker as a child process talking over pipes")
    p.add_argument("--lazy-load", action="store_true",
                   help="load the model (and, with --gpu-worker-process, start the worker "
                        "process) on the first request, which pays it as a cold start")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="prompt length when a request gives none (demo_prompt_tokens or "
                        "token-id list)")
    p.add_argument("--output-tokens", type=int, default=256,
                   help="output length when a request gives no max_tokens")
    p.add_argument("--max-output-tokens", type=int, default=16384)
    p.add_argument("--tokenize-us-per-token", type=float, default=20.0,
                   help="tokenizer CPU work per prompt token (µs on an idle CPU)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-window-ms", type=float, default=1.0,
                   help="with the GPU idle, wait this long for more requests before a step")
    p.add_argument("--kernels-per-step", type=int, default=8)
    p.add_argument("--step-base-us", type=float, default=200.0)
    p.add_argument("--prefill-us-per-token", type=float, default=40.0)
    p.add_argument("--decode-step-ms", type=float, default=4.0)
    p.add_argument("--decode-us-per-seq", type=float, default=200.0)
    p.add_argument("--headers-at", choices=("parsed", "queued", "first-token"), default="queued",
                   help="when the streaming response's headers are sent (always their own send)")
    p.add_argument("--role-chunk", choices=("at-first-token", "with-headers", "none"),
                   default="at-first-token",
                   help="chat: when the empty {role: assistant} chunk is sent (vLLM: just "
                        "before the first token)")
    p.add_argument("--close-after-response", action="store_true",
                   help="answer every request with Connection: close, then shutdown() and close()")
    p.add_argument("--split-terminator", action="store_true",
                   help="stream's end in three sends: the [DONE] chunk, '0\\r\\n', then '\\r\\n'")
    p.add_argument("--fault", action="append", default=[], metavar="NAME:PROB",
                   help=f"inject a fault into a share of all requests; NAME in {', '.join(FAULTS)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stall-ms", type=float, default=300.0, help="tokenizer_stall length")
    p.add_argument("--stall-mode", choices=("sleep", "spin"), default="sleep",
                   help="tokenizer_stall blocks off-CPU (sleep) or burns CPU (spin)")
    p.add_argument("--mismatch-window-ms", type=float, default=400.0,
                   help="batching_mismatch: GPU idle this long while the request waits")
    p.add_argument("--load-gb", type=float, default=24.0,
                   help="model load: GB copied host-to-device (25 GB/s emulated)")
    p.add_argument("--warmup-kernel-ms", type=float, default=20.0)
    p.add_argument("--swap-mb", type=float, default=2048.0,
                   help="gpu_memory: MB swapped out (D2H) and in (H2D) per affected step")
    p.add_argument("--swap-every", type=int, default=8,
                   help="gpu_memory: swap on the prefill step and every Nth decode step")
    p.add_argument("--backlog-ms", type=float, default=2500.0,
                   help="queueing: GPU busy with other work this long before the request")
    p.add_argument("--backlog-step-ms", type=float, default=50.0)
    p.add_argument("--midstream-at", type=int, default=16,
                   help="midstream_*: the output token whose gap the fault holds (>= 1)")
    p.add_argument("--midstream-copy-mb", type=float, default=3072.0,
                   help="midstream_copy: MB copied out (D2H) and back in (H2D)")
    p.add_argument("--midstream-cpu-ms", type=float, default=300.0,
                   help="midstream_cpu: CPU burnt by the connection thread")
    p.add_argument("--coalesce-tokens", type=int, default=4,
                   help="midstream_coalesce: tokens a send from token --midstream-at on (>= 2)")
    p.add_argument("--engine-core", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.argv = list(argv)
    a.fault_probs = {}
    for spec in a.fault:
        name, _, prob = spec.partition(":")
        if name not in FAULTS:
            p.error(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        try:
            a.fault_probs[name] = float(prob) if prob else 1.0
        except ValueError:
            p.error(f"bad probability in --fault {spec!r}")
    if a.max_batch < 1 or a.threads < 1 or a.tokenizer_threads < 1 or a.swap_every < 1:
        p.error("--max-batch, --threads, --tokenizer-threads, --swap-every must be >= 1")
    if a.midstream_at < 1:
        p.error("--midstream-at must be >= 1 (the first token is not mid-stream)")
    if bool(a.tls_cert) != bool(a.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if a.coalesce_tokens < 2:
        p.error("--coalesce-tokens must be >= 2")
    return a


def main(argv=None) -> int:
    sys.setswitchinterval(0.0005)  # keep GIL hand-offs short: truth stamps follow syscalls closely
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.engine_core:
        return engine_core_main(a)
    if not os.path.exists(a.cudart):
        print(f"error: CUDA runtime {a.cudart} not found (build it with "
              f"`cargo build -p ttft-trace-tests`, or pass --cudart)", file=sys.stderr)
        return 2
    return Server(a).run()


if __name__ == "__main__":
    sys.exit(main())
