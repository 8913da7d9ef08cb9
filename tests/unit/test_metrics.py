from __future__ import annotations

import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from common import metrics
from common.metrics import EncoderMetrics, PrefillMetrics

REFERENCE_NAMES = {
    "vllm:mm_cache_queries", "vllm:mm_cache_hits",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm_neuron:scheduler_encoder_cache_queries", "vllm_neuron:scheduler_encoder_cache_hits",
    "vllm_neuron:device_encoder_cache_queries", "vllm_neuron:device_encoder_cache_misses",
    "vllm_neuron:device_encoder_cache_evictions",
    "vllm_neuron:device_encoder_cache_active_blocks", "vllm_neuron:device_encoder_cache_free_blocks",
    "vllm_neuron:device_encoder_cache_held_blocks", "vllm_neuron:device_encoder_cache_active_real_tokens",
}


def _families(blob: bytes) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(blob.decode())}


def test_reference_names_exported_by_the_right_process() -> None:
    enc = _families(EncoderMetrics().exposition())
    pre = _families(PrefillMetrics().exposition())
    assert {n for n in REFERENCE_NAMES if "prefix" not in n and "scheduler" not in n} <= set(enc)
    assert {metrics.PREFIX_CACHE_QUERIES, metrics.SCHEDULER_EC_HITS, metrics.MM_CACHE_QUERIES} <= set(pre)
    assert not {metrics.PREFIX_CACHE_QUERIES, metrics.SCHEDULER_EC_QUERIES} & set(enc)
    assert not {metrics.DEVICE_EC_QUERIES} & set(pre)


def test_occupancy_gauges_and_separate_registries() -> None:
    a, b = EncoderMetrics(), EncoderMetrics()
    a.set_occupancy(active=3, free=5, held=1, active_real_tokens=700)
    fams = _families(a.exposition())
    values = {name: fams[name].samples[0].value for name in (
        metrics.DEVICE_EC_ACTIVE_BLOCKS, metrics.DEVICE_EC_FREE_BLOCKS,
        metrics.DEVICE_EC_HELD_BLOCKS, metrics.DEVICE_EC_ACTIVE_REAL_TOKENS)}
    assert list(values.values()) == [3, 5, 1, 700]
    assert _families(b.exposition())[metrics.DEVICE_EC_ACTIVE_BLOCKS].samples[0].value == 0


def test_gauges_sum_in_multiprocess_mode(tmp_path) -> None:
    code = f"""
import os
os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
from common.metrics import EncoderMetrics
m = EncoderMetrics()
m.set_occupancy(active=int(os.environ["ACTIVE"]), free=1, held=0, active_real_tokens=0)
m.device_queries.inc()
"""
    for active in (2, 5):
        subprocess.run([sys.executable, "-c", code], check=True, env={"ACTIVE": str(active), "PATH": ""})
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    fams = _families(generate_latest(registry))
    assert fams[metrics.DEVICE_EC_ACTIVE_BLOCKS].samples[0].value == 7
    assert fams[metrics.DEVICE_EC_QUERIES].samples[0].value == 2


def test_a_scrape_never_sees_half_an_occupancy_update() -> None:
    import threading

    m = EncoderMetrics()
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            i = (i + 1) % 50
            m.set_occupancy(active=i, free=50 - i, held=13, active_real_tokens=i)

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _ in range(300):
            fams = _families(m.exposition())
            total = sum(fams[name].samples[0].value for name in (
                metrics.DEVICE_EC_ACTIVE_BLOCKS, metrics.DEVICE_EC_FREE_BLOCKS, metrics.DEVICE_EC_HELD_BLOCKS))
            assert total in (0, 63)  # 0 only before the first update
    finally:
        stop.set()
        writer.join(5)
