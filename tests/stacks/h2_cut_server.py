"""A raw HTTP/2 cleartext gRPC server, standard library only (and gpu.py), that cuts every frame
header it sends between two send() calls, as grpc-go and Go's net/http2 cut theirs where a frame
straddles their write buffer.

`h2_cut_server.py PORT`: the method of grpc_stream.py (any path): per call, response HEADERS,
MSGS messages each after a step of the emulated GPU (gpu.py: prefill before the first, a decode
step before each later one), then the trailers (grpc-status 0). Each frame's 9-byte header is
sent in two sends (TCP_NODELAY: two segments), cut after 1 to 8 bytes, varied over the frames;
a call the client resets (RST_STREAM) stops at its next message.
"""

import socket
import sys
import threading

import gpu
from h2raw import DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PREFACE, RST_STREAM, SETTINGS
from h2raw import frame, grpc_message, literal, read_exact, read_frame

MSGS = 6
# `:status: 200` (static index 8), then the content type.
RESPONSE_HEADERS = b"\x88" + literal(b"content-type", b"application/grpc")
TRAILERS = literal(b"grpc-status", b"0")


class Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.reset: set[int] = set()
        self.cuts = 0

    def send(self, f: bytes) -> None:
        """One frame, its header cut between two sends (nothing else in between)."""
        with self.lock:
            at = 1 + self.cuts % 8
            self.cuts += 1
            self.sock.sendall(f[:at])
            self.sock.sendall(f[at:])

    def stream(self, sid: int) -> None:
        self.send(frame(HEADERS, END_HEADERS, sid, RESPONSE_HEADERS))
        for i in range(MSGS):
            gpu.step(i)
            if sid in self.reset:
                return
            msg = b"token %d" % i
            self.send(frame(DATA, 0, sid, grpc_message(msg)))
        self.send(frame(HEADERS, END_HEADERS | END_STREAM, sid, TRAILERS))

    def serve(self) -> None:
        if read_exact(self.sock, len(PREFACE)) != PREFACE:
            return
        self.send(frame(SETTINGS, 0, 0, b""))
        opened: set[int] = set()
        while True:
            kind, _flags, sid, _payload = read_frame(self.sock, self.send)
            if kind == HEADERS and sid % 2 == 1 and sid not in opened:
                opened.add(sid)
                threading.Thread(target=self.stream, args=(sid,), daemon=True).start()
            elif kind == RST_STREAM:
                self.reset.add(sid)
            elif kind == GOAWAY:
                return


def main(port: int) -> None:
    ls = socket.create_server(("127.0.0.1", port))
    while True:
        sock, _ = ls.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def run(s: socket.socket = sock) -> None:
            try:
                Conn(s).serve()
            except (EOFError, OSError):
                pass
            finally:
                s.close()

        threading.Thread(target=run, daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]))
