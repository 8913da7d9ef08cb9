"""``epd encoder``: command line of the encoder process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping

from common.config import EncoderServerConfig, add_arguments, build
from common.errors import ConfigError, EpdError
from common.malloc import keep_freed_memory

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd encoder",
        description=(
            "Serve the encoder cache: gRPC EncoderCacheService + grpc.health.v1 + reflection, "
            "the NIXL-registered cache buffer, and Prometheus /metrics."),
        epilog="Each flag can also be set by the environment variable named in its help; "
               "a flag wins over the variable.")
    add_arguments(parser, EncoderServerConfig)
    parser.add_argument(
        "--ready-file", default=None, metavar="PATH",
        help="write {'port', 'metrics_port', 'health_port', 'incarnation_id', 'transport', 'pid'} "
             "as JSON here once ready (readiness SERVING, every bucket graph built) "
             "(for scripts that start the encoder on port 0)")
    parser.add_argument(
        "--listening-file", default=None, metavar="PATH",
        help="write {'port', 'metrics_port', 'health_port', 'pid'} as JSON here as soon as the ports are "
             "bound, before the warm-up (health answers, liveness SERVING, not ready yet)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def _write_json(path: str, payload: Mapping[str, object]) -> None:
    """Write ``payload`` so that a reader polling for ``path`` never sees half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


async def _serve(config: EncoderServerConfig, ready_file: str | None, listening_file: str | None) -> int:
    """Listen, warm up, serve until SIGTERM/SIGINT, drain.

    A signal during the warm-up (minutes with compiled graphs) stops the process after the
    bucket being built instead of after all of them.
    """
    from encoder_server.server import EncoderServer, WarmupAbandoned  # heavy imports only once the flags parsed

    server = EncoderServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait(), name="epd-stop-signal")
    try:
        await server.listen()
        ports = {"port": server.port, "metrics_port": server.metrics_port, "health_port": server.health_port,
                 "pid": os.getpid()}
        if listening_file:
            _write_json(listening_file, ports)
        warming = asyncio.create_task(server.warm_up(), name="epd-warm-up")
        await asyncio.wait((warming, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not warming.done():
            # The bucket being built finishes first (bounded by one compile), then the cache goes.
            logger.info("signal received during the warm-up (%s): stopping", server.gate.progress)
            server.abandon_warm_up()
            with contextlib.suppress(WarmupAbandoned):
                await warming
        else:
            warming.result()
            # What the start-up built (torch, the tower, its graphs) lives as long as the process.
            # Frozen, a full collection no longer walks it: under a stream of Lookups, whose leases
            # outlive the young generations, one came every ~10 s and held the event loop ~0.35 s
            # (2-core box). Collected first, so no start-up garbage is kept for good.
            gc.collect()
            gc.freeze()
    except BaseException:
        await server.stop()
        raise
    finally:
        stopping.cancel()
    if not stop.is_set() and ready_file:
        _write_json(ready_file, {**ports, "incarnation_id": server.incarnation_id,
                                 "transport": server.transport_kind.value})
    await stop.wait()
    logger.info("signal received: draining (grace %.1f s)", config.drain_grace_s)
    await server.drain_and_stop()
    logger.info("encoder stopped")
    return 0


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        config = build(EncoderServerConfig, args, os.environ)
    except ConfigError as exc:
        parser.error(str(exc))
    if config.keep_freed_memory:
        keep_freed_memory()
    try:
        return asyncio.run(_serve(config, args.ready_file, args.listening_file))
    except EpdError as exc:
        print(f"epd encoder: {exc}", file=sys.stderr)
        return 2
