"""The consumer library: handshake, locate, pull and verify encoder rows (any process that pulls or places).

Runs in every process that talks to encoders: ``epd proxy`` (it places items), vLLM's scheduler
and workers (the connector pulls), and the reference prefill worker. Read :mod:`.client` first.
"""

from prefill_client.consumer.aio import AsyncEncoderCacheClient
from prefill_client.consumer.client import EncoderCacheClient, PulledItem
from prefill_client.consumer.connection import EncoderConnection, MediaSpec

__all__ = ["AsyncEncoderCacheClient", "EncoderCacheClient", "EncoderConnection", "MediaSpec", "PulledItem"]
