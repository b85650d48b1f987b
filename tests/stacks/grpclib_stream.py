"""The server of grpc_stream.py's method on grpclib (pure Python, on the `h2` library): a third
gRPC implementation beside grpcio's C core and tonic, with its own HPACK encoder, flow control
and frame writes.

`PORT`: method /ttft.Gen/Stream streams MSGS messages per call, each after one step of the
emulated GPU (gpu.py: the stub CUDA runtime of $STACK_CUDART); /ttft.Gen/Chat (bidirectional)
reads the prompt, then streams the same while it reads the client's later messages; the prompt
FAIL_PROMPT gets one message, then RESOURCE_EXHAUSTED. Bytes in and out through a codec
that passes them as they are: no protobuf needed.
"""

import asyncio
import sys

from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.encoding.base import CodecBase
from grpclib.server import Server

import gpu
from grpc_stream import BIDI_METHOD, FAIL_MESSAGE, FAIL_PROMPT, METHOD, MSGS


class RawBytes(CodecBase):
    """Messages as bytes, under the content type every gRPC client sends."""

    __content_subtype__ = "proto"

    def encode(self, message, message_type):
        return message

    def decode(self, data, message_type):
        return data


class Gen:
    async def stream(self, stream) -> None:
        if await stream.recv_message() == FAIL_PROMPT:
            await stream.send_message(b"token 0")
            raise GRPCError(Status.RESOURCE_EXHAUSTED, FAIL_MESSAGE)
        await self.stream_answer(stream)

    async def chat(self, stream) -> None:
        await stream.recv_message()

        async def drain() -> None:
            async for _ in stream:
                pass

        rest = asyncio.ensure_future(drain())
        await self.stream_answer(stream)
        await rest

    async def stream_answer(self, stream) -> None:
        for i in range(MSGS):
            await asyncio.to_thread(gpu.step, i)
            await stream.send_message(b"token %d" % i)

    def __mapping__(self):
        return {
            METHOD: Handler(self.stream, Cardinality.UNARY_STREAM, bytes, bytes),
            BIDI_METHOD: Handler(self.chat, Cardinality.STREAM_STREAM, bytes, bytes),
        }


async def main(port: int) -> None:
    server = Server([Gen()], codec=RawBytes())
    await server.start("127.0.0.1", port)
    await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
