"""Configuration of every process: frozen dataclasses built once at the edge (every process).

The schemas (:mod:`.encoder`, :mod:`.prefill`, :mod:`.proxy`, and :mod:`.cache` and
:mod:`.shared` they nest), their choices (:mod:`.choices`), and the machinery that builds
them from flags, environment variables and mappings (:mod:`.builder`). Everything is
importable from here, and nothing here imports torch: ``epd encoder`` binds its health
port before torch is loaded.
"""

from __future__ import annotations

from common.config.builder import (
    SettingInfo,
    add_arguments,
    build,
    build_from_mapping,
    describe,
    iter_settings,
    markdown_reference,
    read_json_object,
    setting,
)
from common.config.cache import EPD_MIN_HOLD_MS, MONOLITHIC_MIN_HOLD_MS, CacheConfig
from common.config.choices import (
    AttentionKernel,
    CacheDtype,
    CacheMode,
    EncoderBackend,
    FailurePolicy,
    PullSide,
    RoutingPolicy,
    TowerChoice,
    TowerDtype,
    TransportKind,
)
from common.config.encoder import EncoderServerConfig
from common.config.prefill import PrefillConfig
from common.config.proxy import DEFAULT_PROXY_PORT, ProxyConfig
from common.config.shared import (
    DEFAULT_GRPC_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_PREFILL_METRICS_PORT,
    KEEP_FREED_MEMORY_HELP,
    LIVENESS_SERVICE,
    READINESS_SERVICE,
    TlsConfig,
)

__all__ = [
    "DEFAULT_GRPC_PORT",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_PREFILL_METRICS_PORT",
    "DEFAULT_PROXY_PORT",
    "EPD_MIN_HOLD_MS",
    "KEEP_FREED_MEMORY_HELP",
    "LIVENESS_SERVICE",
    "MONOLITHIC_MIN_HOLD_MS",
    "READINESS_SERVICE",
    "AttentionKernel",
    "CacheConfig",
    "CacheDtype",
    "CacheMode",
    "EncoderBackend",
    "EncoderServerConfig",
    "FailurePolicy",
    "PrefillConfig",
    "ProxyConfig",
    "PullSide",
    "RoutingPolicy",
    "SettingInfo",
    "TlsConfig",
    "TowerChoice",
    "TowerDtype",
    "TransportKind",
    "add_arguments",
    "build",
    "build_from_mapping",
    "describe",
    "iter_settings",
    "markdown_reference",
    "read_json_object",
    "setting",
]
