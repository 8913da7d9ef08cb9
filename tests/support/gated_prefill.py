"""`epd prefill` that waits for a line on stdin before each request (prefill process, system tests).

Run as ``python -m tests.support.gated_prefill <epd prefill flags>``. Everything
is the real command (:func:`prefill_client.reference.cli.main`: config, client, worker,
``/metrics`` server, ready file, output lines); only the worker's ``prefill``
is wrapped so that a test can scrape both processes' ``/metrics`` between two
requests of one worker (the layer caches live in the worker, so the
situations of one conversation must run in one process). Each wait has a
deadline; a closed stdin stops the run.
"""

from __future__ import annotations

import select
import sys

from common.config import PrefillConfig
from common.metrics import PrefillMetrics
from prefill_client.reference import cli
from prefill_client.reference.chat import ChatRequest
from prefill_client.reference.worker import PrefillResult, PrefillWorker

GATE_TIMEOUT_S = 120.0


class GateClosed(RuntimeError):
    """stdin closed or stayed silent past the deadline."""


def wait_for_go(timeout_s: float = GATE_TIMEOUT_S) -> None:
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not ready:
        raise GateClosed(f"no go line on stdin within {timeout_s} s")
    if not sys.stdin.readline():
        raise GateClosed("stdin closed before the next request")


def gated_worker(cfg: PrefillConfig, metrics: PrefillMetrics) -> tuple[cli.Closeable, PrefillWorker]:
    client, worker = cli.build_worker(cfg, metrics)
    run = worker.prefill

    def prefill(request: ChatRequest) -> PrefillResult:
        wait_for_go()
        return run(request)

    worker.prefill = prefill  # type: ignore[method-assign]
    return client, worker


if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:], make_worker=gated_worker))
