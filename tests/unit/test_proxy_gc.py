"""A proxy process takes its start-up heap out of the collector's sight before it reports that
it listens (``gc.freeze``): a full collection then walks only what came after start-up, instead
of the ~190,000 objects of the libraries it imports. Run in its own interpreter: a freeze is for
the whole process."""

from __future__ import annotations

import json
import subprocess
import sys

CASE = """
import asyncio, gc, json, os, signal
from aiohttp import web
import prefill_client.proxy.app  # the libraries a proxy process imports
from common.config import ProxyConfig
from prefill_client.proxy.serve import _run

seen = {}
def started(port):
    seen.update(port=port, frozen=gc.get_freeze_count(), tracked=len(gc.get_objects()))
    # _run stops on a signal, once its handlers are in (right after this call returns)
    asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
before = gc.get_freeze_count()
asyncio.run(_run(web.Application(), ProxyConfig(port=0), 0, started, False, None, lambda: 0))
print(json.dumps({"before": before, **seen}))
"""


def test_the_start_up_heap_is_frozen_before_the_proxy_says_it_listens() -> None:
    done = subprocess.run([sys.executable, "-c", CASE], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["before"] == 0 and got["port"] > 0
    assert got["frozen"] > 100_000, got  # the imported libraries' objects
    assert got["tracked"] < got["frozen"] // 10, got  # what a full collection still walks
