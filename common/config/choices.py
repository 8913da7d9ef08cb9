"""The closed sets of spellings a setting takes, as string enums (every process).

A member compares equal to its spelling, and formats and prints as it (``f"{cfg.tower}"``,
``%s`` in a log line), so the values written to logs, environment variables and the wire
are the plain strings they were. A flag takes exactly the values, an environment variable
any case of them.
"""

from __future__ import annotations

import enum


class Choice(str, enum.Enum):
    """A setting's closed set of spellings; a member prints as its value, not as ``Class.MEMBER``."""

    def __str__(self) -> str:
        return str(self.value)


class CacheMode(Choice):
    EPD = "epd"
    MONOLITHIC = "monolithic"


class TransportKind(Choice):
    AUTO = "auto"  # real NIXL when importable, else the mock agent (with a warning)
    NIXL = "nixl"
    MOCK = "mock"


class FailurePolicy(Choice):
    FAIL = "fail"
    RETRY = "retry"


class PullSide(Choice):
    """Where the vLLM connector pulls: on each worker, into its device's memory, or on the scheduler."""

    WORKER = "worker"
    SCHEDULER = "scheduler"


class CacheDtype(Choice):
    """The cache buffer's dtype: the names in ``common.layout.DTYPES``.

    Spelled here without importing common.layout: it needs torch, which takes seconds to
    import, and `epd encoder` binds its health port before that (a unit test keeps the two equal).
    """

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class TowerChoice(Choice):
    """What computes the encoder's rows; the tower registry (encoder_server.towers) maps each to its tower.

    A tower's value is also its name in the handshake (``HandshakeResponse.tower``).
    """

    AUTO = "auto"  # by the checkpoint's architecture
    QWEN3VL = "qwen3vl"
    VLLM = "vllm"

    @property
    def needs_checkpoint(self) -> bool:
        """It has no random tower to run without ``--weights``: vLLM builds the checkpoint's model."""
        return self is TowerChoice.VLLM


class TowerDtype(Choice):
    AUTO = "auto"  # the tower's own default
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class EncoderBackend(Choice):
    AUTO = "auto"
    EAGER = "eager"
    COMPILE = "compile"
    NEURON = "neuron"


class AttentionKernel(Choice):
    AUTO = "auto"
    NATIVE = "native"
    SDPA = "sdpa"


class RoutingPolicy(Choice):
    """Which backend ``epd proxy`` sends a request to (prefill_client/proxy/routing.py)."""

    AFFINITY = "affinity"  # the conversation's backend while it is within the load bound
    LEAST_OUTSTANDING = "least-outstanding"
    ROUND_ROBIN = "round-robin"
