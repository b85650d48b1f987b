"""HTTP/2 frames by hand, standard library only: the raw h2c client and server of
tests/tests/grpc.rs (h2_cut_client.py, h2_cut_server.py) that cut frame headers where no
library would."""

import socket
import struct
from typing import Callable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, ACK, END_HEADERS = 1, 1, 4


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal without indexing, new name, no Huffman (lengths < 127)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_message(msg: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def read_exact(sock: socket.socket, n: int) -> bytes:
    """`n` bytes; every segment acknowledged at once (TCP_QUICKACK, which the kernel clears
    again): the test compares the tracer's client TTFT estimate, dated by the client's ACK, with
    the client's own, and a delayed ACK (up to 40 ms and more) would be read as a late client."""
    buf = b""
    while len(buf) < n:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError("connection closed")
        buf += got
    return buf


def read_frame(sock: socket.socket, send: Callable[[bytes], object]) -> tuple[int, int, int, bytes]:
    """The next frame (kind, flags, stream, payload); SETTINGS and PING are acknowledged with
    `send`."""
    head = read_exact(sock, 9)
    length = int.from_bytes(head[:3], "big")
    kind, flags = head[3], head[4]
    stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
    payload = read_exact(sock, length)
    if kind == SETTINGS and not flags & ACK:
        send(frame(SETTINGS, ACK, 0, b""))
    elif kind == PING and not flags & ACK:
        send(frame(PING, ACK, 0, payload))
    return kind, flags, stream, payload
