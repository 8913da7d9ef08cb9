"""``common.malloc.prefault``: memory a thread mapped and freed with the thresholds set is what its
next allocations take, without a page fault; without the thresholds nothing is mapped.

Each case runs in its own interpreter: ``mallopt`` changes the whole process."""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not hasattr(resource, "RUSAGE_THREAD"),
                                reason="glibc's mallopt and per-thread fault counts")

ITEMS = 16
ITEM_BYTES = 2 << 20  # the rows of a 224 px Qwen3-VL image in float32
PAGES_PER_ITEM = ITEM_BYTES // 4096

CASE = """
import json, resource, sys, threading
from common.malloc import keep_freed_memory, prefault
kept = keep_freed_memory({}) if sys.argv[1] == "keep" else False
out = {"kept": kept}
def pull_thread():
    out["prefaulted"] = prefault(%d << 20) if sys.argv[2] == "prefault" else False
    held = []  # like vLLM's encoder cache: nothing is freed in between
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(%d):
        held.append(bytearray(%d))
    out["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
t = threading.Thread(target=pull_thread)
t.start(); t.join()
print(json.dumps(out))
""" % (ITEMS * ITEM_BYTES * 2 >> 20, ITEMS, ITEM_BYTES)


def _case(keep: str, pre: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CASE, keep, pre], capture_output=True, text=True, timeout=120,
                          check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_prefaulted_thread_allocates_new_items_without_page_faults() -> None:
    got = _case("keep", "prefault")
    assert got["kept"] is True and got["prefaulted"] is True
    assert isinstance(got["faults"], int) and got["faults"] < PAGES_PER_ITEM, got


def test_without_prefault_every_new_item_faults_its_pages() -> None:
    got = _case("keep", "none")
    assert isinstance(got["faults"], int) and got["faults"] >= ITEMS * PAGES_PER_ITEM * 0.9, got


def test_prefault_maps_nothing_unless_freed_memory_is_kept() -> None:
    got = _case("default", "prefault")
    assert got["kept"] is False and got["prefaulted"] is False
    assert isinstance(got["faults"], int) and got["faults"] >= ITEMS * PAGES_PER_ITEM * 0.9, got
