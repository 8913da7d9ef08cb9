"""``EpdCacheConnector``: vLLM's encoder-cache (EC) connector, consumer role, over epd-cache
(vLLM scheduler process and every vLLM worker process: vLLM builds one in each, by role).

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

This module only translates vLLM's hooks and picks the strategy's pair (:data:`PAIRS`), the way
vLLM's NIXL connector picks its pull or push pair; the scheduler halves are in
:mod:`.scheduler` (both extend :class:`~.tracker.PullTracker`), the worker halves in :mod:`.worker`.

- ``worker``: ``ensure_cache_available`` defers a request and orders its items' pull from every
  tensor-parallel rank over the connector's side channel (the proxy's leased locations from the
  request's ``ec_transfer_params``, or a ``Lookup`` of each ``mm_hash``). Each rank pulls,
  verified, into a landing pool registered with NIXL on its own device and reports; the item is
  available once every rank reported it. The step's metadata carries only the ids to place and drop.
- ``scheduler``: the scheduler pulls into host memory in two background threads and ships the
  verified rows to every worker inside the step's metadata.

Either way a pull that fails for any reason (``ECLoadFailure``: evicted, tag or generation
mismatch, timeout, encoder down, handshake; rows of the wrong shape) on any rank puts the
request in ``take_unavailable_requests``: vLLM fails that request alone and the engine goes on.
Leases are given back once, in the name of whoever took them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from common.config import PrefillConfig, PullSide, build_from_mapping
from common.errors import ConfigError
from common.malloc import keep_freed_memory
from common.metrics import PrefillMetrics
from common.vllm_rows import row_width as model_row_width
from prefill_client.vllm import channel
from prefill_client.vllm.items import EngineFacts, StepOrders
from prefill_client.vllm.scheduler import SchedulerPulls, WorkerPulls
from prefill_client.vllm.tracker import PullTracker
from prefill_client.vllm.worker import ShippedRows, WorkerHalf, WorkerLoader

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from prefill_client.consumer.client import EncoderCacheClient

logger = logging.getLogger(__name__)


@dataclass
class EpdCacheConnectorMetadata(StepOrders, ECConnectorMetadata):  # type: ignore[misc]  # vLLM is not type-checked here
    """Scheduler -> workers, per step: the step's orders (:class:`~.items.StepOrders`: ids to
    ``place`` and to ``drop`` on the worker path, the verified ``rows`` on the scheduler path)."""


@dataclass(frozen=True, slots=True)
class Pair:
    """One pull strategy: what vLLM's scheduler runs of it, and what each worker runs."""

    scheduler: Callable[[PrefillConfig, EngineFacts, PrefillMetrics], PullTracker[Any]]
    worker: Callable[[PrefillConfig, EngineFacts, int], WorkerHalf]


PAIRS: Mapping[PullSide, Pair] = {
    PullSide.WORKER: Pair(WorkerPulls.start, WorkerLoader.start),
    PullSide.SCHEDULER: Pair(SchedulerPulls.start, ShippedRows.start),
}


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


def engine_facts(vllm_config: VllmConfig) -> EngineFacts:
    """What the connector's halves need to know about the engine, from its config."""
    dtype = vllm_config.model_config.dtype  # resolved to a torch.dtype once the config is built
    return EngineFacts(width=row_width(vllm_config),
                       dtype=dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype)),
                       channel=channel.address(vllm_config),
                       ranks=vllm_config.parallel_config.tensor_parallel_size)


def _keep_freed_memory(cfg: PrefillConfig) -> None:
    """``keep_freed_memory`` in a vLLM process that receives rows: each pulled item is a fresh
    tensor (2 MiB for a 224 px Qwen3-VL image in float32), which glibc otherwise maps anew, and
    every page of it faults: 512 faults, 1.5-12 ms of a worker's pull on 2 cores against 0.4 ms
    for the READ itself (:mod:`common.malloc`)."""
    if cfg.keep_freed_memory:
        keep_freed_memory()


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
        self._cfg = connector_config(vllm_config)
        self._engine = engine_facts(vllm_config)
        self._pair = PAIRS[self._cfg.pull_on]
        self._scheduler: PullTracker[Any] | None = None
        self._worker: WorkerHalf | None = None
        self._httpd: Any = None
        if role == ECConnectorRole.SCHEDULER:
            if self._cfg.pull_on is PullSide.SCHEDULER:  # this process pulls the rows
                _keep_freed_memory(self._cfg)
            metrics = PrefillMetrics()
            self._scheduler = self._pair.scheduler(self._cfg, self._engine, metrics)
            self._httpd = _start_metrics(self._cfg, metrics)
            logger.info("EpdCacheConnector: consumer of encoders %s (model_id %s), pulls on the %s",
                        ",".join(self._cfg.encoders), self._cfg.model_id, self._cfg.pull_on.value)

    # --- worker side -------------------------------------------------------------------------

    def start_worker_services(self) -> None:
        """This worker's half of the strategy (worker path: its landing pool, client and channel),
        once the model is resident."""
        if self._worker is not None:
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        if not get_pp_group().is_first_rank:
            return  # only the first pipeline stage gathers encoder outputs (and loads caches)
        _keep_freed_memory(self._cfg)  # this process receives rows: pulled, or in the step's metadata
        self._worker = self._pair.worker(self._cfg, self._engine, get_tensor_model_parallel_rank())

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Put this step's items into ``encoder_cache`` on this worker's device."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EpdCacheConnectorMetadata)
        if self._worker is not None:
            self._worker.load(metadata, encoder_cache)

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
        step = self._side().take_step(scheduler_output.num_scheduled_tokens)
        return EpdCacheConnectorMetadata(place=step.place, drop=step.drop, rows=step.rows)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._side().finished(request)
        return False, None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
        if self._httpd is not None:
            self._httpd.shutdown()

    def _side(self) -> PullTracker[Any]:
        assert self._scheduler is not None, "a scheduler-side call on a worker-side connector"
        return self._scheduler

    @property
    def client(self) -> EncoderCacheClient:
        return self._side().client
