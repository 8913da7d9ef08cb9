"""Prometheus metric definitions for every process (encoder, prefill, proxy).

Names come from the reference metrics document (``vllm:*``,
``vllm_neuron:*``); the EPD pull metrics are this project's own (``epd_*``).
Where each layer lives once encode and prefill are separate processes:

============================  ==========  ==========================================
layer                         process     metrics
============================  ==========  ==========================================
1 input processor             both        vllm:mm_cache_queries / _hits
2b prefix cache               prefill     vllm:prefix_cache_queries / _hits
2a logical encoder cache      prefill     vllm_neuron:scheduler_encoder_cache_queries / _hits
3 device encoder cache        encoder     vllm_neuron:device_encoder_cache_queries / _misses /
                                          _evictions + occupancy gauges
EPD pull                      prefill     epd_pulls, epd_pull_bytes, epd_pull_latency_seconds,
                                          epd_ec_load_failures{reason}, epd_handshakes{result}
front door                    proxy       epd_proxy_* (requests, latencies, rejections, backends)
============================  ==========  ==========================================

Each class registers its metrics in the registry it is given (a fresh one by
default, so several servers in one test process do not collide). Gauges use
``multiprocess_mode="sum"``: with ``PROMETHEUS_MULTIPROC_DIR`` set, ranks'
values add up, so the export is the fleet-wide total.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

# vLLM does the same: the *_created series double every counter for no use.
disable_created_metrics()

# Layer 1: input processor.
MM_CACHE_QUERIES = "vllm:mm_cache_queries"
MM_CACHE_HITS = "vllm:mm_cache_hits"
# Layer 2b: prefix (KV) cache.
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
# Layer 2a: logical ("scheduler") encoder cache.
SCHEDULER_EC_QUERIES = "vllm_neuron:scheduler_encoder_cache_queries"
SCHEDULER_EC_HITS = "vllm_neuron:scheduler_encoder_cache_hits"
# Layer 3: device encoder cache.
DEVICE_EC_QUERIES = "vllm_neuron:device_encoder_cache_queries"
DEVICE_EC_MISSES = "vllm_neuron:device_encoder_cache_misses"
DEVICE_EC_EVICTIONS = "vllm_neuron:device_encoder_cache_evictions"
DEVICE_EC_ACTIVE_BLOCKS = "vllm_neuron:device_encoder_cache_active_blocks"
DEVICE_EC_FREE_BLOCKS = "vllm_neuron:device_encoder_cache_free_blocks"
DEVICE_EC_HELD_BLOCKS = "vllm_neuron:device_encoder_cache_held_blocks"
DEVICE_EC_ACTIVE_REAL_TOKENS = "vllm_neuron:device_encoder_cache_active_real_tokens"
# EPD pull (prefill side).
EPD_PULLS = "epd_pulls"
EPD_PULL_BYTES = "epd_pull_bytes"
EPD_PULLS_PREFETCHED = "epd_pulls_prefetched"
EPD_PULL_LATENCY = "epd_pull_latency_seconds"
EPD_LOAD_FAILURES = "epd_ec_load_failures"
EPD_HANDSHAKES = "epd_handshakes"
EPD_ENCODERS_KNOWN = "epd_encoders_known"
EPD_ENCODERS_READY = "epd_encoders_ready"
EPD_MEMBERSHIP_REFRESHES = "epd_encoder_membership_refreshes"
EPD_ROUTED_AWAY = "epd_items_routed_away"
EPD_CALLS_GIVEN_UP = "epd_encoder_calls_given_up"
# Encoder service.
EPD_ENCODE_REQUESTS = "epd_encoder_requests"
EPD_ENCODE_LATENCY = "epd_encoder_encode_latency_seconds"
EPD_LEASES_ACTIVE = "epd_encoder_leases_active"
EPD_LEASES_EXPIRED = "epd_encoder_leases_expired"
EPD_LEASES_DROPPED = "epd_encoder_leases_dropped"
EPD_WARMUP_BUCKETS = "epd_encoder_warmup_buckets"
EPD_QUEUE_TOKENS = "epd_encoder_queue_tokens"
EPD_RUN_FIXED = "epd_encoder_run_fixed_seconds"
EPD_RUN_PER_TOKEN = "epd_encoder_run_seconds_per_token"
EPD_WARMUP_BUCKETS_READY = "epd_encoder_warmup_buckets_ready"
# epd proxy: the OpenAI-compatible front (vLLM's server metrics as far as they fit, prefixed).
PROXY_PREFIX = "epd_proxy_"
PROXY_REQUESTS = "epd_proxy_requests"
PROXY_REQUESTS_RUNNING = "epd_proxy_requests_running"
PROXY_E2E_LATENCY = "epd_proxy_e2e_request_latency_seconds"
PROXY_ENCODE_LATENCY = "epd_proxy_encode_latency_seconds"
PROXY_BACKEND_TTFB = "epd_proxy_backend_time_to_first_byte_seconds"
PROXY_BACKEND_RUNNING = "epd_proxy_backend_requests_running"
PROXY_BACKEND_ERRORS = "epd_proxy_backend_errors"
PROXY_MEDIA_ITEMS = "epd_proxy_media_items"
PROXY_REJECTIONS = "epd_proxy_rejections"
# What the proxy's label values can be (created at zero, so a rate over them exists from the start).
PROXY_MEDIA_OUTCOMES = ("hit", "miss", "refused")
PROXY_REJECTION_REASONS = ("auth", "inflight", "bad_request", "cache_full", "unavailable")

_PULL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# vLLM's buckets: e2e as vllm:e2e_request_latency_seconds, first byte as vllm:time_to_first_token_seconds.
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_FIRST_BYTE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ENCODE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class _ConsistentView:
    """A registry view whose collection excludes concurrent :meth:`EncoderMetrics.set_occupancy`
    calls, so one scrape never shows half of a step's occupancy (the invariant holds on it)."""

    def __init__(self, registry: CollectorRegistry, lock: threading.Lock) -> None:
        self._registry = registry
        self._lock = lock

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = list(self._registry.collect())
        yield from families


class InputProcessorMetrics:
    """Layer 1, present in both processes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.mm_cache_queries = Counter(
            MM_CACHE_QUERIES, "Input-processor cache lookups, hits and misses", registry=registry)
        self.mm_cache_hits = Counter(
            MM_CACHE_HITS, "Input-processor cache hits", registry=registry)


class EncoderMetrics(InputProcessorMetrics):
    """Metrics the encoder process exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._occupancy_lock = threading.Lock()
        super().__init__(self.registry)
        r = self.registry
        self.device_queries = Counter(
            DEVICE_EC_QUERIES, "Items checked against the device encoder cache", registry=r)
        self.device_misses = Counter(
            DEVICE_EC_MISSES, "Items not in the device encoder cache (encoder ran)", registry=r)
        self.device_evictions = Counter(
            DEVICE_EC_EVICTIONS, "Blocks evicted from the device encoder cache", registry=r)
        self.active_blocks = Gauge(
            DEVICE_EC_ACTIVE_BLOCKS, "Blocks allocated to cached items",
            registry=r, multiprocess_mode="sum")
        self.free_blocks = Gauge(
            DEVICE_EC_FREE_BLOCKS, "Blocks allocatable now", registry=r, multiprocess_mode="sum")
        self.held_blocks = Gauge(
            DEVICE_EC_HELD_BLOCKS, "Freed blocks still inside the minimum hold window",
            registry=r, multiprocess_mode="sum")
        self.active_real_tokens = Gauge(
            DEVICE_EC_ACTIVE_REAL_TOKENS, "Real (non-padding) tokens in active blocks",
            registry=r, multiprocess_mode="sum")
        self.requests = Counter(
            EPD_ENCODE_REQUESTS, "EncoderCacheService calls by method and status",
            ["method", "code"], registry=r)
        self.encode_latency = Histogram(
            EPD_ENCODE_LATENCY, "Time of one encoder graph run", registry=r, buckets=_PULL_BUCKETS)
        self.leases_active = Gauge(
            EPD_LEASES_ACTIVE, "Leases currently pinning items", registry=r, multiprocess_mode="sum")
        self.leases_expired = Counter(
            EPD_LEASES_EXPIRED, "Leases that expired without a release", registry=r)
        self.leases_dropped = Counter(
            EPD_LEASES_DROPPED, "Leases of answers that could not reach their caller (deadline passed, "
            "call cancelled, or the caller gave the call up by its call_id), given back at once", registry=r)
        # Load: what an autoscaler scales the encoders on (deploy/components/autoscaling/).
        self.queue_tokens = Gauge(
            EPD_QUEUE_TOKENS, "Merged tokens of cache misses waiting for or in an encoder run",
            registry=r, multiprocess_mode="sum")
        # What the batcher learnt of its runs (encoder_server.batcher.RunCosts): whether a waiting
        # miss joins a run depends on these two.
        self.run_fixed_seconds = Gauge(
            EPD_RUN_FIXED, "A run's fixed cost, fitted to the last encoder runs (0 until runs of two sizes)",
            registry=r, multiprocess_mode="max")
        self.run_seconds_per_token = Gauge(
            EPD_RUN_PER_TOKEN, "A run's cost per merged token, fitted to the last encoder runs (0 until runs "
            "of two sizes)", registry=r, multiprocess_mode="max")
        # Start-up progress: /metrics is up while the bucket graphs are still being built.
        self.warmup_buckets = Gauge(
            EPD_WARMUP_BUCKETS, "Bucket graphs the encoder builds before it is ready",
            registry=r, multiprocess_mode="sum")
        self.warmup_buckets_ready = Gauge(
            EPD_WARMUP_BUCKETS_READY, "Bucket graphs built so far; equal to epd_encoder_warmup_buckets once ready",
            registry=r, multiprocess_mode="sum")

    def set_occupancy(self, active: int, free: int, held: int, active_real_tokens: int) -> None:
        """Snapshot the allocator once per step, after the allocate and evict batches."""
        with self._occupancy_lock:
            self.active_blocks.set(active)
            self.free_blocks.set(free)
            self.held_blocks.set(held)
            self.active_real_tokens.set(active_real_tokens)

    @property
    def scrape_view(self) -> _ConsistentView:
        """What /metrics should serve: the registry, collected consistently."""
        return _ConsistentView(self.registry, self._occupancy_lock)

    def exposition(self) -> bytes:
        return generate_latest(self.scrape_view)


class PrefillMetrics(InputProcessorMetrics):
    """Metrics a prefill worker exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        super().__init__(self.registry)
        r = self.registry
        self.prefix_cache_queries = Counter(
            PREFIX_CACHE_QUERIES, "Prefix-cache block lookups, hits and misses", registry=r)
        self.prefix_cache_hits = Counter(PREFIX_CACHE_HITS, "Prefix-cache block hits", registry=r)
        self.scheduler_queries = Counter(
            SCHEDULER_EC_QUERIES, "Logical encoder-cache checks for image tokens outside a prefix hit",
            registry=r)
        self.scheduler_hits = Counter(
            SCHEDULER_EC_HITS, "Logical encoder-cache hits (item already encoded and reachable)",
            registry=r)
        self.pulls = Counter(EPD_PULLS, "Items pulled from an encoder over NIXL", registry=r)
        self.pull_bytes = Counter(EPD_PULL_BYTES, "Bytes pulled from encoders over NIXL", registry=r)
        self.pulls_prefetched = Counter(
            EPD_PULLS_PREFETCHED, "Items an order found pulled already, on a prefetch hint (vLLM connector)",
            registry=r)
        self.pull_latency = Histogram(
            EPD_PULL_LATENCY, "Time from issuing a block READ to a verified item",
            registry=r, buckets=_PULL_BUCKETS)
        self.load_failures = Counter(
            EPD_LOAD_FAILURES, "ECLoadFailure raised, by reason", ["reason"], registry=r)
        self.handshakes = Counter(
            EPD_HANDSHAKES, "Handshakes with encoders, by result", ["result"], registry=r)
        # Encoder membership (prefill_client.consumer.pool): what the last refresh found.
        self.encoders_known = Gauge(
            EPD_ENCODERS_KNOWN, "Encoders the targets resolve to now", registry=r, multiprocess_mode="sum")
        self.encoders_ready = Gauge(
            EPD_ENCODERS_READY, "Known encoders whose readiness is SERVING (the ones new items go to)",
            registry=r, multiprocess_mode="sum")
        self.membership_refreshes = Counter(
            EPD_MEMBERSHIP_REFRESHES, "Re-resolutions of the encoder targets, by result (changed, unchanged, "
            "failed)", ["result"], registry=r)
        self.routed_away = Counter(
            EPD_ROUTED_AWAY, "Items sent to an encoder other than their first in rendezvous order (it was not "
            "ready, or down)", registry=r)
        self.calls_given_up = Counter(
            EPD_CALLS_GIVEN_UP, "Encode and Lookup calls cancelled in flight because their encoder stopped "
            "answering readiness checks (their items went to the next encoder)", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ProxyFamilies:
    """A collector's families whose names are the proxy's: in multiprocess mode the files of a
    worker also hold its encoder clients' series, which the proxy does not export."""

    def __init__(self, source: MultiProcessCollector) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return [family for family in self._source.collect() if family.name.startswith(PROXY_PREFIX)]


class ProxyMetrics:
    """Metrics ``epd proxy`` exports on its ``/metrics``.

    ``multiprocess_dir``: the ``PROMETHEUS_MULTIPROC_DIR`` of ``--workers N`` (set before
    prometheus_client was imported): each worker's exposition is then the sum over all of them.
    """

    def __init__(self, registry: CollectorRegistry | None = None, multiprocess_dir: str | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        r = self.registry
        self.requests = Counter(
            PROXY_REQUESTS, "Requests answered, by route and HTTP status (probes and scrapes not counted)",
            ["route", "code"], registry=r)
        self.requests_running = Gauge(
            PROXY_REQUESTS_RUNNING, "Requests admitted and not yet answered in full (the --max-inflight count)",
            registry=r, multiprocess_mode="livesum")
        self.e2e_latency = Histogram(
            PROXY_E2E_LATENCY, "Time from a request's admission to the end of its answer, streams included",
            ["route"], registry=r, buckets=_E2E_BUCKETS)
        self.encode_latency = Histogram(
            PROXY_ENCODE_LATENCY, "Time to place a request's media on the encoders (its Encode calls)",
            registry=r, buckets=_ENCODE_BUCKETS)
        self.backend_ttfb = Histogram(
            PROXY_BACKEND_TTFB, "Time from sending a request to a backend until its status and headers arrive",
            ["backend"], registry=r, buckets=_FIRST_BYTE_BUCKETS)
        self.backend_running = Gauge(
            PROXY_BACKEND_RUNNING, "Requests sent to a backend whose answer is not relayed in full yet",
            ["backend"], registry=r, multiprocess_mode="livesum")
        self.backend_errors = Counter(
            PROXY_BACKEND_ERRORS, "Backend failures by kind: connect, timeout, server_error (a 5xx answer), "
            "stream (the answer broke off)", ["backend", "kind"], registry=r)
        self.media_items = Counter(
            PROXY_MEDIA_ITEMS, "Media items by outcome: hit or miss on the encoders, or refused with the request "
            "(a 4xx before they were placed)", ["outcome"], registry=r)
        self.rejections = Counter(
            PROXY_REJECTIONS, "Requests the proxy answered with an error itself, by reason", ["reason"], registry=r)
        for outcome in PROXY_MEDIA_OUTCOMES:
            self.media_items.labels(outcome=outcome)
        for reason in PROXY_REJECTION_REASONS:
            self.rejections.labels(reason=reason)

    def exposition(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ProxyFamilies(MultiProcessCollector(None, path=self.multiprocess_dir)))
        return generate_latest(registry)
