"""The proxy's encoder clients, one per model id, made on first use and bounded (proxy process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from common.config import ProxyConfig
from common.errors import EpdError
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.proxy.errors import UNAVAILABLE, HttpError

logger = logging.getLogger(__name__)

MAX_MODELS = 4  # encoder clients (model ids) at once without --model-id


@dataclass
class _Entry:
    """A model id's client, the requests using it, and whether it was dropped (closed when unused)."""

    client: EncoderCacheClient
    users: int = 0
    dropped: bool = False


class Clients:
    """The proxy's encoder clients, one per model id: ``fixed`` (``--model-id``) for every model,
    else one made by ``make`` on a model's first use, at most ``limit`` at once. A client the
    encoders refused in the handshake is dropped, so names nobody serves keep no place."""

    def __init__(self, make: Callable[[str], EncoderCacheClient], fixed: EncoderCacheClient | None,
                 limit: int = MAX_MODELS) -> None:
        self._make, self._limit = make, limit
        self._fixed = _Entry(fixed) if fixed is not None else None
        self._entries: dict[str, _Entry] = {}
        self._creating = asyncio.Lock()

    @property
    def fixed_model(self) -> str | None:
        """The model id of the fixed client, if there is one."""
        return self._fixed.client.model_id if self._fixed is not None else None

    @property
    def models(self) -> list[str]:
        """The model ids with a client now."""
        return [self._fixed.client.model_id] if self._fixed is not None else list(self._entries)

    @property
    def targets(self) -> tuple[str, ...] | None:
        """The encoders a client knows now; None before the first client."""
        entries = [self._fixed] if self._fixed is not None else list(self._entries.values())
        return entries[0].client.targets if entries else None

    @contextlib.asynccontextmanager
    async def use(self, model: str) -> AsyncIterator[EncoderCacheClient]:
        """The client for ``model`` while the block runs (a client dropped meanwhile closes after it)."""
        entry = self._fixed or await self._get(model)
        entry.users += 1
        try:
            yield entry.client
        finally:
            entry.users -= 1
            if entry.dropped and entry.users == 0:
                await asyncio.to_thread(entry.client.close)

    async def _get(self, model: str) -> _Entry:
        entry = self._entries.get(model)
        if entry is not None:  # not behind the lock: a client being made must not hold up the others
            return entry
        async with self._creating:  # one client per model, even for requests that arrive together
            entry = self._entries.get(model)
            if entry is not None:
                return entry
            if len(self._entries) >= self._limit:
                raise HttpError(400, f"model {model!r}: epd proxy already has encoder clients for {self._limit} "
                                     f"models ({', '.join(map(repr, self._entries))}), its most; start it with "
                                     f"--model-id to serve one model id")
            try:
                client = await asyncio.to_thread(self._make, model)
            except EpdError as exc:  # ConfigError: a target that does not resolve
                raise HttpError(503, f"cannot reach the encoders: {exc}", kind=UNAVAILABLE) from exc
            entry = self._entries[model] = _Entry(client)
            logger.info("encoder client for model %r (%d of at most %d)", model, len(self._entries), self._limit)
            return entry

    def drop(self, model: str) -> None:
        """Forget ``model``'s client (not the fixed one): the next request makes a new one."""
        entry = self._entries.pop(model, None)
        if entry is not None:
            entry.dropped = True

    async def close(self) -> None:
        """Close the clients made here (the fixed one is its owner's)."""
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            await asyncio.to_thread(entry.client.close)


def new_client(cfg: ProxyConfig, model_id: str) -> EncoderCacheClient:
    """The proxy's client for one model id (no pulls: placements only)."""
    return EncoderCacheClient(
        cfg.encoders, model_id, transport_kind=cfg.transport, rpc_timeout_s=cfg.rpc_timeout_s,
        encode_timeout_s=cfg.encode_timeout_s,
        landing_blocks=1, local_cache_blocks=0, tls=cfg.tls, weights_digest=cfg.weights_digest,
        membership_refresh_s=cfg.membership_refresh_s, lookup_min_bytes=cfg.lookup_min_bytes)
