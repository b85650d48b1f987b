#!/usr/bin/env python3
"""A TLS client that knows when each of its handshake flights crossed its socket.

    tls_client.py PORT PLAN...

Each PLAN item is one connection, VERSION[r]:DELAY_MS: the TLS version to offer at
most (1.2 or 1.3), `r` to resume the session of the last full handshake of that
version, and how long to hold back the client's second flight (its key exchange or
Finished) after the server's flight arrived. The handshake is driven by hand through
memory BIOs over a plain socket, so that every flight's send and receive is stamped
with CLOCK_MONOTONIC (the clock of the tracer's kernel events); one streamed
completion follows on the connection, then the client closes.

One JSON line per connection on stdout: the client port, the version and resumption
the handshake ended with, and `server_view_ns`, the handshake as the server's side of
the wire sees it: from the ClientHello's send to the send of the client's last flight
(TLS 1.3, a resumed TLS 1.2), or to the arrival of the server's Finished (a full
TLS 1.2 handshake, which the server ends); and `ttft_ns`, the request's TTFT as the
client saw it: from its send to the receive whose records held the first `data:` line.
"""
import json
import socket
import ssl
import sys
import time

REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s")
BODY = b'{"model":"m","prompt":"x","max_tokens":4,"stream":true}'
VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def context(version):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = VERSIONS[version]
    return ctx


def connection(port, ctx, session, delay_s):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost", session=session)
    flights, t_hello, t_client_last, t_server_last = 0, None, None, None
    while True:
        try:
            tls.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        data = outgoing.read()
        if data:
            if flights > 0:
                time.sleep(delay_s)
            t = time.monotonic_ns()
            sock.sendall(data)
            if flights == 0:
                t_hello = t
            else:
                t_client_last = t
            flights += 1
        if done:
            break
        chunk = sock.recv(65536)
        t_server_last = time.monotonic_ns()
        if not chunk:
            raise SystemExit("the server closed during the handshake")
        incoming.write(chunk)
    t_done = time.monotonic_ns()
    # A full TLS 1.2 handshake ends with the server's Finished; the others with
    # the client's.
    full12 = tls.version() == "TLSv1.2" and not tls.session_reused
    end = t_server_last if full12 else t_client_last
    tls.write(REQUEST % (len(BODY), BODY))
    t_send = time.monotonic_ns()
    sock.sendall(outgoing.read())
    body, t_received, t_first = b"", None, None
    while b"data: [DONE]" not in body:
        try:
            body += tls.read(65536)
            if t_first is None and b"data:" in body:
                t_first = t_received
            continue
        except ssl.SSLWantReadError:
            pass
        # Acknowledge what comes at once: the tracer's client TTFT estimate
        # reads this ACK, and a delayed one (Linux delays it when the client
        # looks interactive) would be its error, not the tracer's.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        chunk = sock.recv(65536)
        t_received = time.monotonic_ns()
        if not chunk:
            break
        incoming.write(chunk)
    if b"data: [DONE]" not in body:
        raise SystemExit(f"no whole response: {body[:200]!r}")
    line = {
        "client_port": sock.getsockname()[1],
        "version": tls.version(),
        "resumed": tls.session_reused,
        "server_view_ns": end - t_hello,
        "client_handshake_ns": t_done - t_hello,
        "ttft_ns": t_first - t_send,
    }
    session = tls.session
    sock.close()
    return line, session


def main():
    port = int(sys.argv[1])
    sessions, contexts = {}, {}
    for item in sys.argv[2:]:
        spec, delay_ms = item.split(":")
        version, resume = spec.rstrip("r"), spec.endswith("r")
        ctx = contexts.setdefault(version, context(version))
        # nginx reset one handshake of a full suite's run (2026-12-07, not reproduced):
        # a reset connection is tried once more, on a port of its own, which the test
        # matches (the reset one has no line and is not judged).
        for attempt in (1, 2):
            try:
                line, session = connection(port, ctx, sessions.get(version) if resume else None,
                                           int(delay_ms) / 1000)
                break
            except ConnectionResetError as e:
                if attempt == 2:
                    raise
                print(f"tls_client: {spec} reset during its handshake ({e}); again", file=sys.stderr)
        if not resume:
            sessions[version] = session
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
