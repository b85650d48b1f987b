#!/usr/bin/env python3
"""Many TLS connections to uvicorn under `ttft-trace attach`: the client TTFT estimate
against the client's own, per connection (a rarer fault than the TLS test's ten
connections can show).

    tls_estimate_sweep.py LOOP N [TRACER]

LOOP is uvicorn's event loop (asyncio or uvloop), N the connections after one warm-up
(TLS 1.3, 1.3 resumed, 1.2 and 1.3 with the client's last flight held 5 ms, in turn),
TRACER the binary (default target/debug/ttft-trace). Root; run from the repository
root after `cargo xtask setup`. Prints each connection whose estimate is off by more
than 1 ms, then the count; exits 1 if any is off by more than 10 ms.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STACKS = os.path.join(ROOT, "tests", "stacks")
CACHE = os.environ.get("TTFT_TRACE_CACHE") or os.path.expanduser("~/.cache/ttft-trace")
VENV_PYTHON = os.path.join(CACHE, "stacks-venv", "bin", "python")
CUDART = os.path.join(ROOT, "target", "fixtures", "libcudart.so.12")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port):
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


def wait_logged(log, text):
    for _ in range(600):
        with open(log) as f:
            if text in f.read():
                return
        time.sleep(0.05)
    raise SystemExit(f"the tracer never logged {text!r}: see {log}")


def client(port, plan):
    out = subprocess.run([sys.executable, os.path.join(STACKS, "tls_client.py"), str(port)] + plan,
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def main():
    loop, n = sys.argv[1], int(sys.argv[2])
    tracer = sys.argv[3] if len(sys.argv) > 3 else os.path.join(ROOT, "target", "debug", "ttft-trace")
    tmp = tempfile.mkdtemp(prefix="tls-sweep-")
    cert, key, jsonl = (os.path.join(tmp, f) for f in ("cert.pem", "key.pem", "trace.jsonl"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    port = free_port()
    server = subprocess.Popen(
        [VENV_PYTHON, "-m", "uvicorn", "apps:asgi", "--port", str(port), "--loop", loop,
         "--ssl-keyfile", key, "--ssl-certfile", cert, "--no-access-log", "--log-level", "warning"],
        cwd=STACKS, env=dict(os.environ, STACK_CUDART=CUDART), start_new_session=True)
    try:
        wait_listening(port)
        log = os.path.join(tmp, "tracer.log")
        traced = subprocess.Popen([tracer, "attach", "--pid", str(server.pid), "--no-nvml",
                                   "--no-listen", "--jsonl", jsonl],
                                  stderr=open(log, "w"), stdout=subprocess.DEVNULL)
        wait_logged(log, "following requests on port")
        # libcrypto is probed once the process shows a memory BIO: a warm-up.
        client(port, ["1.3:0"])
        wait_logged(log, "(openssl-bio)")
        connections = client(port, (["1.3:0", "1.3r:0", "1.2:0", "1.3:5"] * n)[:n])
        time.sleep(1)
        traced.send_signal(signal.SIGINT)
        traced.wait(timeout=30)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
    # The kernel gives a client port again once its connection is done: each
    # port's requests in arrival order, matched to its connections in order.
    by_port = {}
    with open(jsonl) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "request":
                by_port.setdefault(r["client_port"], []).append(r)
    off, worst = 0, 0.0
    for c in connections[::-1]:
        mine = by_port.get(c["client_port"], [])
        if not mine:
            print(f"{c['client_port']}: not traced")
            off += 1
            continue
        r = mine.pop()
        estimate = r.get("client_ttft_estimate_ns")
        if estimate is None:
            print(f"{c['client_port']}: no estimate: {json.dumps(r)}")
            off += 1
            continue
        error_ms = (c["ttft_ns"] - estimate) / 1e6
        worst = max(worst, abs(error_ms))
        if abs(error_ms) > 1:
            off += 1
            print(f"{c['client_port']} {c['version']} resumed={c['resumed']} client "
                  f"{c['ttft_ns'] / 1e6:.3f} ms, estimate off by {error_ms:+.3f} ms")
    print(f"{loop}: {off} of {len(connections)} off by more than 1 ms, worst {worst:.3f} ms "
          f"(trace: {jsonl})")
    sys.exit(1 if worst > 10 else 0)


if __name__ == "__main__":
    main()
