#!/usr/bin/env python3
"""The TLS bench's server and client (`cargo xtask bench --only tls`, xtask/src/tlscost.rs).

    tls_bench.py server CERT KEY CUDART [asyncio]   prints its port, serves until killed
    tls_bench.py client PORT REQUESTS WRITES [plain]

With CERT `-`, the server speaks plain HTTP (the same code without TLS: the baseline of what
a followed connection costs), and so does a client told `plain`.

The server terminates TLS itself with CPython's `ssl` on blocking sockets (OpenSSL with a
socket BIO), a thread per connection, or with `asyncio` under uvicorn's loop (OpenSSL with a
memory BIO: each record bound to its send by its ciphertext), and maps the stub CUDA runtime as
an inference server maps its own (no GPU work: the bench times TLS).
Each `GET /` gets a small streamed response (headers, one SSE chunk, the terminator);
`GET /writes?n=N` makes the server write N 64-byte chunks, each its own `SSL_write`, and
answer with the nanoseconds each took, timed inside the server.

The client makes REQUESTS requests on one kept-alive connection, then one /writes request
of WRITES writes, and prints one JSON line: requests per second, and ns per SSL_write.
"""
import ctypes
import json
import os
import socket
import ssl
import sys
import threading
import time

CHUNK = b"data: " + b"x" * 50 + b"\n\n"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def answer(path: bytes, write) -> None:
    """Writes the response to `path` with `write` (one call per piece: on TLS, one `SSL_write`
    each, and under asyncio the send of its records too)."""
    if path.startswith(b"/writes?n="):
        n = int(path.split(b"=", 1)[1])
        write(HEAD)
        piece = chunked(b"." * 57)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            write(piece)
        ns = (time.perf_counter_ns() - t0) / n
        write(chunked(json.dumps({"ns_per_write": ns}).encode()) + b"0\r\n\r\n")
    else:
        write(HEAD)
        write(chunked(CHUNK))
        write(b"0\r\n\r\n")


def next_request(buf: bytes) -> tuple[bytes, bytes] | None:
    """The path of the first whole request head in `buf`, and what follows it."""
    if b"\r\n\r\n" not in buf:
        return None
    head, rest = buf.split(b"\r\n\r\n", 1)
    return head.split(b" ", 2)[1], rest


def serve_conn(conn: socket.socket) -> None:
    buf = b""
    with conn:
        while True:
            while (request := next_request(buf)) is None:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            path, buf = request
            answer(path, conn.sendall)


async def serve_stream(reader, writer) -> None:
    """`serve_conn` under asyncio."""
    buf = b""
    try:
        while True:
            while (request := next_request(buf)) is None:
                data = await reader.read(65536)
                if not data:
                    return
                buf += data
            path, buf = request
            answer(path, writer.write)
            await writer.drain()
    finally:
        writer.close()


def serve_asyncio(ctx: ssl.SSLContext) -> None:
    import asyncio

    async def main() -> None:
        srv = await asyncio.start_server(serve_stream, "127.0.0.1", 0, ssl=ctx)
        print(srv.sockets[0].getsockname()[1], flush=True)
        await srv.serve_forever()

    asyncio.run(main())


def server(cert: str, key: str, cudart: str, asyncio_mode: bool) -> None:
    ctypes.CDLL(cudart)
    ctx = None
    if cert != "-":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
    if asyncio_mode:
        return serve_asyncio(ctx)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    print(lsock.getsockname()[1], flush=True)
    while True:
        sock, _ = lsock.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = ctx.wrap_socket(sock, server_side=True) if ctx else sock
        threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()


def read_response(conn: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
    """The body up to the chunked terminator, and what came after it."""
    whole, start = bytearray(buf), 0
    # The terminator is looked for in what came since the last look only.
    while (end := whole.find(b"0\r\n\r\n", start)) < 0:
        start = max(0, len(whole) - 4)
        data = conn.recv(65536)
        if not data:
            raise SystemExit("the server closed")
        whole += data
    return bytes(whole[:end]), bytes(whole[end + 5:])


def client(port: int, requests: int, writes: int, plain: bool) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = sock if plain else ctx.wrap_socket(sock)
    req = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
    buf = b""
    t0 = time.perf_counter_ns()
    for _ in range(requests):
        conn.sendall(req)
        _, buf = read_response(conn, buf)
    rps = requests / ((time.perf_counter_ns() - t0) / 1e9)
    conn.sendall(b"GET /writes?n=%d HTTP/1.1\r\nHost: bench\r\n\r\n" % writes)
    body, buf = read_response(conn, buf)
    last = body.rstrip(b"\r\n").rsplit(b"\r\n", 1)[-1]
    print(json.dumps({"requests_per_s": rps, **json.loads(last)}), flush=True)
    conn.close()


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:] == ["asyncio"])
    else:
        client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["plain"])
