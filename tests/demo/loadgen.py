#!/usr/bin/env python3
"""ttft-trace demo load generator: OpenAI-style streaming requests over HTTP/1.1 keep-alive,
measuring client-side TTFT, ITL, TPOT and E2E itself (the definitions of `vllm bench serve`).

Python 3.11 standard library only; raw sockets, one thread and one connection per concurrent
client; loopback targets only (127.0.0.0/8).

  TTFT  time from just before the request's first byte is sent to the recv() that completed
        the first SSE event carrying content (not headers, not the empty chat role chunk)
  ITL   every gap between consecutive content events
  E2E   send to the end of the response (chunked terminator read)
  TPOT  (E2E - TTFT) / (content events - 1)
All timestamps are time.monotonic_ns(), i.e. CLOCK_MONOTONIC on Linux (bpf_ktime_get_ns's clock).

first_token_runq_ns: the time this client's thread spent runnable but not running (its
schedstat run-queue delay) across the recv() that completed the first content event: part of
its own TTFT that no event on the wire shows (null where /proc gives no schedstat).
t_first_token_arrived: when the data of that recv() reached the client's socket (the kernel's
receive timestamp, SO_TIMESTAMPNS, of the last segment it returned; moved from CLOCK_REALTIME
to CLOCK_MONOTONIC): its read, less this, is the client's own delay in reading (its threads
share one GIL and two CPUs with the server in the tests). Null without a timestamp.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import socket
import struct
import sys
import threading
import time

FAULTS = ("tokenizer_stall", "batching_mismatch", "cold_start", "gpu_memory", "queueing")
MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 1024


def now_ns() -> int:
    # time.monotonic_ns() is clock_gettime(CLOCK_MONOTONIC) on Linux.
    return time.monotonic_ns()


_schedstat = threading.local()


# Linux's SO_TIMESTAMPNS (= SCM_TIMESTAMPNS; Python names neither): a struct timespec of
# CLOCK_REALTIME per recvmsg, for the last segment it returned.
SO_TIMESTAMPNS = 35
TIMESPEC = struct.Struct("@qq")
ANCILLARY = socket.CMSG_SPACE(TIMESPEC.size)


def recv_stamped(sock: socket.socket, buf: bytearray):
    """recv_into(buf), and when the kernel received its last segment (CLOCK_MONOTONIC ns)."""
    n, anc, _flags, _addr = sock.recvmsg_into([buf], ANCILLARY)
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= TIMESPEC.size:
            sec, nsec = TIMESPEC.unpack_from(data)
            # The realtime clock's offset over the monotonic one, read now (both move
            # together between NTP slews).
            offset = time.clock_gettime_ns(time.CLOCK_REALTIME) - time.monotonic_ns()
            return n, sec * 1_000_000_000 + nsec - offset
    return n, None


def runq_ns():
    """This thread's run-queue delay so far (the second field of its schedstat), or None."""
    fd = getattr(_schedstat, "fd", None)
    try:
        if fd is None:
            fd = _schedstat.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, IndexError, ValueError):
        return None


def percentile(values, p: float):
    """Linear interpolation between closest ranks (numpy's default, as vllm bench uses)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


class ResponseError(Exception):
    pass


class Response:
    """Incremental HTTP/1.1 response parser: status, headers, chunked or Content-Length body,
    SSE events inside it. feed() returns when the response is complete."""

    def __init__(self):
        self.buf = bytearray()
        self.phase = "head"
        self.status = None
        self.headers: dict[str, str] = {}
        self.chunked = False
        self.length = None
        self.body = bytearray()     # non-streaming body
        self.sse = bytearray()      # de-chunked event-stream bytes not yet split into events
        self.events: list = []      # (t_ns, content or None, raw json or "[DONE]")
        self.done = False

    def feed(self, data: bytes, t: int) -> None:
        self.buf += data
        while not self.done:
            if self.phase == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
                del self.buf[:end + 4]
                parts = lines[0].split(" ", 2)
                if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
                    raise ResponseError(f"bad status line {lines[0]!r}")
                status = int(parts[1])
                if status == 100:  # 100 Continue: a final response follows
                    continue
                self.status = status
                for ln in lines[1:]:
                    k, _, v = ln.partition(":")
                    self.headers[k.strip().lower()] = v.strip()
                self.chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
                if not self.chunked:
                    self.length = int(self.headers.get("content-length", "0"))
                self.phase = "chunk-size" if self.chunked else "body"
            elif self.phase == "body":
                need = self.length - len(self.body)
                take = self.buf[:need]
                self.body += take
                del self.buf[:len(take)]
                if len(self.body) < self.length:
                    return
                self.done = True
            elif self.phase == "chunk-size":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(self.buf[:end]).split(b";")[0].strip(), 16)
                del self.buf[:end + 2]
                self.want = size
                self.phase = "chunk-data" if size else "trailer"
            elif self.phase == "chunk-data":
                if len(self.buf) < self.want + 2:
                    return
                self.sse += self.buf[:self.want]
                del self.buf[:self.want + 2]
                self.phase = "chunk-size"
                self._events(t)
            elif self.phase == "trailer":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    return
                line = self.buf[:end]
                del self.buf[:end + 2]
                if not line:
                    self.done = True

    def _events(self, t: int) -> None:
        data = self.sse.replace(b"\r\n", b"\n")
        while True:
            end = data.find(b"\n\n")
            if end < 0:
                break
            ev = bytes(data[:end])
            del data[:end + 2]
            payload = "\n".join(ln[5:].lstrip() for ln in ev.decode().split("\n")
                                if ln.startswith("data:"))
            if not payload:
                continue
            if payload == "[DONE]":
                self.events.append((t, None, "[DONE]"))
                continue
            obj = json.loads(payload)
            content = ""
            for ch in obj.get("choices") or []:
                content += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            self.events.append((t, content or None, obj))
        self.sse = data


class Step:
    def __init__(self, args, concurrency: int, first_index: int, out_lock, out_file):
        self.a = args
        self.c = concurrency
        self.first_index = first_index
        self.next = 0
        self.lock = threading.Lock()
        self.results: list[dict] = []
        self.out_lock = out_lock
        self.out_file = out_file
        self.deadline = None

    def take(self):
        with self.lock:
            if self.next >= self.a.requests or now_ns() > self.deadline:
                return None
            self.next += 1
            return self.first_index + self.next - 1

    def record(self, res: dict) -> None:
        with self.lock:
            self.results.append(res)
        if self.out_file:
            with self.out_lock:
                self.out_file.write(json.dumps(res, separators=(",", ":")) + "\n")
                self.out_file.flush()

    def run(self) -> dict:
        self.deadline = now_ns() + int(self.a.max_step_s * 1e9)
        t0 = now_ns()
        threads = [threading.Thread(target=self.worker, args=(w,), daemon=True,
                                    name=f"loadgen-{w}") for w in range(self.c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return summarize(self.c, self.results, (now_ns() - t0) / 1e9)

    def worker(self, w: int) -> None:
        a = self.a
        sock = None
        on_conn = 0
        conn_no = 0
        while True:
            idx = self.take()
            if idx is None:
                break
            if sock is not None and a.requests_per_conn and on_conn >= a.requests_per_conn:
                sock.close()
                sock = None
            if sock is None:
                try:
                    sock = socket.create_connection((a.host, a.port), timeout=a.timeout_s)
                except OSError as e:
                    self.record({"id": f"{a.id_prefix}{idx}", "concurrency": self.c,
                                 "outcome": "error", "error": f"connect: {e}"})
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                on_conn = 0
                conn_no += 1
            on_conn += 1
            res, keep = one_request(a, sock, idx)
            res.update({"concurrency": self.c, "worker": w, "conn": f"{w}.{conn_no}",
                        "req_on_conn": on_conn})
            self.record(res)
            if not keep:
                try:
                    sock.close()
                except OSError:
                    pass
                sock = None
        if sock is not None:
            sock.close()


def one_request(a, sock: socket.socket, idx: int):
    rng = random.Random(a.seed * 1_000_003 + idx)
    faults = [f for f in a.fault if rng.random() < a.fault_share]
    cut = a.cut_after_chunks if (a.cut_after_chunks and rng.random() < a.cut_share) else None
    rid = f"{a.id_prefix}{idx}"
    body = {"model": a.model, "max_tokens": a.output_tokens, "stream": not a.no_stream,
            "ignore_eos": True, "demo_prompt_tokens": a.prompt_tokens}
    if a.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "Tell me about eBPF."}]
    else:
        path = "/v1/completions"
        body["prompt"] = "Tell me about eBPF."
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {a.host}:{a.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(data)}\r\nX-Request-Id: {rid}\r\n")
    if faults:
        head += f"X-Demo-Fault: {','.join(faults)}\r\n"
    req = head.encode() + b"\r\n" + data
    res = {"id": rid, "client_port": sock.getsockname()[1], "prompt_tokens": a.prompt_tokens,
           "requested_output_tokens": a.output_tokens, "faults": faults, "cut_after": cut,
           "stream": not a.no_stream, "t_send": None, "t_first_token": None, "t_done": None,
           "ttft_s": None, "itl_s": [], "e2e_s": None, "tpot_s": None, "chunks": 0,
           "first_token_runq_ns": None, "t_first_token_arrived": None, "http_status": None,
           "outcome": "error", "error": None}
    r = Response()
    rbuf = bytearray(65536)
    content_times: list[int] = []
    seen = 0
    keep = True
    t_send = now_ns()
    res["t_send"] = t_send
    try:
        sock.sendall(req)
        while not r.done:
            first_pending = not content_times
            q0 = runq_ns() if first_pending else None
            n, arrived = recv_stamped(sock, rbuf)
            t = now_ns()
            if n == 0:
                raise ResponseError("server closed the connection mid-response")
            r.feed(bytes(rbuf[:n]), t)
            for ev in r.events[seen:]:
                if ev[1] is not None:
                    content_times.append(ev[0])
            if first_pending and content_times:
                q1 = runq_ns() if q0 is not None else None
                if q1 is not None:
                    res["first_token_runq_ns"] = max(0, q1 - q0)
                res["t_first_token_arrived"] = arrived
            seen = len(r.events)
            if cut is not None and len(content_times) >= cut and not r.done:
                sock.close()  # cut mid-stream (RST if unread data is pending)
                res["outcome"] = "cut"
                res["t_done"] = now_ns()
                keep = False
                break
        res["http_status"] = r.status
        if r.done:
            res["t_done"] = t
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {bytes(r.body)[:200].decode(errors='replace')}"
            elif r.chunked:
                if not r.events or r.events[-1][2] != "[DONE]":
                    res["error"] = "stream ended without data: [DONE]"
                else:
                    res["outcome"] = "ok"
            else:
                obj = json.loads(bytes(r.body))
                ch = obj["choices"][0]
                text = ch.get("text") or (ch.get("message") or {}).get("content") or ""
                res["outcome"] = "ok"
                content_times = [t]
                res["completion_tokens"] = (obj.get("usage") or {}).get("completion_tokens")
                res["text_len"] = len(text)
            if r.headers.get("connection", "").lower() == "close":
                keep = False
    except (OSError, ResponseError, ValueError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["t_done"] = now_ns()
        keep = False
    res["chunks"] = len(content_times)
    if content_times:
        res["t_first_token"] = content_times[0]
        res["ttft_s"] = (content_times[0] - t_send) / 1e9
        res["itl_s"] = [(b - a_) / 1e9 for a_, b in zip(content_times, content_times[1:])]
    if res["t_done"] is not None:
        res["e2e_s"] = (res["t_done"] - t_send) / 1e9
    if res["outcome"] == "ok" and len(content_times) > 1:
        res["tpot_s"] = (res["e2e_s"] - res["ttft_s"]) / (len(content_times) - 1)
    return res, keep


def summarize(c: int, results: list[dict], dur_s: float) -> dict:
    ok = [r for r in results if r["outcome"] == "ok"]
    ms = lambda xs: [x * 1e3 for x in xs if x is not None]
    ttft = ms(r["ttft_s"] for r in ok)
    itl = ms(x for r in ok for x in r["itl_s"])
    tpot = ms(r["tpot_s"] for r in ok)
    e2e = ms(r["e2e_s"] for r in ok)
    s = {"concurrency": c, "requests": len(results), "ok": len(ok),
         "cut": sum(r["outcome"] == "cut" for r in results),
         "failed": sum(r["outcome"] == "error" for r in results),
         "duration_s": dur_s,
         "request_throughput": len(ok) / dur_s if dur_s else 0.0,
         "output_throughput": sum(r["chunks"] for r in ok) / dur_s if dur_s else 0.0,
         "connections": len({r.get("conn") for r in results if r.get("conn")})}
    for name, xs in (("ttft_ms", ttft), ("itl_ms", itl), ("tpot_ms", tpot), ("e2e_ms", e2e)):
        s[name] = {"mean": sum(xs) / len(xs) if xs else None,
                   **{f"p{p}": percentile(xs, p) for p in (50, 90, 99)}}
    return s


def print_summary(s: dict) -> None:
    f = lambda v: "   -   " if v is None else f"{v:7.2f}"
    print(f"concurrency {s['concurrency']}: {s['requests']} requests ({s['ok']} ok, {s['cut']} cut, "
          f"{s['failed']} failed) on {s['connections']} connections in {s['duration_s']:.2f} s: "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} tok/s")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = s[name]
        print(f"  {name[:-3].upper():5s} ms  mean {f(d['mean'])}  P50 {f(d['p50'])}  "
              f"P90 {f(d['p90'])}  P99 {f(d['p99'])}")
    sys.stdout.flush()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="loopback only (127.0.0.0/8)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default="ttft-demo")
    p.add_argument("--concurrency", default="1,4", help="comma-separated steps, e.g. 1,4,16")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency step")
    p.add_argument("--max-step-s", type=float, default=300.0,
                   help="no new requests after this long in a step")
    p.add_argument("--timeout-s", type=float, default=60.0, help="socket timeout per recv")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=256, help="max_tokens (ignore_eos)")
    p.add_argument("--no-stream", action="store_true", help="stream: false")
    p.add_argument("--requests-per-conn", type=int, default=0,
                   help="reconnect after M requests on a connection (0: keep it while it works)")
    p.add_argument("--fault", action="append", default=[], choices=FAULTS,
                   help="send X-Demo-Fault: NAME on a share of requests (repeatable)")
    p.add_argument("--fault-share", type=float, default=1.0)
    p.add_argument("--cut-after-chunks", type=int, default=0,
                   help="close the connection after K content chunks, for --cut-share of requests")
    p.add_argument("--cut-share", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=1, help="which requests get faults/cuts")
    p.add_argument("--id-prefix", default="lg-", help="X-Request-Id = prefix + request number")
    p.add_argument("--out", help="per-request JSONL (appended)")
    p.add_argument("--json-summary", help="write the per-step summaries as JSON")
    a = p.parse_args(argv)
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(a.host))
    except (OSError, ValueError):
        p.error(f"cannot resolve --host {a.host!r}")
    if not addr.is_loopback:
        p.error(f"--host {a.host} is not a loopback address; this tool only targets 127.0.0.0/8")
    a.host = str(addr)
    try:
        a.steps = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error("--concurrency takes comma-separated integers")
    if not a.steps or any(c < 1 or c > MAX_CONCURRENCY for c in a.steps):
        p.error(f"concurrency steps must be in 1..{MAX_CONCURRENCY}")
    if not 1 <= a.requests <= MAX_REQUESTS:
        p.error(f"--requests must be in 1..{MAX_REQUESTS}")
    if a.output_tokens < 1:
        p.error("--output-tokens must be >= 1")
    return a


def main(argv=None) -> int:
    sys.setswitchinterval(0.0005)  # short GIL hand-offs: a recv's timestamp follows it closely
    a = parse_args(sys.argv[1:] if argv is None else argv)
    out = open(a.out, "a") if a.out else None
    out_lock = threading.Lock()
    summaries = []
    index = 0
    try:
        for c in a.steps:
            s = Step(a, c, index, out_lock, out).run()
            index += a.requests
            summaries.append(s)
            print_summary(s)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if out:
            out.close()
        if a.json_summary:
            with open(a.json_summary, "w") as f:
                json.dump(summaries, f, indent=1)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
