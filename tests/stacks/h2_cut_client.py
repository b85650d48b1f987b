"""A raw HTTP/2 cleartext (prior knowledge) gRPC client, standard library only, that cuts frame
headers between two writes, as a real NIC cuts a client's frames at the MSS and as grpc-go and
Go's net/http2 cut their own writes.

`h2_cut_client.py PORT OUT`: one connection (TCP_NODELAY, so that each write is a segment),
CALLS server-streaming calls to /ttft.Gen/Stream (grpc_stream.py's server). For call k the
HEADERS frame's 9-byte header goes out in two writes cut after 1 + k % 8 bytes, 20 ms apart,
the request's DATA frame header likewise (cut after 8 - k % 8); the call CANCEL is reset after
its first message with a RST_STREAM (CANCEL) whose header is cut too. A reader thread stamps
CLOCK_MONOTONIC when it reads a call's first message. One JSON line per call: stream id,
t_start (before the first write), t_cut (after it, before the rest), t_first, messages read.
"""

import json
import queue
import socket
import struct
import sys
import threading
import time

from h2raw import DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PREFACE, RST_STREAM, SETTINGS
from h2raw import frame, grpc_message, literal, read_frame

CALLS = 6
CANCEL = 2
GAP_S = 0.02
METHOD = b"/ttft.Gen/Stream"
def now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class Conn:
    """The socket, and a writer thread that sends each queued write's pieces GAP_S apart, nothing
    else in between: the reader never waits on a write (its read times stay the client's)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.queue: "queue.Queue[tuple[tuple[bytes, ...], dict]]" = queue.Queue()
        threading.Thread(target=self._writer, daemon=True).start()

    def _writer(self) -> None:
        while True:
            pieces, out = self.queue.get()
            for i, p in enumerate(pieces):
                if i:
                    time.sleep(GAP_S)
                self.sock.sendall(p)
                if i == 0:
                    out["t_cut"] = now()
            out["done"].set()

    def send(self, *pieces: bytes) -> dict:
        out = {"done": threading.Event()}
        self.queue.put((pieces, out))
        return out

    def write(self, *pieces: bytes) -> int:
        """Sends and waits: the time after the first piece."""
        out = self.send(*pieces)
        out["done"].wait()
        return out["t_cut"]


def main(port: int, out: str) -> None:
    c = Conn(port)
    c.write(PREFACE + frame(SETTINGS, 0, 0, b""))
    rows = {2 * k + 1: dict(stream=2 * k + 1, cancelled=(k == CANCEL), msgs=0) for k in range(CALLS)}
    open_streams = set(rows)
    done = threading.Event()

    def reader() -> None:
        try:
            while open_streams:
                kind, flags, stream, payload = read_frame(c.sock, c.send)
                length = len(payload)
                if kind == GOAWAY:
                    break
                row = rows.get(stream)
                if row is None or stream not in open_streams:
                    continue
                if kind == DATA and length > 0:
                    if row["msgs"] == 0:
                        row["t_first"] = now()
                    row["msgs"] += 1
                    if row["cancelled"]:
                        rst = frame(RST_STREAM, 0, stream, struct.pack(">I", 8))
                        c.send(rst[:3], rst[3:])
                        open_streams.discard(stream)
                        continue
                if kind in (DATA, HEADERS) and flags & END_STREAM or kind == RST_STREAM:
                    open_streams.discard(stream)
        finally:
            done.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    authority = b"127.0.0.1:%d" % port
    block = b"".join(
        literal(n, v)
        for n, v in [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", METHOD),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
    )
    msg = b"prompt"
    for k in range(CALLS):
        stream = 2 * k + 1
        row = rows[stream]
        headers = frame(HEADERS, END_HEADERS, stream, block)
        data = frame(DATA, END_STREAM, stream, grpc_message(msg))
        row["t_start"] = now()
        cut = 1 + k % 8
        # HEADERS header cut, then its block and the DATA header cut too.
        row["t_cut"] = c.write(headers[:cut], headers[cut:] + data[: 8 - k % 8], data[8 - k % 8 :])
    done.wait(timeout=30)
    c.sock.close()
    with open(out, "w") as f:
        for r in rows.values():
            f.write(json.dumps(r) + "\n")
    if open_streams:
        sys.exit("streams left open: %s" % sorted(open_streams))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
