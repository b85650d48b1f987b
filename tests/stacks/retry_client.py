#!/usr/bin/env python3
"""A client that gives up on a streamed completion after its first token and retries it,
beside other traffic from the same address.

    retry_client.py PORT ROUNDS

Each round, from 127.0.0.1 to the server's port:
- first: a streamed completion whose connection the client closes once it has read the first
  token (as a client does whose read timed out, or whose user pressed stop and sent again);
- concurrent: the same request on another connection, sent while the first was still open,
  read to its end: it came before the first ended, so it is no retry;
- other: a request of another size after the first closed, read to its end: no retry;
- retry: the same request as the first on a new connection, 50 ms after the close, read to
  its end.
One JSON line per round: the four client ports, and `user_ttft_ns`, from the first attempt's
send to the read of the retry's first token (CLOCK_MONOTONIC).
"""
import json
import socket
import sys
import time


def request(prompt):
    body = b'{"model":"m","prompt":"%s","max_tokens":12,"stream":true}' % prompt
    return (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


SAME, OTHER = request(b"x"), request(b"a longer prompt")


def send(port, req):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.monotonic_ns()
    sock.sendall(req)
    return sock, t


def read_until(sock, marker):
    """Reads until `marker`; returns when it came and what came."""
    got = b""
    while marker not in got:
        chunk = sock.recv(65536)
        if not chunk:
            raise SystemExit(f"closed before {marker!r}: {got!r}")
        got += chunk
    return time.monotonic_ns(), got


def whole(sock):
    t_token, got = read_until(sock, b"data: ")
    while b"data: [DONE]" not in got:
        got += sock.recv(65536)
    sock.close()
    return t_token


def main():
    port, rounds = int(sys.argv[1]), int(sys.argv[2])
    for _ in range(rounds):
        first, t_send = send(port, SAME)
        read_until(first, b"data: ")
        concurrent, _ = send(port, SAME)
        time.sleep(0.01)
        ports = {"first_port": first.getsockname()[1],
                 "concurrent_port": concurrent.getsockname()[1]}
        first.close()
        whole(concurrent)
        other, _ = send(port, OTHER)
        ports["other_port"] = other.getsockname()[1]
        whole(other)
        time.sleep(0.05)
        retry, _ = send(port, SAME)
        ports["retry_port"] = retry.getsockname()[1]
        t_token = whole(retry)
        print(json.dumps({**ports, "user_ttft_ns": t_token - t_send}), flush=True)
        time.sleep(0.3)


if __name__ == "__main__":
    main()
