"""``EpdCacheConnector``: vLLM's encoder-cache (EC) connector, consumer role, over epd-cache.

Loaded by vLLM (0.32 / 0.33) with::

    --ec-transfer-config '{"ec_connector": "EpdCacheConnector", "ec_role": "ec_consumer",
        "ec_connector_module_path": "prefill_client.vllm.connector",
        "ec_connector_extra_config": {"encoders": "HOST:PORT", "model_id": "..."}}'

``ec_connector_extra_config`` takes every setting of :class:`~common.config.PrefillConfig` by
field or flag name (``rpc_timeout_s``, ``pull_timeout_s``, ``tls_ca``, ``auth_token``,
``failure_policy``, ``weights_digest``, ``metrics_port``, ...).

Where the pull happens (``pull_on``, default ``worker``). vLLM asks the scheduler side whether
an item "is available" (``has_cache_item``) and, in the same step, has the worker copy it into
``encoder_cache`` and gather it: a worker that finds nothing then raises ``Encoder cache miss``
and the engine dies. So "available" must mean "in hand" on every rank that gathers.

- ``worker`` (:mod:`prefill_client.vllm.worker_pulls`): ``ensure_cache_available`` defers a
  request and orders its items' pull from every tensor-parallel rank over the connector's side
  channel (the proxy's leased locations from the request's ``ec_transfer_params``, or a
  ``Lookup`` of each ``mm_hash``). Each rank pulls, verified, into a landing pool registered
  with NIXL on its own device and reports; the item is available once every rank reported it.
  The step's metadata carries only the ids to place and drop.
- ``scheduler``: the scheduler pulls into host memory in two background threads and ships the
  verified rows to every worker inside the step's metadata.

Either way a pull that fails for any reason (``ECLoadFailure``: evicted, tag or generation
mismatch, timeout, encoder down, handshake; rows of the wrong shape) on any rank puts the
request in ``take_unavailable_requests``: vLLM fails that request alone and the engine goes on.
Leases are given back once, in the name of whoever took them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from common.config import PrefillConfig, PullSide, build_from_mapping
from common.errors import ConfigError, ECLoadFailure, EpdError, LoadFailureReason
from common.metrics import PrefillMetrics
from common.vllm_rows import row_width as model_row_width
from prefill_client.vllm import channel
from prefill_client.vllm.items import Wanted, shape_problem, wanted_items, worker_device
from prefill_client.handoff import from_params
from prefill_client.vllm.worker_pulls import WorkerLoader, WorkerPulls

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from prefill_client.consumer.client import EncoderCacheClient
    from prefill_client.handoff import Placement

logger = logging.getLogger(__name__)

PULL_THREADS = 2


@dataclass
class EpdCacheConnectorMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is not type-checked here
    """Scheduler -> workers, per step. Worker path: the ids of the items to put into
    ``encoder_cache`` from the rows each rank holds (``place``) and of rows nobody needs any
    more (``drop``: identifier and the pull that landed them). Scheduler path: the verified rows
    themselves (``rows``)."""

    place: list[str] = field(default_factory=list)
    drop: list[tuple[str, str]] = field(default_factory=list)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)


def connector_config(vllm_config: VllmConfig) -> PrefillConfig:
    """Our client settings: ``ec_connector_extra_config``, else the ``EPD_*`` environment variables
    ``epd prefill`` reads, else the defaults (``model_id``: the served model name)."""
    transfer = vllm_config.ec_transfer_config
    extra: Mapping[str, Any] = (transfer.ec_connector_extra_config or {}) if transfer is not None else {}
    environ = dict(os.environ)
    if "model_id" not in extra and "EPD_MODEL_ID" not in environ:
        extra = {**extra, "model_id": vllm_config.model_config.served_model_name or vllm_config.model_config.model}
    return build_from_mapping(  # type: ignore[no-any-return]
        PrefillConfig, extra, "ec_connector_extra_config", environ)


def row_width(vllm_config: VllmConfig) -> int:
    """Width of one encoder row the model vLLM loaded expects (:func:`common.vllm_rows.row_width`)."""
    return model_row_width(vllm_config.model_config)


def _start_metrics(cfg: PrefillConfig, metrics: PrefillMetrics) -> Any:
    """The scheduler side's /metrics endpoint (``metrics_port``; -1: none)."""
    if cfg.metrics_port < 0:
        return None
    from prometheus_client import start_http_server

    httpd, _ = start_http_server(cfg.metrics_port, addr=cfg.metrics_host, registry=metrics.registry)
    logger.info("EpdCacheConnector /metrics on %s:%d", cfg.metrics_host, httpd.server_port)
    return httpd


class EpdCacheConnector(ECConnectorBase):  # type: ignore[misc]
    """vLLM EC connector, consumer: encoder outputs come from epd-cache encoders over NIXL, verified."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if not self.is_consumer or self.is_producer:
            raise ConfigError(f"EpdCacheConnector is a consumer: ec_role must be ec_consumer, "
                              f"got {vllm_config.ec_transfer_config.ec_role!r}")
        dtype = vllm_config.model_config.dtype  # resolved to a torch.dtype once the config is built
        self._dtype: torch.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        self._cfg = connector_config(vllm_config)
        self._width = row_width(vllm_config)
        self._channel_address = channel.address(vllm_config)
        self._scheduler: _SchedulerPulls | WorkerPulls | None = None
        self._loader: WorkerLoader | None = None
        self._httpd: Any = None
        if role == ECConnectorRole.SCHEDULER:
            metrics = PrefillMetrics()
            if self._cfg.pull_on is PullSide.WORKER:
                self._scheduler = self._start_tracking(vllm_config, metrics)
            else:
                self._scheduler = _SchedulerPulls.start(self._cfg, self._width, metrics)
            self._httpd = _start_metrics(self._cfg, metrics)
            logger.info("EpdCacheConnector: consumer of encoders %s (model_id %s), pulls on the %s",
                        ",".join(self._cfg.encoders), self._cfg.model_id, self._cfg.pull_on.value)

    def _start_tracking(self, vllm_config: VllmConfig, metrics: PrefillMetrics) -> WorkerPulls:
        from prefill_client.consumer.client import EncoderCacheClient

        # This client pulls nothing (the workers do): it looks items up and gives leases back.
        client = EncoderCacheClient.from_config(
            dataclasses.replace(self._cfg, landing_blocks=1, local_cache_blocks=1), metrics)
        ranks = vllm_config.parallel_config.tensor_parallel_size
        return WorkerPulls(client, channel.SchedulerChannel(self._channel_address, ranks), self._cfg.landing_blocks)

    # --- worker side -------------------------------------------------------------------------

    def start_worker_services(self) -> None:
        """Worker path: this rank's landing pool, client and channel, once the model is resident."""
        if self._cfg.pull_on is not PullSide.WORKER or self._loader is not None:
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        if not get_pp_group().is_first_rank:
            return  # only the first pipeline stage gathers encoder outputs
        self._loader = WorkerLoader.start(self._cfg, self._width, self._dtype, self._channel_address,
                                          get_tensor_model_parallel_rank())

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Put this step's items into ``encoder_cache`` on this worker's device."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EpdCacheConnectorMetadata)
        if self._loader is not None:
            self._loader.place(metadata.place, encoder_cache)
            self._loader.drop(metadata.drop)
        if metadata.rows:
            device = worker_device()
            for identifier, rows in metadata.rows.items():
                if identifier not in encoder_cache:
                    encoder_cache[identifier] = rows.to(device=device, dtype=self._dtype)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Nothing: this connector only consumes (the encoder owns the cache)."""
        return

    # --- scheduler side ----------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        return self._side().has(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self._side().ensure(request, num_computed_tokens)

    def take_unavailable_requests(self) -> set[str]:
        return self._side().take_unavailable()

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._side().allocated(request.mm_features[index].identifier)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EpdCacheConnectorMetadata:
        side = self._side()
        if isinstance(side, WorkerPulls):
            orders = side.take_orders()
            return EpdCacheConnectorMetadata(place=orders.place, drop=orders.drop)
        return EpdCacheConnectorMetadata(rows=side.take_to_load())

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._side().finished(request)
        return False, None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._loader is not None:
            self._loader.close()
        if self._httpd is not None:
            self._httpd.shutdown()

    def _side(self) -> _SchedulerPulls | WorkerPulls:
        assert self._scheduler is not None, "a scheduler-side call on a worker-side connector"
        return self._scheduler

    @property
    def client(self) -> EncoderCacheClient:
        return self._side().client


class _SchedulerPulls:
    """The scheduler path: pulls in the background; says "available" only for rows in hand."""

    @classmethod
    def start(cls, cfg: PrefillConfig, width: int | None, metrics: PrefillMetrics) -> _SchedulerPulls:
        from prefill_client.consumer.client import EncoderCacheClient

        return cls(EncoderCacheClient.from_config(cfg, metrics, probe_connections=True), width)

    def __init__(self, client: EncoderCacheClient, width: int | None) -> None:
        self.client = client
        self.metrics = client.metrics
        self.width = width
        self._threads = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="epd-pull")
        self._jobs: dict[str, tuple[concurrent.futures.Future[dict[str, torch.Tensor]], list[Placement]]] = {}
        self._rows: dict[str, torch.Tensor] = {}  # identifier -> verified rows, while a request needs them
        self._users: defaultdict[str, set[str]] = defaultdict(set)  # identifier -> request ids
        self._unavailable: dict[str, str] = {}  # request id -> why
        self._reported: set[str] = set()
        self._to_load: dict[str, torch.Tensor] = {}

    def has(self, identifier: str) -> bool:
        return identifier in self._rows

    def ensure(self, request: Request, num_computed_tokens: int) -> bool:
        rid = request.request_id
        if rid in self._unavailable or rid in self._reported:
            return False
        wanted = wanted_items(request, num_computed_tokens)
        for w in wanted:
            self._users[w.identifier].add(rid)
        missing = [w for w in wanted if w.identifier not in self._rows]
        if not missing:
            return True
        job = self._jobs.get(rid)
        if job is None:
            try:
                placed = from_params(getattr(request, "ec_transfer_params", None))
            except ConfigError as exc:
                self._fail(rid, f"bad ec_transfer_params: {exc}")
                return False
            mine = [placed[w.identifier] for w in missing if w.identifier in placed]
            self._jobs[rid] = (self._threads.submit(self._pull, missing, placed), mine)
            return False
        if not job[0].done():
            return False
        del self._jobs[rid]
        try:
            rows = job[0].result()
        except ECLoadFailure as exc:
            self._fail(rid, str(exc))
            return False
        except EpdError as exc:  # typed: a config or transport problem of this request
            self.metrics.load_failures.labels(reason=LoadFailureReason.HANDSHAKE.value).inc()
            self._fail(rid, f"{type(exc).__name__}: {exc}")
            return False
        except Exception as exc:  # never the engine's problem: fail the request, say what happened
            logger.exception("EpdCacheConnector: pull for request %s failed unexpectedly", rid)
            self._fail(rid, f"{type(exc).__name__}: {exc}")
            return False
        for w in missing:
            got = rows.get(w.identifier)
            problem = f"item {w.identifier} was not delivered" if got is None else shape_problem(w.identifier, got, w.num_embeds, self.width)
            if problem is not None:
                self.metrics.load_failures.labels(reason=LoadFailureReason.TOKEN_COUNT.value).inc()
                self._fail(rid, problem)
                return False
        self._rows.update(rows)
        return all(w.identifier in self._rows for w in wanted)

    def _pull(self, missing: Sequence[Wanted], placed: Mapping[str, Placement]) -> dict[str, torch.Tensor]:
        """Worker thread: one verified pull for the request's missing items (bounded by the client's deadlines)."""
        with_location = [placed[w.identifier] for w in missing if w.identifier in placed]
        by_lookup = [w.identifier for w in missing if w.identifier not in placed]
        out: dict[str, torch.Tensor] = {}
        if with_location:
            for item in self.client.pull_placed(with_location):
                out[item.mm_hash] = item.embeddings
        if by_lookup:
            for ident, looked_up in zip(by_lookup, self.client.lookup(by_lookup, require=True)):
                assert looked_up is not None  # require=True raises instead
                out[ident] = looked_up.embeddings
        return out

    def _fail(self, rid: str, why: str) -> None:
        logger.warning("EpdCacheConnector: request %s fails: %s", rid, why)
        self._unavailable[rid] = why

    def take_unavailable(self) -> set[str]:
        out = set(self._unavailable)
        self._reported |= out
        self._unavailable.clear()
        return out

    def allocated(self, identifier: str) -> None:
        rows = self._rows.get(identifier)
        if rows is not None:
            self._to_load[identifier] = rows

    def take_to_load(self) -> dict[str, torch.Tensor]:
        out, self._to_load = self._to_load, {}
        return out

    def finished(self, request: Request) -> None:
        rid = request.request_id
        job = self._jobs.pop(rid, None)
        if job is not None and job[0].cancel():  # never started: its leases are still out
            self.client.release_placed(job[1])
        # (one already running ends within the client's deadlines and gives its leases back)
        self._unavailable.pop(rid, None)
        self._reported.discard(rid)
        for feature in request.mm_features:
            users = self._users.get(feature.identifier)
            if users is None:
                continue
            users.discard(rid)
            if not users:
                del self._users[feature.identifier]
                self._rows.pop(feature.identifier, None)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.client.close()
