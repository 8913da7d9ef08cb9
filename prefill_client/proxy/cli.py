"""``epd proxy``'s command line: its arguments, then one process serving, or ``--workers`` of them (proxy process)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from common.config import ProxyConfig, add_arguments, build
from common.errors import ConfigError
from prefill_client.proxy.front import load_api_keys
from prefill_client.proxy.serve import serve
from prefill_client.proxy.workers import Supervisor

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd proxy", description="OpenAI-compatible front: encode media on epd encoders, forward to vLLM")
    add_arguments(parser, ProxyConfig)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        cfg = build(ProxyConfig, args, dict(os.environ))
        keys = load_api_keys(cfg)  # a key file that cannot be used stops the start here, not in a worker
    except ConfigError as exc:
        print(f"epd proxy: {exc}", file=sys.stderr)
        return 2
    logger.info("epd proxy: encoders %s, backends %s, model id %s, %s, %s", ",".join(cfg.encoders),
                ",".join(cfg.backends), cfg.model_id or "from each request's model, else the backends' /v1/models",
                f"{len(keys)} API keys" if len(keys) else "no API key asked",
                f"at most {cfg.max_inflight} requests in flight per process" if cfg.max_inflight
                else "no bound on requests in flight")
    if cfg.workers > 1:
        return Supervisor(cfg, args.log_level.upper()).run()

    def listening(port: int) -> None:
        logger.info("epd proxy listening on http://%s:%d", cfg.host, port)
        print(json.dumps({"proxy_port": port}), flush=True)

    serve(cfg, cfg.port, listening)
    return 0
