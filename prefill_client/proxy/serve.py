"""Serving the proxy's application in one process until a signal: the proxy, or one of its workers (proxy process)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from common.config import ProxyConfig
from common.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0  # how often a worker checks that its parent is still there
ACCESS_LOGGER = "aiohttp.access"
# --access-log: address, request line, status, bytes sent, seconds taken, user agent, the caller's
# X-Request-Id (which goes on to vLLM too); no key, no body.
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf "%{User-Agent}i" "%{X-Request-Id}i"'


def serve(cfg: ProxyConfig, port: int, started: Callable[[int], None], *, reuse_port: bool = False,
          multiprocess_dir: str | None = None, parent_pid: int | None = None) -> None:
    """Serve on ``cfg.host``:``port`` until a signal; ``started(port)`` once it listens (the port
    bound, for ``port`` 0). ``reuse_port``: bind with SO_REUSEPORT, beside the other workers;
    ``multiprocess_dir``: where the workers' metrics add up; ``parent_pid``: stop, as on a
    signal, once that process is no longer this one's parent (it died without stopping us)."""
    # Imported here: the parent of --workers runs no application, and need not load the encoder
    # client (nor torch, which it imports).
    from prefill_client.proxy.app import Proxy
    from prefill_client.proxy.clients import new_client

    # --model-id: one client, made now, for every request; else one per model id, made on first use.
    client = new_client(cfg, cfg.model_id) if cfg.model_id is not None else None
    try:
        proxy = Proxy(cfg, client, metrics=ProxyMetrics(multiprocess_dir=multiprocess_dir))
        _event_loop_runner()(_run(proxy.app(), cfg, port, started, reuse_port, parent_pid, lambda: proxy.inflight))
    finally:
        if client is not None:
            client.close()


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    """uvloop's runner where uvloop is installed (it comes with vLLM), else asyncio's.

    A proxy's work is mostly relaying an answer's chunks: a read and a write per chunk, whose
    Python-level transport costs more CPU than the system calls themselves; uvloop's
    transports are native code.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


async def _run(app: web.Application, cfg: ProxyConfig, port: int, started: Callable[[int], None], reuse_port: bool,
               parent_pid: int | None, inflight: Callable[[], int]) -> None:
    """Serve ``app`` until a signal (or the parent is gone), then drain: stop listening, give the
    requests in flight ``cfg.drain_grace_s`` to finish, cut the rest, and clean up."""
    runner = web.AppRunner(app, access_log=logging.getLogger(ACCESS_LOGGER) if cfg.access_log else None,
                           access_log_format=ACCESS_LOG_FORMAT, shutdown_timeout=cfg.drain_grace_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, port, reuse_port=reuse_port or None)
        await site.start()
        freeze_startup_heap()
        started(int(runner.addresses[0][1]) if runner.addresses else port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watch = loop.create_task(_until_orphaned(parent_pid, stop)) if parent_pid is not None else None
        await stop.wait()
        if watch is not None:
            watch.cancel()
        logger.info("epd proxy: stopping; no new connections; requests in flight: %d, given up to %g s to finish",
                    inflight(), cfg.drain_grace_s)
    finally:
        # Stops listening, closes idle connections, waits up to the shutdown timeout for the
        # handlers running, cancels those left (closing their backend requests), then on_cleanup.
        await runner.cleanup()


def freeze_startup_heap() -> None:
    """Take what start-up built out of the garbage collector's sight (``gc.freeze``), as vLLM's
    server does: the libraries the proxy imports (the encoder client, gRPC, torch) are about
    190,000 objects, and every full collection walked them all, stopping every stream in the
    process for about 90 ms on 2 cores; now it walks only what came after. They live as long
    as the process anyway."""
    gc.collect()
    gc.freeze()


async def _until_orphaned(parent_pid: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if os.getppid() != parent_pid:
            logger.error("the parent process %d is gone; stopping", parent_pid)
            stop.set()
            return
        await asyncio.sleep(PARENT_POLL_S)
