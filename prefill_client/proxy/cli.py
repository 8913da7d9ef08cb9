"""``epd proxy``'s command line: its arguments, and serving the application until a signal (proxy process)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from aiohttp import web

from common.config import ProxyConfig, add_arguments, build
from common.errors import ConfigError
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.proxy.app import Proxy
from prefill_client.proxy.clients import new_client

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd proxy", description="OpenAI-compatible front: encode media on epd encoders, forward to vLLM")
    add_arguments(parser, ProxyConfig)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


async def _serve(cfg: ProxyConfig, client: EncoderCacheClient | None) -> None:
    runner = web.AppRunner(Proxy(cfg, client).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = int(runner.addresses[0][1]) if runner.addresses else cfg.port
    logger.info("epd proxy listening on http://%s:%d (encoders %s, backends %s, model id %s)", cfg.host, port,
                ",".join(cfg.encoders), ",".join(cfg.backends),
                cfg.model_id or "from each request's model, else the backends' /v1/models")
    print(json.dumps({"proxy_port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        cfg = build(ProxyConfig, args, dict(os.environ))
    except ConfigError as exc:
        print(f"epd proxy: {exc}", file=sys.stderr)
        return 2
    # --model-id: one client, made now, for every request; else one per model id, made on first use.
    client = new_client(cfg, cfg.model_id) if cfg.model_id is not None else None
    try:
        asyncio.run(_serve(cfg, client))
    finally:
        if client is not None:
            client.close()
    return 0
