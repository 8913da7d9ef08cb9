"""``epd encoder``: command line of the encoder process."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from common.config import EncoderServerConfig, add_arguments, build
from common.errors import ConfigError, EpdError

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
             "as JSON here once SERVING "
             "(for scripts that start the encoder on port 0)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


async def _serve(config: EncoderServerConfig, ready_file: str | None) -> int:
    from encoder_server.server import EncoderServer  # heavy imports only once the flags parsed

    server = EncoderServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"port": server.port, "metrics_port": server.metrics_port,
                       "health_port": server.health_port,
                       "incarnation_id": server.incarnation_id,
                       "transport": server.transport_kind.value, "pid": os.getpid()}, f)
        os.replace(tmp, ready_file)
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
    try:
        return asyncio.run(_serve(config, args.ready_file))
    except EpdError as exc:
        print(f"epd encoder: {exc}", file=sys.stderr)
        return 2
