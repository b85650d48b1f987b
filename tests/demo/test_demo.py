"""Checks of the demo server and load generator against each other (stdlib unittest, no root).

    python3 -m unittest tests/demo/test_demo.py        (from the repository root)

Needs the stub CUDA runtime built by `cargo build -p ttft-trace-tests`
(target/fixtures/libcudart.so.12); TTFT_DEMO_CUDART=PATH points elsewhere. Skipped without it.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SERVER = HERE / "server.py"
LOADGEN = HERE / "loadgen.py"
CUDART = os.environ.get("TTFT_DEMO_CUDART") or str(REPO / "target" / "fixtures" / "libcudart.so.12")
MS = 1_000_000  # ns

# Fast server defaults for tests: a small model load, short prompts.
FAST = ["--load-gb", "0.2", "--warmup-kernel-ms", "1"]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@unittest.skipUnless(os.path.exists(CUDART),
                     f"stub CUDA runtime {CUDART} not built yet "
                     "(run `cargo build -p ttft-trace-tests`, or set TTFT_DEMO_CUDART)")
class DemoTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ttft-demo-test-")
        self.dir = Path(self.tmp.name)
        self.procs: list[subprocess.Popen] = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()
        self.tmp.cleanup()

    # ---- helpers
    def start_server(self, *args, name="truth", port=0):
        truth = self.dir / f"{name}.jsonl"
        p = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--cudart", CUDART,
                              "--truth", str(truth), *FAST, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        r, _, _ = select.select([p.stdout], [], [], 30)
        line = p.stdout.readline() if r else ""
        if "listening on" not in line:
            p.kill()
            self.fail(f"server did not start: {line!r} {p.stderr.read()}")
        port = int(line.split("127.0.0.1:")[1].split()[0])
        return p, port, truth

    def loadgen(self, port, *args, name="lg", expect_rc=0):
        out = self.dir / f"{name}.jsonl"
        r = subprocess.run([sys.executable, str(LOADGEN), "--port", str(port), "--out", str(out),
                            *args], capture_output=True, text=True, timeout=120)
        if expect_rc is not None:
            self.assertEqual(r.returncode, expect_rc, r.stdout + r.stderr)
        return read_jsonl(out), r.stdout

    def join(self, truth, lg):
        t = {x["id"]: x for x in read_jsonl(truth)}
        return [(x, t[x["id"]]) for x in lg]

    def check_consistent(self, pairs, out_tokens, prompt_tokens):
        for c, s in pairs:
            self.assertEqual(c["outcome"], "ok", c)
            self.assertEqual(s["outcome"], "ok", s)
            self.assertEqual(c["chunks"], out_tokens)
            self.assertEqual(s["output_tokens"], out_tokens)
            self.assertEqual(s["prompt_tokens"], prompt_tokens)
            self.assertEqual(len(c["itl_s"]), out_tokens - 1)
            self.assertEqual(c["client_port"], s["conn_port"])
            order = [s["t_arrive"], s["t_tokenized"], s["t_gpu_start"], s["t_first_token_ready"],
                     s["t_first_token_send_start"], s["t_first_token_sent"], s["t_done"]]
            self.assertEqual(order, sorted(order), s)
            self.assertLess(s["t_headers_sent"], s["t_first_token_sent"])
            # the first body sent is the first token, or the chat role chunk before it
            if s["endpoint"] == "completions":
                self.assertEqual(s["t_first_body_send_start"], s["t_first_token_send_start"])
            self.assertLessEqual(s["t_first_body_send_start"], s["t_first_token_send_start"])
            # The client's TTFT contains the server's: it starts before the request's bytes
            # arrive and ends after the first token's send began. A loopback send can reach
            # the client before sendall() returns (the sender is often preempted by the woken
            # receiver on a busy CPU), hence the tolerance on the after-send stamp.
            srv_begin = s["t_first_token_send_start"] - s["t_arrive"]
            srv_end = s["t_first_token_sent"] - s["t_arrive"]
            ttft = c["t_first_token"] - c["t_send"]
            self.assertEqual(ttft, round(c["ttft_s"] * 1e9), c)
            self.assertGreaterEqual(ttft, srv_begin, (c, s))
            self.assertGreaterEqual(ttft, srv_end - 10 * MS, (c, s))
            self.assertLess(ttft - srv_end, 100 * MS, (c, s))  # loopback: little outside the server

    # ---- tests
    def test_thread_worker_concurrency_1_and_4_keepalive(self):
        _, port, truth = self.start_server()
        lg, out = self.loadgen(port, "--concurrency", "1,4", "--requests", "8",
                               "--prompt-tokens", "256", "--output-tokens", "16",
                               "--requests-per-conn", "4")
        self.assertEqual(len(lg), 16)
        pairs = self.join(truth, lg)
        self.assertEqual(len(read_jsonl(truth)), 16)
        self.check_consistent(pairs, 16, 256)
        # keep-alive: 4 requests per connection, on one socket (same client port, conn_seq 1..4)
        c1 = [s for c, s in pairs if c["concurrency"] == 1]
        self.assertEqual(sorted(s["conn_seq"] for s in c1), [1, 1, 2, 2, 3, 3, 4, 4])
        self.assertEqual(len({s["conn_port"] for s in c1}), 2)
        self.assertEqual(max(c["req_on_conn"] for c, _ in pairs), 4)
        # concurrency 4 batches requests into shared GPU steps
        self.assertGreater(max(s["batch_size"] for c, s in pairs if c["concurrency"] == 4), 1)
        self.assertIn("concurrency 4: 8 requests (8 ok", out)

    def test_gpu_worker_process_and_lazy_cold_start(self):
        p, port, truth = self.start_server("--gpu-worker-process", "--lazy-load",
                                           "--load-gb", "16")
        lg, _ = self.loadgen(port, "--concurrency", "1,4", "--requests", "4",
                             "--prompt-tokens", "128", "--output-tokens", "8",
                             "--endpoint", "chat")
        pairs = self.join(truth, lg)
        self.check_consistent(pairs, 8, 128)
        first = min((s for _, s in pairs), key=lambda s: s["t_arrive"])
        self.assertIn("cold_start", first["faults"])
        self.assertGreater(first["t_gpu_start"] - first["t_tokenized"], 500 * MS)
        for _, s in pairs:
            self.assertNotEqual(s["gpu_pid"], s["http_pid"])
            self.assertEqual(s["http_pid"], p.pid)
            if s is not first:
                self.assertNotIn("cold_start", s["faults"])
                self.assertLess(s["t_gpu_start"] - s["t_tokenized"], 300 * MS)
        # the engine core is a child of the API server
        with open(f"/proc/{first['gpu_pid']}/stat") as f:
            self.assertEqual(int(f.read().rsplit(")", 1)[1].split()[1]), p.pid)

    def test_fault_switches_show_in_truth(self):
        _, port, truth = self.start_server("--load-gb", "16", "--batch-window-ms", "1")
        seen = {}
        for fault in ("tokenizer_stall", "batching_mismatch", "queueing", "gpu_memory",
                      "cold_start"):
            # seed 3, share 0.5: request 0 faulted, requests 1 and 2 clean (checked below)
            lg, _ = self.loadgen(port, "--concurrency", "1", "--requests", "3",
                                 "--prompt-tokens", "128", "--output-tokens", "12",
                                 "--fault", fault, "--fault-share", "0.5", "--seed", "3",
                                 "--id-prefix", f"{fault}-", name=fault)
            pairs = self.join(truth, lg)
            self.check_consistent(pairs, 12, 128)
            bad = [s for c, s in pairs if c["faults"]]
            good = [s for c, s in pairs if not c["faults"]]
            self.assertTrue(bad and good, fault)
            for s in bad:
                self.assertIn(fault, s["faults"])
            for s in good:
                self.assertEqual(s["faults"], [], s)
            seen[fault] = (bad, good)

        ms = lambda ns: ns / MS
        bad, good = seen["tokenizer_stall"]
        for s in bad:
            self.assertGreaterEqual(ms(s["t_tokenized"] - s["t_arrive"]), 290)
        for s in good:
            self.assertLess(ms(s["t_tokenized"] - s["t_arrive"]), 150)

        bad, good = seen["batching_mismatch"]
        for s in bad:
            self.assertGreaterEqual(ms(s["gpu_idle_wait_ns"]), 390)
            self.assertGreaterEqual(ms(s["t_gpu_start"] - s["t_tokenized"]), 390)
        for s in good:
            self.assertLess(ms(s["gpu_idle_wait_ns"]), 150)

        bad, good = seen["queueing"]
        for s in bad:
            self.assertGreaterEqual(ms(s["t_gpu_start"] - s["t_arrive"]), 2000)
            self.assertGreaterEqual(ms(s["gpu_busy_wait_ns"]), 2000)
        for s in good:
            self.assertLess(ms(s["t_gpu_start"] - s["t_arrive"]), 500)

        bad, good = seen["gpu_memory"]
        for s in bad:
            self.assertGreater(s["swap_bytes"], 1 << 30)
            self.assertGreaterEqual(ms(s["t_first_token_ready"] - s["t_step_start"]), 150)
        for s in good:
            self.assertEqual(s["swap_bytes"], 0)
            self.assertLess(ms(s["t_first_token_ready"] - s["t_step_start"]), 100)

        bad, good = seen["cold_start"]
        for s in bad:
            self.assertGreaterEqual(ms(s["t_gpu_start"] - s["t_tokenized"]), 500)
        for s in good:
            self.assertLess(ms(s["t_gpu_start"] - s["t_tokenized"]), 150)

    def test_global_fault_probability(self):
        _, port, truth = self.start_server("--fault", "tokenizer_stall:1", "--stall-ms", "200")
        lg, _ = self.loadgen(port, "--concurrency", "1", "--requests", "2",
                             "--prompt-tokens", "64", "--output-tokens", "4")
        for c, s in self.join(truth, lg):
            self.assertEqual(s["faults"], ["tokenizer_stall"])
            self.assertGreaterEqual(s["t_tokenized"] - s["t_arrive"], 195 * MS)

    def test_cut_mid_stream(self):
        _, port, truth = self.start_server()
        lg, out = self.loadgen(port, "--concurrency", "2", "--requests", "4",
                               "--prompt-tokens", "64", "--output-tokens", "64",
                               "--cut-after-chunks", "3", "--cut-share", "0.5", "--seed", "3")
        pairs = self.join(truth, lg)
        cut = [(c, s) for c, s in pairs if c["cut_after"]]
        whole = [(c, s) for c, s in pairs if not c["cut_after"]]
        self.assertTrue(cut and whole)
        for c, s in cut:
            self.assertEqual(c["outcome"], "cut")
            self.assertEqual(c["chunks"], 3)
            self.assertEqual(s["outcome"], "client_closed")
            self.assertLess(s["output_tokens"], 64)
        self.check_consistent(whole, 64, 64)
        # the server stays healthy and serves the next request
        lg2, _ = self.loadgen(port, "--concurrency", "1", "--requests", "1",
                              "--output-tokens", "4", "--id-prefix", "after-", name="after")
        self.assertEqual(lg2[0]["outcome"], "ok")

    def test_http_client_framing_and_endpoints(self):
        _, port, truth = self.start_server()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        self.assertEqual((r.status, r.read()), (200, b""))
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        self.assertEqual(json.loads(r.read())["data"][0]["id"], "ttft-demo")
        # streaming chat on the same keep-alive connection (http.client decodes the chunking)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        self.assertEqual(r.getheader("Transfer-Encoding"), "chunked")
        self.assertEqual(r.getheader("Content-Type"), "text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
        self.assertTrue(all(e.startswith("data: ") for e in events), events)
        self.assertEqual(events[-1], "data: [DONE]")
        objs = [json.loads(e[6:]) for e in events[:-1]]
        self.assertEqual(objs[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        self.assertEqual(sum(1 for o in objs if o["choices"]
                             and o["choices"][0]["delta"].get("content")), 5)
        self.assertEqual(objs[-1]["usage"]["completion_tokens"], 5)
        # non-streaming completion, still the same connection
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 3}))
        r = conn.getresponse()
        obj = json.loads(r.read())
        self.assertEqual(obj["usage"], {"prompt_tokens": 3, "completion_tokens": 3,
                                        "total_tokens": 6})
        self.assertEqual(obj["choices"][0]["finish_reason"], "length")
        conn.request("POST", "/v1/completions", "{not json")
        r = conn.getresponse()
        self.assertIn("bad JSON", json.loads(r.read())["error"]["message"])
        self.assertEqual(r.status, 400)
        conn.request("GET", "/nope")
        r = conn.getresponse()
        r.read()
        self.assertEqual(r.status, 404)
        conn.close()
        recs = read_jsonl(truth)
        self.assertEqual(len(recs), 2)
        self.assertEqual(len({r["conn_port"] for r in recs}), 1)
        self.assertEqual([r["conn_seq"] for r in recs], [3, 4])
        # chat: the empty role chunk is body sent before the first token
        self.assertLess(recs[0]["t_first_body_sent"], recs[0]["t_first_token_sent"])
        self.assertLess(recs[0]["t_first_body_send_start"], recs[0]["t_first_body_sent"])
        self.assertLess(recs[0]["t_first_body_sent"], recs[0]["t_first_token_send_start"])

    def test_raw_socket_sends_headers_then_one_chunk_per_token(self):
        _, port, _ = self.start_server()
        s = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"prompt": "x", "max_tokens": 3, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            self.assertTrue(chunk)
            data += chunk
        s.close()
        head, _, rest = data.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK\r\n"))
        self.assertIn(b"Transfer-Encoding: chunked", head)
        pieces = []
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            pieces.append(rest[:n])
            self.assertEqual(rest[n:n + 2], b"\r\n")
            rest = rest[n + 2:]
        self.assertEqual(pieces[-1], b"")
        self.assertEqual(pieces[-2], b"data: [DONE]\n\n")
        for p in pieces[:-2]:  # one SSE event per chunk
            self.assertTrue(p.startswith(b"data: {") and p.endswith(b"}\n\n"), p)
            self.assertEqual(p.count(b"\n\n"), 1)
        self.assertEqual(len(pieces), 3 + 2)

    def test_close_after_response_with_the_terminator_in_two_sends(self):
        _, port, _ = self.start_server("--close-after-response", "--split-terminator")
        lg, _ = self.loadgen(port, "--concurrency", "1", "--requests", "3",
                             "--output-tokens", "4")
        self.assertEqual([c["outcome"] for c in lg], ["ok"] * 3)
        self.assertEqual(len({c["client_port"] for c in lg}), 3)  # a connection per request
        s = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        data = b""
        while chunk := s.recv(65536):  # the server closes
            data += chunk
        s.close()
        self.assertIn(b"Connection: close\r\n", data)
        self.assertTrue(data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), data[-40:])

    def test_sigterm_flushes_truth_and_port_in_use(self):
        p, port, truth = self.start_server()
        p2 = subprocess.run([sys.executable, str(SERVER), "--port", str(port), "--cudart", CUDART,
                             *FAST], capture_output=True, text=True, timeout=30)
        self.assertEqual(p2.returncode, 2)
        self.assertIn("in use", p2.stderr)
        self.loadgen(port, "--concurrency", "1", "--requests", "2", "--output-tokens", "4")
        # one request still streaming when SIGTERM comes
        res = {}
        th = threading.Thread(target=lambda: res.update(lg=self.loadgen(
            port, "--concurrency", "1", "--requests", "1", "--output-tokens", "2000",
            "--id-prefix", "long-", name="long", expect_rc=None)))
        th.start()
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        self.assertEqual(p.wait(timeout=10), 0)
        th.join(timeout=30)
        recs = read_jsonl(truth)
        self.assertEqual([r["outcome"] for r in recs], ["ok", "ok", "aborted"])
        self.assertEqual(res["lg"][0][0]["outcome"], "error")

    def test_midstream_faults_hold_the_gap_before_their_token(self):
        _, port, truth = self.start_server("--midstream-at", "5", "--midstream-cpu-ms", "200",
                                           "--midstream-copy-mb", "2048")

        def gaps(fault):
            s = socket.create_connection(("127.0.0.1", port))
            body = json.dumps({"prompt": "x", "max_tokens": 10, "stream": True}).encode()
            hdr = f"X-Demo-Fault: {fault}\r\n".encode() if fault else b""
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"%sContent-Length: %d\r\n\r\n%s" % (hdr, len(body), body))
            times, f = [], s.makefile("rb")
            for line in f:
                if line.startswith(b"data: {"):
                    times.append(time.monotonic_ns())
            f.close()
            s.close()
            self.assertEqual(len(times), 10, fault)
            return [(b - a) / MS for a, b in zip(times, times[1:])]

        for fault in ("midstream_cpu", "midstream_copy"):
            g = gaps(fault)
            # the gap before token 5 (gap index 4) is held; the others are decode steps
            self.assertGreaterEqual(g[4], 150, (fault, g))
            self.assertLess(max(g[:4] + g[5:]), 100, (fault, g))
        self.assertLess(max(gaps(None)), 100)
        faults = [r["faults"] for r in read_jsonl(truth)]
        self.assertEqual(faults, [["midstream_cpu"], ["midstream_copy"], []])


if __name__ == "__main__":
    unittest.main()
