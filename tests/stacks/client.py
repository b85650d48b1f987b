"""Real clients against a stack server: the `openai` client, `httpx` and `curl`.

Runs --requests requests one after the other, cycling through --clients; each client kind keeps
its own connection alive between its requests where the server allows. One JSON line per request
(--out): the client's port and request index on that connection (to find the traced request),
its own TTFT (request sent -> first token received) and the tokens it read. openai and httpx stamp
time.monotonic_ns() (CLOCK_MONOTONIC); curl's own --trace-time stamps give its TTFT.

openai and httpx also say where their own process, not the wire, held the first token's read back
(Pauses): the test allows those on the client's side of its comparisons.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime

import httpcore._backends.sync
import httpx

PROMPT = "say something"


class Pauses:
    """Where the client's own process held a first token's read back: its thread's waits for a
    CPU from the start of the socket read that returned the token to the client's stamp (a read
    blocked on the socket sleeps, so only the wake-up after the token's arrival and preemptions
    count), and its garbage collector's pauses."""

    def __init__(self):
        self.gc: list[tuple[int, int]] = []
        self._gc_start = 0
        self._read_queued: int | None = None
        gc.callbacks.append(self._on_gc)
        # httpx's socket reads (openai's client is httpx's): httpcore's sync stream.
        sync_stream = httpcore._backends.sync.SyncStream
        recv = sync_stream.read

        def read(stream, max_bytes: int, timeout: float | None = None) -> bytes:
            self._read_queued = self.run_delay()
            return recv(stream, max_bytes, timeout)

        sync_stream.read = read

    def _on_gc(self, phase: str, _info: dict) -> None:
        now = time.monotonic_ns()
        if phase == "start":
            self._gc_start = now
        else:
            self.gc = (self.gc + [(self._gc_start, now)])[-64:]

    @staticmethod
    def run_delay() -> int | None:
        """Nanoseconds this thread waited runnable on a run queue so far (schedstat's field 2)."""
        try:
            with open("/proc/thread-self/schedstat") as f:
                return int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def at_first_token(self, t_send: int, t_first: int) -> dict:
        """What held the read of a first token stamped at t_first back, of a request sent at
        t_send: the CPU waits since the last socket read began, and the collector's pauses."""
        now, then = self.run_delay(), self._read_queued
        return {"queued_ns": now - then if now is not None and then is not None else None,
                "gc_pauses": [[a, b] for a, b in self.gc if b > t_send and a < t_first]}


PAUSES = Pauses()


def port_of(resp: httpx.Response) -> int:
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


def sse_tokens(text: str) -> tuple[int, bool]:
    lines = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
    done = bool(lines) and lines[-1] == "[DONE]"
    return sum(1 for ln in lines if ln != "[DONE]"), done


def ndjson_tokens(text: str) -> tuple[int, bool]:
    objs = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    done = bool(objs) and objs[-1].get("done") is True
    return sum(1 for o in objs if not o.get("done")), done


class OpenAIClient:
    def __init__(self, base: str, _ndjson: bool):
        import openai

        self.ports: list[int] = []
        http = httpx.Client(event_hooks={"response": [lambda r: self.ports.append(port_of(r))]})
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", http_client=http,
                                    max_retries=0)

    def request(self, n: int) -> dict:
        t_send = time.monotonic_ns()
        stream = self.client.chat.completions.create(
            model="stack", messages=[{"role": "user", "content": PROMPT}], max_tokens=n,
            stream=True)
        t_first, chunks, pauses = None, 0, {}
        for event in stream:
            if event.choices and event.choices[0].delta.content:
                if t_first is None:
                    t_first = time.monotonic_ns()
                    pauses = PAUSES.at_first_token(t_send, t_first)
                chunks += 1
        return {"path": "/v1/chat/completions", "client_port": self.ports[-1], "t_send": t_send,
                "t_first_token": t_first, "chunks": chunks, "outcome": "ok" if chunks == n else "short",
                **pauses}


class HttpxClient:
    def __init__(self, base: str, ndjson: bool):
        self.base = base
        self.ndjson = ndjson
        # Under the loss tests (35 % of the server's packets dropped) a segment lost eight
        # times in a row waits 25 s and more for its retransmit (the timeout doubles from
        # 200 ms): with a 30 s timeout one read in a few CI runs failed (2026-12-07).
        self.client = httpx.Client(timeout=120)
        self.count = 0

    def request(self, n: int) -> dict:
        # Alternates SSE (OpenAI completions) and NDJSON (/api/generate).
        path = "/api/generate" if self.ndjson and self.count % 2 == 1 else "/v1/completions"
        self.count += 1
        t_send = time.monotonic_ns()
        t_first, body, pauses = None, b"", {}
        with self.client.stream("POST", self.base + path,
                                json={"model": "stack", "prompt": PROMPT, "max_tokens": n,
                                      "stream": True}) as r:
            port = port_of(r)
            for piece in r.iter_raw():
                if piece and t_first is None:
                    t_first = time.monotonic_ns()
                    pauses = PAUSES.at_first_token(t_send, t_first)
                body += piece
        count = sse_tokens if path != "/api/generate" else ndjson_tokens
        chunks, done = count(body.decode())
        return {"path": path, "client_port": port, "t_send": t_send, "t_first_token": t_first,
                "chunks": chunks, "outcome": "ok" if done and chunks == n else "short", **pauses}


def curl_time(line: str) -> int:
    """Nanoseconds since midnight of a --trace-time stamp (HH:MM:SS.micros)."""
    t = datetime.strptime(line.split(" ", 1)[0], "%H:%M:%S.%f")
    return ((t.hour * 60 + t.minute) * 60 + t.second) * 1_000_000_000 + t.microsecond * 1000


class CurlClient:
    def __init__(self, base: str, _ndjson: bool):
        self.base = base

    def request(self, n: int) -> dict:
        with tempfile.TemporaryDirectory() as d:
            trace, body = os.path.join(d, "trace"), os.path.join(d, "body")
            cmd = ["curl", "-sS", "-N", "--trace-ascii", trace, "--trace-time", "-o", body,
                   "-w", "%{local_port}", "-H", "Content-Type: application/json", "-d",
                   json.dumps({"model": "stack", "prompt": PROMPT, "max_tokens": n,
                               "stream": True}),
                   self.base + "/v1/completions"]
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) as curl:
                try:
                    stdout, stderr = curl.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    # Say where the exchange stopped, while curl still holds its socket.
                    port = self.base.rsplit(":", 1)[1]
                    ss = subprocess.run(
                        ["ss", "-tinoe", f"( sport = :{port} or dport = :{port} )"],
                        capture_output=True, text=True)
                    curl.kill()
                    sys.stderr.write("curl timed out; the end of its trace:\n")
                    sys.stderr.writelines(ln + "\n" for ln in open(trace).read().splitlines()[-40:])
                    sys.stderr.write(ss.stdout)
                    raise
            if curl.returncode != 0:
                raise subprocess.CalledProcessError(curl.returncode, cmd, stdout, stderr)
            lines = open(trace).read().splitlines()
            # The request goes out right after "Connected": curl's stamp of its own send
            # comes after send() returned, and on loopback the server, woken by the
            # segment, often runs first, so that stamp can be later than the server's recv.
            sent = next(curl_time(ln) for ln in lines if "== Info: Connected to" in ln)
            first = next(curl_time(ln) for ln in lines if "<= Recv data" in ln)
            chunks, done = sse_tokens(open(body).read())
        return {"path": "/v1/completions", "client_port": int(stdout), "t_send": None,
                "t_first_token": None, "ttft_s": (first - sent) / 1e9, "chunks": chunks,
                "outcome": "ok" if done and chunks == n else "short"}


KINDS = {"openai": OpenAIClient, "httpx": HttpxClient, "curl": CurlClient}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True, help="http://127.0.0.1:PORT")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--clients", default="openai,httpx,curl")
    p.add_argument("--no-ndjson", action="store_true",
                   help="the server has no /api/generate (the demo): httpx asks for SSE only")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    kinds = a.clients.split(",")
    clients = {k: KINDS[k](a.url, not a.no_ndjson) for k in kinds}
    on_port = collections.Counter()
    with open(a.out, "w") as out:
        for i in range(a.requests):
            kind = kinds[i % len(kinds)]
            rec = clients[kind].request(a.tokens)
            on_port[rec["client_port"]] += 1
            # The first request of each client pays its imports and first connection: it is
            # traced and matched like the others, but its TTFT is not compared.
            rec.update(id=f"r{i}", client=kind, req_on_conn=on_port[rec["client_port"]],
                       warmup=i < len(kinds))
            if rec.get("ttft_s") is None and rec["t_first_token"] is not None:
                rec["ttft_s"] = (rec["t_first_token"] - rec["t_send"]) / 1e9
            out.write(json.dumps(rec) + "\n")
            # A gap between requests, as between a user's turns: each request starts on an
            # idle connection.
            time.sleep(0.02)


if __name__ == "__main__":
    main()
