"""A gRPC streaming service on grpcio (C core), and its client.

`serve PORT`: method /ttft.Gen/Stream (server streaming) streams MSGS messages per call, each
after one step of the emulated GPU (gpu.py: the stub CUDA runtime of $STACK_CUDART; prefill
before the first, a decode step before each later one); /ttft.Gen/Chat (bidirectional) reads the
prompt, its first message, then streams the same (the client's later messages are left unread).
The prompt FAIL_PROMPT is answered with one message, then RESOURCE_EXHAUSTED and FAIL_MESSAGE.
Bytes in and out: no protobuf needed.

`client PORT OUT`: opens CALLS calls on one channel, started one after the other from one
thread (so call k is HTTP/2 stream 2k+1), each read by a thread of its own, which stamps
CLOCK_MONOTONIC when it has read the call's first message. The odd calls are bidirectional:
the client sends its prompt, a second message once it has read the first answer, then half
closes (a client DATA frame in the middle of the response). The calls in CANCELLED are cancelled
after their first message (the client sends RST_STREAM CANCEL). Writes one JSON line per call.

`client-statuses PORT OUT`: calls one after the other, each ending with its own gRPC status
(see `statuses`); writes one JSON line per call with its code and details.

`client-midlife PORT OUT`: the same calls once on the channel, then "warm" on stdout; once a line
comes on stdin (the tracer attached meanwhile), one more call read whole, then the calls again
on the same channel (and connection), of which it writes the lines.
"""

import json
import sys
import threading
import time
from concurrent import futures

import grpc

MSGS = 6
CALLS = 6
# A prompt the servers answer with one message, then RESOURCE_EXHAUSTED and this message.
FAIL_PROMPT = b"fail"
FAIL_MESSAGE = "KV cache full"
# A method no server has: UNIMPLEMENTED, in a response of trailers alone.
MISSING_METHOD = "/ttft.Gen/Missing"
CANCELLED = (2, 5)
METHOD = "/ttft.Gen/Stream"
BIDI_METHOD = "/ttft.Gen/Chat"


def now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def serve(port: int) -> None:
    import gpu

    def stream(request, context):
        if request == FAIL_PROMPT:
            yield b"token 0"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, FAIL_MESSAGE)
        for i in range(MSGS):
            gpu.step(i)
            if not context.is_active():
                return
            yield b"token %d" % i

    def chat(requests, context):
        next(requests)
        yield from stream(None, context)

    handler = grpc.method_handlers_generic_handler(
        "ttft.Gen",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * CALLS))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def client(port: int, out: str, midlife: bool = False) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    first = 1
    if midlife:
        calls(channel, first)
        first += 2 * CALLS
        print("warm", flush=True)
        sys.stdin.readline()
        # The call whose request segment adopts the connection (its frames
        # came before the connection was followed), read whole first.
        for _ in channel.unary_stream(METHOD)(b"prompt"):
            pass
        first += 2
    rows = calls(channel, first)
    channel.close()
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def statuses(port: int, out: str) -> None:
    """One call after the other on one channel, each ending with its own gRPC status: read
    whole (OK), a missing method (UNIMPLEMENTED, trailers alone), the failing prompt (one
    message, then RESOURCE_EXHAUSTED), read whole again (the OK trailers from HPACK's dynamic
    table)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    rows = []
    for k, (method, prompt) in enumerate([(METHOD, b"prompt"), (MISSING_METHOD, b"prompt"),
                                          (METHOD, FAIL_PROMPT), (METHOD, b"prompt")]):
        row = dict(stream=2 * k + 1, cancelled=False, t_start=now(), msgs=0, code="OK",
                   details=None)
        try:
            for _ in channel.unary_stream(method)(prompt):
                if row["msgs"] == 0:
                    row["t_first"] = now()
                row["msgs"] += 1
        except grpc.RpcError as e:
            row["code"], row["details"] = e.code().name, e.details()
        rows.append(row)
    channel.close()
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def calls(channel, first: int) -> list:
    """CALLS calls on `channel`, the first on stream `first`: their rows."""
    call = channel.unary_stream(METHOD)
    chat = channel.stream_stream(BIDI_METHOD)
    rows = [dict(stream=first + 2 * k, cancelled=(k in CANCELLED), bidi=(k % 2 == 1))
            for k in range(CALLS)]
    first_read = [threading.Event() for _ in range(CALLS)]

    def requests(k: int):
        yield b"prompt"
        first_read[k].wait(10)
        yield b"more"

    def read(k: int, it) -> None:
        msgs = 0
        try:
            for _ in it:
                if msgs == 0:
                    rows[k]["t_first"] = now()
                    first_read[k].set()
                msgs += 1
                if rows[k]["cancelled"]:
                    it.cancel()
        except grpc.RpcError as e:
            rows[k]["code"] = e.code().name
        rows[k]["msgs"] = msgs

    readers = []
    for k in range(CALLS):
        rows[k]["t_start"] = now()
        it = chat(requests(k)) if rows[k]["bidi"] else call(b"prompt")
        t = threading.Thread(target=read, args=(k, it))
        t.start()
        readers.append(t)
    for t in readers:
        t.join()
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif sys.argv[1] == "client-statuses":
        statuses(int(sys.argv[2]), sys.argv[3])
    else:
        client(int(sys.argv[2]), sys.argv[3], midlife=sys.argv[1] == "client-midlife")
