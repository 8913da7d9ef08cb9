"""Configuration for both processes: frozen dataclasses built once at the edge.

Each field is declared with :func:`setting`, which records its CLI flag, its
environment variable and its help text. :func:`add_arguments` turns a config
class into argparse flags, :func:`build` resolves a value per field with the
precedence *CLI flag > environment variable > default*, and
:func:`describe` lists every flag and variable (the README's configuration
reference is checked against it). Nothing below the CLI reads ``os.environ``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError

if typing.TYPE_CHECKING:
    from common.layout import CacheLayout

DEFAULT_GRPC_PORT = 50051
DEFAULT_METRICS_PORT = 9400
DEFAULT_PREFILL_METRICS_PORT = 9401

# grpc.health.v1 service names the encoder registers besides the overall ""
# status. Kubernetes probes name them; the deploy test imports these.
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"

# Hold before a freed block may be reused: none when encoder and prefill share
# a process, 100 ms in EPD mode so a remote reader can finish its pull.
MONOLITHIC_MIN_HOLD_MS = 0
EPD_MIN_HOLD_MS = 100

# The names in common.layout.DTYPES. Checked here without importing common.layout: it
# needs torch, which takes seconds to import, and `epd encoder` binds its health port
# before that (a unit test keeps the two lists equal).
CACHE_DTYPES = ("bfloat16", "float16", "float32")


class CacheMode(str, enum.Enum):
    EPD = "epd"
    MONOLITHIC = "monolithic"


class TransportKind(str, enum.Enum):
    AUTO = "auto"  # real NIXL when importable, else the mock agent (with a warning)
    NIXL = "nixl"
    MOCK = "mock"


class FailurePolicy(str, enum.Enum):
    FAIL = "fail"
    RETRY = "retry"


class PullSide(str, enum.Enum):
    """Where the vLLM connector pulls: on each worker, into its device's memory, or on the scheduler."""

    WORKER = "worker"
    SCHEDULER = "scheduler"


def setting(default: Any, *, env: str, help: str, flag: str | None = None) -> Any:
    """Declare a config field with its environment variable and help text."""
    return field(default=default, metadata={"env": env, "help": help, "flag": flag})


@dataclass(frozen=True)
class CacheConfig:
    """Encoder cache sizing and hold policy (``encoder_cache_*`` in the reference)."""

    mode: CacheMode = setting(
        CacheMode.EPD, env="EPD_CACHE_MODE", flag="--cache-mode",
        help="epd (remote readers, 100 ms default hold) or monolithic (0 ms hold)")
    block_size: int | None = setting(
        None, env="EPD_BLOCK_SIZE",
        help="cache rows (merged tokens) per block; default from the row width: the largest power of two in "
             "16..64 whose block is at most 1 MiB, else 16 (64 for the tiny model; padding at most 8 %, "
             "bench/layout.py)")
    num_blocks: int | None = setting(
        None, env="EPD_CACHE_BLOCKS", flag="--cache-blocks",
        help="encoder_cache_num_blocks: total blocks including the scratch block; "
             "overrides --cache-bytes and --cache-tokens")
    cache_bytes: int | None = setting(
        None, env="EPD_CACHE_BYTES",
        help="size the buffer to at most this many bytes (scratch block included)")
    cache_tokens: int = setting(
        16384, env="EPD_CACHE_TOKENS",
        help="encoder_cache_size in tokens when no block count or byte size is given; "
             "blocks = ceil(tokens / block_size) + 1")
    min_hold_ms: int | None = setting(
        None, env="EPD_MIN_HOLD_MS",
        help="encoder_cache_min_hold_time_ms; default 100 in epd mode, 0 in monolithic")
    lease_ttl_ms: int = setting(
        30000, env="EPD_LEASE_TTL_MS",
        help="a lease not released within this time expires and unpins its item")
    dtype: str = setting(
        "bfloat16", env="EPD_CACHE_DTYPE", flag="--cache-dtype", help="cache buffer dtype: bfloat16, float16, float32")

    def __post_init__(self) -> None:
        for name in ("cache_tokens", "lease_ttl_ms"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        if self.block_size is not None:
            _require(self.block_size > 0, "block_size", self.block_size, "must be > 0")
        if self.num_blocks is not None:
            _require(self.num_blocks >= 2, "num_blocks", self.num_blocks, "must be >= 2")
        if self.cache_bytes is not None:
            _require(self.cache_bytes > 0, "cache_bytes", self.cache_bytes, "must be > 0")
        if self.min_hold_ms is not None:
            _require(self.min_hold_ms >= 0, "min_hold_ms", self.min_hold_ms, "must be >= 0")
        if self.dtype not in CACHE_DTYPES:
            raise ConfigError(f"unsupported cache dtype {self.dtype!r}; expected one of {sorted(CACHE_DTYPES)}")

    @property
    def effective_min_hold_ms(self) -> int:
        if self.min_hold_ms is not None:
            return self.min_hold_ms
        return EPD_MIN_HOLD_MS if self.mode is CacheMode.EPD else MONOLITHIC_MIN_HOLD_MS

    def layout(self, out_hidden_size: int, num_deepstack_levels: int) -> CacheLayout:
        """The buffer layout for an encoder with the given output width.

        An unset ``block_size`` is resolved here, from the row width, because only the encoder's model
        knows it; everything downstream (block count, buffer, handshake) reads the layout's value.
        """
        from common.layout import CacheLayout, auto_block_size, auto_num_blocks, compute_fat_dim, parse_dtype

        dtype = parse_dtype(self.dtype)
        block_size = self.block_size
        if block_size is None:
            block_size = auto_block_size(compute_fat_dim(out_hidden_size, num_deepstack_levels) * dtype.itemsize)
        probe = CacheLayout(2, block_size, out_hidden_size, num_deepstack_levels, dtype)
        if self.num_blocks is not None:
            num_blocks = self.num_blocks
        elif self.cache_bytes is not None:
            num_blocks = self.cache_bytes // probe.bytes_per_block
            _require(num_blocks >= 2, "cache_bytes", self.cache_bytes,
                     f"holds fewer than 2 blocks of {probe.bytes_per_block} bytes")
        else:
            num_blocks = auto_num_blocks(self.cache_tokens, block_size)
        return dataclasses.replace(probe, num_blocks=num_blocks)


@dataclass(frozen=True)
class TlsConfig:
    """TLS for the gRPC port; health stays reachable for probes either way."""

    cert: str | None = setting(None, env="EPD_TLS_CERT", flag="--tls-cert", help="PEM certificate chain; enables TLS")
    key: str | None = setting(None, env="EPD_TLS_KEY", flag="--tls-key", help="PEM private key for --tls-cert")
    ca: str | None = setting(
        None, env="EPD_TLS_CA", flag="--tls-ca",
        help="PEM CA bundle: on the server, require client certificates signed by it (mTLS); "
             "on the client, trust this CA")
    auth_token: str | None = setting(
        None, env="EPD_AUTH_TOKEN",
        help="bearer token required on every EncoderCacheService call (health excepted)")

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError(f"--tls-cert and --tls-key go together, got cert={self.cert!r} key={self.key!r}")


KEEP_FREED_MEMORY_HELP = (
    "keep freed memory for reuse (glibc mallopt: buffers up to 64 MiB from the heap, up to 256 MiB of freed "
    "memory kept): requests of tens of MB otherwise page-fault fresh memory each time (common/malloc.py; "
    "true/false)")


@dataclass(frozen=True)
class EncoderServerConfig:
    """Everything ``epd encoder`` needs."""

    model_id: str = setting(
        "tiny-qwen3-vl", env="EPD_MODEL_ID",
        help="model identity; consumers must handshake with exactly this id")
    host: str = setting("127.0.0.1", env="EPD_HOST", help="gRPC listen address")
    port: int = setting(DEFAULT_GRPC_PORT, env="EPD_PORT", help="gRPC port (0 picks a free one)")
    metrics_port: int = setting(
        DEFAULT_METRICS_PORT, env="EPD_METRICS_PORT",
        help="HTTP port for /metrics (0 picks a free one, -1 disables)")
    health_port: int = setting(
        -1, env="EPD_HEALTH_PORT",
        help="extra plaintext port serving only grpc.health.v1, for probes that cannot do TLS "
             "(Kubernetes gRPC probes); -1: none, health is on the gRPC port")
    transport: TransportKind = setting(
        TransportKind.AUTO, env="EPD_TRANSPORT", help="nixl, mock, or auto (nixl when installed)")
    weights: str | None = setting(
        None, env="EPD_WEIGHTS",
        help="Hugging Face checkpoint directory of the served model: Qwen3-VL (model_type qwen3_vl or "
             "qwen3_vl_moe) for epd-cache's own tower, any vision-language model vLLM serves for --tower vllm; "
             "random tiny Qwen3-VL encoder when unset")
    tower: str = setting(
        "auto", env="EPD_TOWER",
        help="what computes the rows: qwen3vl (epd-cache's own Qwen3-VL tower, the fast CPU and Neuron path), "
             "vllm (the checkpoint's own multimodal encoder and processor, loaded through vLLM without its "
             "language model: every VLM vLLM serves), or auto (qwen3vl for Qwen3-VL checkpoints and no "
             "--weights, vllm for any other architecture vLLM knows; another checkpoint is refused at start, "
             "naming its architecture)")
    tower_dtype: str = setting(
        "auto", env="EPD_TOWER_DTYPE",
        help="dtype the tower computes in: float32, bfloat16, float16, or auto (for epd-cache's Qwen3-VL "
             "tower the dtype the checkpoint declares, read as vLLM reads it: config.json's dtype, its "
             "text_config's, its vision_config's, else the vision tensors' stored dtype; float32 without "
             "--weights; for the vLLM tower the cache's dtype). bfloat16 runs the matmuls on a CPU's AMX or "
             "AVX-512 BF16 units, several times faster than float32 (BENCHMARKS.md); rows computed in another "
             "dtype get other mm_hashes, so encoders of a pool must agree")
    device: str = setting("cpu", env="EPD_DEVICE", help="torch device for the encoder and the cache")
    encoder_backend: str = setting(
        "auto", env="EPD_ENCODER_BACKEND",
        help="encoder graph backend: eager, compile (torch.compile, every bucket compiled at start-up), "
             "neuron, or auto (compile, measured faster than eager on CPU)")
    keep_freed_memory: bool = setting(
        True, env="EPD_KEEP_FREED_MEMORY",
        help=KEEP_FREED_MEMORY_HELP)
    encoder_id: str | None = setting(
        None, env="EPD_ENCODER_ID",
        help="this encoder's name in the handshake, the key consumers rank encoders by for an item: it must "
             "survive restarts and differ between encoders. Unset: HOSTNAME:PORT (the pod name and port in a "
             "StatefulSet)")
    attention_kernel: str = setting(
        "auto", env="EPD_ATTENTION_KERNEL",
        help="attention of the encoder tower: auto (the native CPU kernel on x86-64 CPUs with AVX2 and FMA or "
             "AVX-512, in float32, built once and cached, torch SDPA elsewhere or when it cannot be built), "
             "native (that kernel or fail at start-up), sdpa (torch SDPA always, and torch's GELU)")
    encoder_buckets: tuple[int, ...] | None = setting(
        None, env="EPD_ENCODER_BUCKETS",
        help="sizes in merged tokens of the encoder graphs, comma separated; each is built before the "
             "encoder is ready, so fewer buckets start faster. A compiled graph takes any launch above the "
             "next smaller size up to its own (padded to a multiple of 8 tokens); neuron pads every launch "
             "to its bucket, so there more buckets pad less. Unset: the built-in set (DEFAULT_BUCKETS in "
             "encoder_server/vision/runner.py)")
    compile_cache_dir: str | None = setting(
        None, env="EPD_COMPILE_CACHE_DIR",
        help="directory for compiled encoder graphs (TorchInductor FX-graph and AOTAutograd caches, Triton "
             "kernels under triton/), created if missing; a restart with the same directory skips most of "
             "the compile. Unset: torch's default under the temp directory")
    encode_batch_tokens: int = setting(
        256, env="EPD_ENCODE_BATCH_TOKENS",
        help="most merged tokens of concurrent misses packed into one encoder run (an item larger "
             "than this runs alone); on CPU runs of 64-256 tokens were measured fastest (BENCHMARKS.md)")
    max_items_per_request: int = setting(
        64, env="EPD_MAX_ITEMS", flag="--max-items", help="media items accepted in one request")
    max_message_bytes: int = setting(
        64 << 20, env="EPD_MAX_MESSAGE_BYTES", help="largest gRPC message accepted")
    max_image_pixels: int = setting(
        16_777_216, env="EPD_MAX_IMAGE_PIXELS", help="largest decoded image (width x height)")
    max_video_frames: int = setting(
        64, env="EPD_MAX_VIDEO_FRAMES", help="most frames accepted for one video item")
    input_cache_bytes: int = setting(
        256 << 20, env="EPD_INPUT_CACHE_BYTES",
        help="layer-1 cache of preprocessed pixel tensors, in bytes (0 disables)")
    encode_workers: int = setting(
        2, env="EPD_ENCODE_WORKERS", help="threads that decode and preprocess media")
    drain_grace_s: float = setting(
        20.0, env="EPD_DRAIN_GRACE_S",
        help="on SIGTERM, how long to wait for in-flight requests and leases before exiting")
    cache: CacheConfig = field(default_factory=CacheConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        _require(bool(self.model_id), "model_id", self.model_id, "must be non-empty")
        _require(0 <= self.port < 65536, "port", self.port, "must be in 0..65535")
        _require(-1 <= self.metrics_port < 65536, "metrics_port", self.metrics_port, "must be in -1..65535")
        _require(-1 <= self.health_port < 65536, "health_port", self.health_port, "must be in -1..65535")
        _require(self.encoder_backend in ("auto", "eager", "compile", "neuron"), "encoder_backend",
                 self.encoder_backend, "must be auto, eager, compile or neuron")
        _require(self.tower in ("auto", "qwen3vl", "vllm"), "tower", self.tower, "must be auto, qwen3vl or vllm")
        _require(self.tower_dtype in ("auto", "float32", "bfloat16", "float16"), "tower_dtype", self.tower_dtype,
                 "must be auto, float32, bfloat16 or float16")
        _require(self.tower != "vllm" or self.weights is not None, "tower", self.tower,
                 "needs --weights (the checkpoint vLLM loads)")
        _require(self.attention_kernel in ("auto", "native", "sdpa"), "attention_kernel",
                 self.attention_kernel, "must be auto, native or sdpa")
        _require(self.input_cache_bytes >= 0, "input_cache_bytes", self.input_cache_bytes, "must be >= 0")
        if self.encoder_buckets is not None:
            _require(bool(self.encoder_buckets) and min(self.encoder_buckets) > 0, "encoder_buckets",
                     self.encoder_buckets, "must be positive token counts")
        for name in ("max_items_per_request", "max_message_bytes", "max_image_pixels",
                     "max_video_frames", "encode_workers", "encode_batch_tokens"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        _require(self.drain_grace_s >= 0, "drain_grace_s", self.drain_grace_s, "must be >= 0")


@dataclass(frozen=True)
class PrefillConfig:
    """Everything ``epd prefill`` and :class:`EncoderCacheClient` need."""

    encoders: tuple[str, ...] = setting(
        (f"127.0.0.1:{DEFAULT_GRPC_PORT}",), env="EPD_ENCODERS", flag="--encoder",
        help="encoder targets, comma separated: HOST:PORT, dns:///NAME:PORT resolving to every pod, or "
             "file:PATH listing targets one per line; names and files are resolved again while running")
    model_id: str = setting(
        "tiny-qwen3-vl", env="EPD_MODEL_ID", help="model identity sent in the handshake")
    consumer_id: str | None = setting(
        None, env="EPD_CONSUMER_ID", help="identity in leases and logs; default host:pid")
    transport: TransportKind = setting(
        TransportKind.AUTO, env="EPD_TRANSPORT", help="nixl, mock, or auto; must match the encoder's")
    metrics_port: int = setting(
        DEFAULT_PREFILL_METRICS_PORT, env="EPD_PREFILL_METRICS_PORT",
        help="HTTP port for the worker's /metrics (0 picks a free one, -1 disables)")
    rpc_timeout_s: float = setting(10.0, env="EPD_RPC_TIMEOUT_S", help="deadline of each gRPC call")
    pull_timeout_s: float = setting(
        2.0, env="EPD_PULL_TIMEOUT_S", help="deadline of each NIXL transfer wait")
    failure_policy: FailurePolicy = setting(
        FailurePolicy.FAIL, env="EPD_FAILURE_POLICY",
        help="fail: raise ECLoadFailure; retry: re-request the item once, then raise")
    # In blocks of the encoder's layout (64 rows by default): 16,384 rows each way by default.
    landing_blocks: int = setting(
        256, env="EPD_LANDING_BLOCKS", help="registered landing blocks for pulls")
    local_cache_blocks: int = setting(
        1024, env="EPD_LOCAL_CACHE_BLOCKS", help="consumer-side cache of pulled items, in blocks")
    device: str = setting("cpu", env="EPD_DEVICE", help="torch device of the prefill graph")
    metrics_host: str = setting(
        "127.0.0.1", env="EPD_PREFILL_METRICS_HOST",
        help="listen address of the worker's /metrics (0.0.0.0 to be scraped from outside a pod)")
    lm_weights: str | None = setting(
        None, env="EPD_LM_WEIGHTS",
        help="directory with config.json + *.safetensors of a Qwen3-style text model; random init when unset")
    lm_seed: int = setting(0, env="EPD_LM_SEED", help="seed of the LM's deterministic random init")
    out_hidden_size: int = setting(
        64, env="EPD_OUT_HIDDEN_SIZE", help="LM hidden size; must equal the encoder's out_hidden_size")
    deepstack_levels: int = setting(
        2, env="EPD_DEEPSTACK_LEVELS",
        help="deepstack levels in each encoder row, added after the LM's first layers; must match the encoder")
    max_model_len: int = setting(8192, env="EPD_MAX_MODEL_LEN", help="longest prompt, in tokens")
    prefix_block_size: int = setting(
        16, env="EPD_PREFIX_BLOCK_SIZE", help="tokens per prefix-cache (KV) block")
    prefix_cache_blocks: int = setting(
        4096, env="EPD_PREFIX_CACHE_BLOCKS", help="prefix-cache capacity, in blocks (LRU)")
    mm_cache_items: int = setting(
        1024, env="EPD_MM_CACHE_ITEMS", help="layer-1 input-processor cache capacity, in items (LRU)")
    membership_refresh_s: float = setting(
        2.0, env="EPD_MEMBERSHIP_REFRESH_S",
        help="how often the encoder targets are resolved again (dns:///, file:) and every encoder's readiness "
             "asked; new items go only to ready encoders, and at once after a failed call; 0: only at start")
    weights_digest: str | None = setting(
        None, env="EPD_WEIGHTS_DIGEST",
        help="vision weights digest the encoders must announce (`epd weights-digest CHECKPOINT` prints it): "
             "others are refused, naming both digests, and their items go to the next encoder. Unset: "
             "encoders of any weights are accepted, their items kept apart by digest")
    keep_freed_memory: bool = setting(
        True, env="EPD_KEEP_FREED_MEMORY",
        help=KEEP_FREED_MEMORY_HELP)
    compile_graph: bool = setting(
        False, env="EPD_COMPILE", flag="--compile", help="torch.compile the prefill graph (true/false)")
    pull_on: PullSide = setting(
        PullSide.WORKER, env="EPD_PULL_ON",
        help="vLLM connector only: worker (each worker pulls into its own device's landing pool and "
             "verifies; the scheduler tracks) or scheduler (the scheduler pulls into host memory and "
             "ships the rows to the workers in the step's metadata)")
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        _require(bool(self.encoders), "encoders", self.encoders, "needs at least one target")
        _require(bool(self.model_id), "model_id", self.model_id, "must be non-empty")
        for name in ("rpc_timeout_s", "pull_timeout_s", "landing_blocks", "local_cache_blocks",
                     "out_hidden_size", "max_model_len", "prefix_block_size", "prefix_cache_blocks",
                     "mm_cache_items"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        _require(self.deepstack_levels >= 0, "deepstack_levels", self.deepstack_levels, "must be >= 0")
        _require(self.membership_refresh_s >= 0, "membership_refresh_s", self.membership_refresh_s,
                 "must be >= 0")


# --- CLI / environment plumbing -------------------------------------------------------


DEFAULT_PROXY_PORT = 8000


@dataclass(frozen=True)
class ProxyConfig:
    """Everything ``epd proxy`` (the OpenAI-compatible front of encoders + vLLM) needs."""

    encoders: tuple[str, ...] = setting(
        (f"127.0.0.1:{DEFAULT_GRPC_PORT}",), env="EPD_ENCODERS", flag="--encoder",
        help="encoder targets, comma separated: HOST:PORT, dns:///NAME:PORT or file:PATH (as for epd prefill)")
    backends: tuple[str, ...] = setting(
        ("http://127.0.0.1:8100",), env="EPD_PROXY_BACKENDS", flag="--backend",
        help="vLLM servers (running the EpdCacheConnector), comma separated base URLs; requests go round "
             "robin, to the next one when one is unreachable")
    host: str = setting("127.0.0.1", env="EPD_PROXY_HOST", help="listen address (0.0.0.0 in a pod)")
    port: int = setting(DEFAULT_PROXY_PORT, env="EPD_PROXY_PORT", help="listen port (0 picks a free one)")
    model_id: str | None = setting(
        None, env="EPD_MODEL_ID",
        help="model identity sent in the encoder handshake, for every request. Unset: the request's model, "
             "else the one model the backends' /v1/models lists (the encoders' --model-id must then be the "
             "name vLLM serves the model under)")
    allow_local_media: str | None = setting(
        None, env="EPD_PROXY_ALLOW_LOCAL_MEDIA",
        help="directory whose files image parts may name (file:// URLs); unset: local files are refused")
    allow_remote_media: tuple[str, ...] = setting(
        (), env="EPD_PROXY_ALLOW_REMOTE_MEDIA",
        help="host names whose http(s) media URLs the proxy fetches, comma separated; unset: remote URLs "
             "are refused (400)")
    media_fetch_timeout_s: float = setting(
        10.0, env="EPD_PROXY_MEDIA_FETCH_TIMEOUT_S", help="deadline of fetching one allowed remote media URL")
    max_request_bytes: int = setting(
        64 << 20, env="EPD_PROXY_MAX_REQUEST_BYTES", help="largest request body (and fetched media item) accepted")
    backend_timeout_s: float = setting(
        600.0, env="EPD_PROXY_BACKEND_TIMEOUT_S", help="deadline of one forwarded request, streaming included")
    rpc_timeout_s: float = setting(10.0, env="EPD_RPC_TIMEOUT_S", help="deadline of each encoder gRPC call")
    transport: TransportKind = setting(
        TransportKind.AUTO, env="EPD_TRANSPORT", help="nixl, mock, or auto; must match the encoder's (handshake)")
    weights_digest: str | None = setting(
        None, env="EPD_WEIGHTS_DIGEST",
        help="vision weights digest the encoders must announce; others are refused and their items go elsewhere")
    membership_refresh_s: float = setting(
        2.0, env="EPD_MEMBERSHIP_REFRESH_S", help="how often encoder targets and readiness are checked again")
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        _require(bool(self.encoders), "encoders", self.encoders, "needs at least one target")
        _require(bool(self.backends), "backends", self.backends, "needs at least one URL")
        if self.model_id is not None:
            _require(bool(self.model_id.strip()), "model_id", self.model_id, "must be non-empty when given")
        for url in self.backends:
            _require(url.startswith(("http://", "https://")), "backend", url, "must be an http(s):// URL")
        _require(0 <= self.port < 65536, "port", self.port, "must be in [0, 65535]")
        for name in ("media_fetch_timeout_s", "max_request_bytes", "backend_timeout_s", "rpc_timeout_s"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """One configurable value as the README's reference lists it."""

    path: tuple[str, ...]  # field names from the top-level config, nested ones included
    flag: str
    env: str
    default: Any
    help: str
    type: Any


def _require(ok: bool, name: str, value: object, what: str) -> None:
    if not ok:
        raise ConfigError(f"{name} {what}, got {value!r}")


def iter_settings(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[SettingInfo]:
    """Every leaf setting of a config class, nested config classes flattened."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from iter_settings(hint, prefix + (f.name,))
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        yield SettingInfo(prefix + (f.name,), flag, f.metadata["env"], f.default, f.metadata["help"], hint)


def describe(cls: type) -> list[SettingInfo]:
    return list(iter_settings(cls))


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for ``X | None``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _convert(info: SettingInfo, raw: str, source: str) -> Any:
    base, optional = _base_type(info.type)
    if optional and raw.strip() in ("", "none", "None"):
        return None
    try:
        if base is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(raw)
            return lowered in ("1", "true", "yes", "on")
        if base is int:
            return int(raw, 0)
        if base is float:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError(raw)
            return value
        if typing.get_origin(base) is tuple:
            parts = tuple(part.strip() for part in raw.split(",") if part.strip())
            return tuple(int(part, 0) for part in parts) if typing.get_args(base)[0] is int else parts
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return base(raw.strip().lower())
        return raw
    except ValueError:
        raise ConfigError(f"{source} has an invalid value {raw!r} for {info.flag}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per setting; defaults stay None so unset flags fall back to env."""
    for info in iter_settings(cls):
        base, _ = _base_type(info.type)
        default = info.default.value if isinstance(info.default, enum.Enum) else info.default
        if isinstance(default, tuple):
            default = ",".join(default)
        extra: dict[str, Any] = {}
        if isinstance(base, type) and issubclass(base, enum.Enum):
            extra["choices"] = [m.value for m in base]
        parser.add_argument(
            info.flag, dest="_".join(info.path), default=None, metavar=None if extra else info.path[-1].upper(),
            # argparse %-formats help strings: a literal "%" in a setting's help must be doubled.
            help=f"{info.help} [env {info.env}; default {default}]".replace("%", "%%"), **extra,
        )


def build(cls: type, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> Any:
    """Resolve a config: CLI flag, else environment variable, else default."""
    environ = environ or {}
    values: dict[tuple[str, ...], Any] = {}
    for info in iter_settings(cls):
        raw = getattr(args, "_".join(info.path), None) if args is not None else None
        if raw is not None:
            values[info.path] = _convert(info, str(raw), f"flag {info.flag}")
        elif info.env in environ:
            values[info.path] = _convert(info, environ[info.env], f"environment variable {info.env}")
    return _instantiate(cls, values, ())


def build_from_mapping(cls: type, mapping: Mapping[str, Any], source: str,
                       environ: Mapping[str, str] | None = None) -> Any:
    """Resolve a config from a mapping (e.g. a JSON object) keyed by field name (``rpc_timeout_s``,
    ``tls_ca``) or flag name (``rpc-timeout-s``), else from the environment variable, else the
    default. A list value is a comma-separated setting. Unknown keys are a ConfigError naming them."""
    by_name: dict[str, SettingInfo] = {}
    for info in iter_settings(cls):
        by_name["_".join(info.path)] = info
        by_name[info.flag.removeprefix("--").replace("-", "_")] = info
    values: dict[tuple[str, ...], Any] = {}
    for info in iter_settings(cls):
        if environ and info.env in environ:
            values[info.path] = _convert(info, environ[info.env], f"environment variable {info.env}")
    for key, raw in mapping.items():
        found = by_name.get(key.replace("-", "_"))
        if found is None:
            raise ConfigError(f"{source}: unknown setting {key!r}; known: {', '.join(sorted(by_name))}")
        text = ",".join(str(v) for v in raw) if isinstance(raw, (list, tuple)) else str(raw)
        if isinstance(raw, bool):
            text = "true" if raw else "false"
        values[found.path] = _convert(found, text, f"{source} {key!r}")
    return _instantiate(cls, values, ())


def _instantiate(cls: type, values: dict[tuple[str, ...], Any], prefix: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + (f.name,)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _instantiate(hints[f.name], values, path)
        elif path in values:
            kwargs[f.name] = values[path]
    return cls(**kwargs)


def markdown_reference(cls: type) -> str:
    """The README's configuration table for one config class."""
    rows = ["| flag | env | default | meaning |", "| --- | --- | --- | --- |"]
    for info in iter_settings(cls):
        default = info.default.value if isinstance(info.default, enum.Enum) else info.default
        if isinstance(default, tuple):
            default = ",".join(default)
        rows.append(f"| `{info.flag}` | `{info.env}` | {default if default is not None else '—'} | {info.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    for config_cls in (EncoderServerConfig, PrefillConfig, ProxyConfig):
        print(f"### {config_cls.__name__}\n\n{markdown_reference(config_cls)}\n")


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; :class:`ConfigError` naming the file otherwise."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return raw
