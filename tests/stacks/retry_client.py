#!/usr/bin/env python3
"""A client that gives up on a streamed completion after its first token and retries it.

    retry_client.py PORT ROUNDS

Each round: a streamed completion whose connection the client closes once it has read the
first token (as a client does whose read timed out, or whose user pressed stop and sent
again), then the same request again on a new connection 50 ms later, read to its end. One
JSON line per round: both attempts' client ports, the first attempt's send and the retry's
first-token read (CLOCK_MONOTONIC), so `user_ttft_ns`, the TTFT its user saw.
"""
import json
import socket
import sys
import time

BODY = b'{"model":"m","prompt":"x","max_tokens":12,"stream":true}'
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))


def first_token(sock):
    """Reads until the first SSE event; returns the read's time and what came."""
    got = b""
    while b"data: " not in got:
        chunk = sock.recv(65536)
        if not chunk:
            raise SystemExit(f"closed before the first token: {got!r}")
        got += chunk
    return time.monotonic_ns(), got


def attempt(port, read_all):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t_send = time.monotonic_ns()
    sock.sendall(REQUEST)
    t_token, got = first_token(sock)
    while read_all and b"data: [DONE]" not in got:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    port_used = sock.getsockname()[1]
    sock.close()
    return port_used, t_send, t_token


def main():
    port, rounds = int(sys.argv[1]), int(sys.argv[2])
    for _ in range(rounds):
        first_port, t_send, _ = attempt(port, read_all=False)
        time.sleep(0.05)
        retry_port, _, t_token = attempt(port, read_all=True)
        print(json.dumps({"first_port": first_port, "retry_port": retry_port,
                          "user_ttft_ns": t_token - t_send}), flush=True)
        time.sleep(0.3)


if __name__ == "__main__":
    main()
