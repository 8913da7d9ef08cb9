"""Everything ``epd encoder`` needs: its settings, with their flags, variables and checks (encoder process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config.builder import require, setting, settle_choices
from common.config.cache import CacheConfig
from common.config.choices import AttentionKernel, EncoderBackend, TowerChoice, TowerDtype, TransportKind
from common.config.shared import DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT, KEEP_FREED_MEMORY_HELP, TlsConfig


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
    tower: TowerChoice = setting(
        TowerChoice.AUTO, env="EPD_TOWER",
        help="what computes the rows: qwen3vl (epd-cache's own Qwen3-VL tower, the fast CPU and Neuron path), "
             "vllm (the checkpoint's own multimodal encoder and processor, loaded through vLLM without its "
             "language model: every VLM vLLM serves), or auto (qwen3vl for Qwen3-VL checkpoints and no "
             "--weights, vllm for any other architecture vLLM knows; another checkpoint is refused at start, "
             "naming its architecture)")
    tower_dtype: TowerDtype = setting(
        TowerDtype.AUTO, env="EPD_TOWER_DTYPE",
        help="dtype the tower computes in: float32, bfloat16, float16, or auto (for epd-cache's Qwen3-VL "
             "tower the dtype the checkpoint declares, read as vLLM reads it: config.json's dtype, its "
             "text_config's, its vision_config's, else the vision tensors' stored dtype; float32 without "
             "--weights; for the vLLM tower the cache's dtype). bfloat16 runs the matmuls on a CPU's AMX or "
             "AVX-512 BF16 units, several times faster than float32 (BENCHMARKS.md); rows computed in another "
             "dtype get other mm_hashes, so encoders of a pool must agree")
    device: str = setting("cpu", env="EPD_DEVICE", help="torch device for the encoder and the cache")
    encoder_backend: EncoderBackend = setting(
        EncoderBackend.AUTO, env="EPD_ENCODER_BACKEND",
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
    attention_kernel: AttentionKernel = setting(
        AttentionKernel.AUTO, env="EPD_ATTENTION_KERNEL",
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
        settle_choices(self)
        require(bool(self.model_id), "model_id", self.model_id, "must be non-empty")
        require(0 <= self.port < 65536, "port", self.port, "must be in 0..65535")
        require(-1 <= self.metrics_port < 65536, "metrics_port", self.metrics_port, "must be in -1..65535")
        require(-1 <= self.health_port < 65536, "health_port", self.health_port, "must be in -1..65535")
        require(not self.tower.needs_checkpoint or self.weights is not None, "tower", self.tower.value,
                "needs --weights (the checkpoint vLLM loads)")
        require(self.input_cache_bytes >= 0, "input_cache_bytes", self.input_cache_bytes, "must be >= 0")
        if self.encoder_buckets is not None:
            require(bool(self.encoder_buckets) and min(self.encoder_buckets) > 0, "encoder_buckets",
                    self.encoder_buckets, "must be positive token counts")
        for name in ("max_items_per_request", "max_message_bytes", "max_image_pixels",
                     "max_video_frames", "encode_workers", "encode_batch_tokens"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        require(self.drain_grace_s >= 0, "drain_grace_s", self.drain_grace_s, "must be >= 0")
