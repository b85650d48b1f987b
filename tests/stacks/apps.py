"""Minimal streamed-completions handlers on real Python HTTP stacks.

Each handler waits for the GPU step (gpu.py) before every token and hands the stack one body
piece per token; the stack's own code does all of the HTTP (framing, keep-alive, close). Each
stamps CLOCK_MONOTONIC at its first line and just before it hands the stack its first token
(gpu.stamp, with the client's port). Paths:
/v1/chat/completions and /v1/completions (SSE, as OpenAI's API), /api/generate (NDJSON).

  uvicorn apps:asgi / hypercorn apps:asgi     (ASGI, no framework)
  gunicorn apps:wsgi                          (WSGI, sync workers)
  python apps.py aiohttp PORT | tornado PORT

With STACK_TLS_CERT and STACK_TLS_KEY set, aiohttp serves TLS with that certificate (CPython's
ssl under asyncio: a memory BIO).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import sys

import gpu

PATHS = ("/v1/chat/completions", "/v1/completions", "/api/generate")


def tls_context() -> ssl.SSLContext | None:
    """The server's TLS context from STACK_TLS_CERT / STACK_TLS_KEY, or None without them."""
    cert, key = os.environ.get("STACK_TLS_CERT"), os.environ.get("STACK_TLS_KEY")
    if not cert or not key:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx


async def asgi(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    t_read = gpu.now()
    path = scope["path"]
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if path not in PATHS:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", gpu.content_type(path).encode()),
                            (b"cache-control", b"no-cache")]})
    n = gpu.tokens(body)
    for i in range(n):
        await asyncio.to_thread(gpu.step, i)
        t_send = gpu.now()
        await send({"type": "http.response.body", "body": gpu.chunk(path, i, n), "more_body": True})
        if i == 0:
            gpu.stamp(scope["client"][1], t_read, t_send)
    await send({"type": "http.response.body", "body": gpu.last(path), "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def wsgi(environ, start_response):
    t_read = gpu.now()
    path = environ["PATH_INFO"]
    if path not in PATHS:
        start_response("404 Not Found", [("Content-Length", "0")])
        return [b""]
    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length)
    start_response("200 OK", [("Content-Type", gpu.content_type(path)),
                              ("Cache-Control", "no-cache")])
    return gpu.stream(path, gpu.tokens(body), int(environ["REMOTE_PORT"]), t_read)


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        t_read = gpu.now()
        path = request.path
        body = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": gpu.content_type(path),
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = gpu.tokens(body)
        for i in range(n):
            await asyncio.to_thread(gpu.step, i)
            t_send = gpu.now()
            await resp.write(gpu.chunk(path, i, n))
            if i == 0:
                gpu.stamp(request.transport.get_extra_info("peername")[1], t_read, t_send)
        await resp.write(gpu.last(path))
        await resp.write_eof()
        return resp

    app = web.Application()
    for p in PATHS:
        app.router.add_post(p, handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None,
                ssl_context=tls_context())


def serve_tornado(port: int) -> None:
    import tornado.ioloop
    import tornado.web

    class Handler(tornado.web.RequestHandler):
        async def post(self):
            t_read = gpu.now()
            path = self.request.path
            self.set_header("Content-Type", gpu.content_type(path))
            self.set_header("Cache-Control", "no-cache")
            n = gpu.tokens(self.request.body)
            for i in range(n):
                await asyncio.to_thread(gpu.step, i)
                t_send = gpu.now()
                self.write(gpu.chunk(path, i, n))
                await self.flush()
                if i == 0:
                    gpu.stamp(self.request.connection.context.address[1], t_read, t_send)
            self.write(gpu.last(path))
            await self.flush()

    async def main():
        app = tornado.web.Application([(p, Handler) for p in PATHS])
        app.listen(port, address="127.0.0.1")
        await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    {"aiohttp": serve_aiohttp, "tornado": serve_tornado}[sys.argv[1]](int(sys.argv[2]))
