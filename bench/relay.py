"""A bare HTTP relay in front of one vLLM: the floor of any hop a front adds (bench process).

``bench/front.py`` (phases a and v) and ``bench/proxy_overhead.py`` put it beside ``epd proxy``,
before the same backend. The caller's body bytes go on unread and the answer comes back chunk by
chunk as it arrives, over one kept-alive ``aiohttp`` client: the library, relaying loop and event
loop (uvloop) the proxy uses, without an access log, as the proxy runs. No key check, no JSON
parse, no routing, no metrics: a front with nothing of its own to do. Whatever the proxy costs
beyond this relay is its own work; what the relay costs beyond going straight to vLLM is the hop
(a process, a socket each way, and on a 2-core box its turns on a core).
Usage: ``python bench/relay.py --port P --backend URL``.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host"})


def relay_app(backend: str) -> web.Application:
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def start(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(app: web.Application) -> None:
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with app[session_key].post(backend + request.path, data=data, headers=headers) as resp:
            out = web.StreamResponse(status=resp.status, headers={
                k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post(CHAT_PATH, forward)
    app.router.add_post(COMPLETIONS_PATH, forward)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True, help="the vLLM's base URL")
    args = parser.parse_args()
    try:
        import uvloop
        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    web.run_app(relay_app(args.backend.rstrip("/")), host="127.0.0.1", port=args.port, print=None,
                access_log=None, loop=loop)


if __name__ == "__main__":
    main()
