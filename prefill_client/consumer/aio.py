"""asyncio face of the consumer library (any process that pulls from an event loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from prefill_client.consumer.pull import PulledItem


class AsyncEncoderCacheClient:
    """asyncio face of :class:`EncoderCacheClient`: each call runs in a worker thread."""

    def __init__(self, client: EncoderCacheClient) -> None:
        self.client = client

    async def encode(self, items: Sequence[MediaSpec]) -> list[PulledItem]:
        return await asyncio.to_thread(self.client.encode, items)

    async def lookup(self, mm_hashes: Sequence[str]) -> list[PulledItem | None]:
        return await asyncio.to_thread(self.client.lookup, mm_hashes)

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)
