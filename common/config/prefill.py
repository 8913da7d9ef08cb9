"""Everything ``epd prefill`` and the vLLM connector's consumer need (prefill process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config.builder import require, setting, settle_choices
from common.config.choices import FailurePolicy, PullSide, TransportKind
from common.config.shared import DEFAULT_GRPC_PORT, DEFAULT_PREFILL_METRICS_PORT, KEEP_FREED_MEMORY_HELP, TlsConfig


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
    prefault_mib: int = setting(
        128, env="EPD_PREFAULT_MIB",
        help="vLLM connector on a host (CPU) device, with keep_freed_memory: MiB of memory each worker "
             "maps in its pull threads at start, so the rows of the items it pulls land in mapped memory "
             "(a 224 px Qwen3-VL image's 2 MiB are otherwise 512 page faults: 1.5-12 ms of the pull on 2 "
             "cores); the worker's resident memory grows by that much at once. 0: none")
    compile_graph: bool = setting(
        False, env="EPD_COMPILE", flag="--compile", help="torch.compile the prefill graph (true/false)")
    pull_on: PullSide = setting(
        PullSide.WORKER, env="EPD_PULL_ON",
        help="vLLM connector only: worker (each worker pulls into its own device's landing pool and "
             "verifies; the scheduler tracks) or scheduler (the scheduler pulls into host memory and "
             "ships the rows to the workers in the step's metadata)")
    idle_pull_wait_ms: float = setting(
        10.0, env="EPD_IDLE_PULL_WAIT_MS",
        help="vLLM connector only: while no other request runs, how long vLLM's scheduler waits for a "
             "request's pulls before it steps without it (it then runs the request in the same step instead "
             "of the next; requests arriving meanwhile wait at most this long). 0: never wait")
    prefetch_blocks: int = setting(
        64, env="EPD_PREFETCH_BLOCKS",
        help="vLLM connector, worker path: blocks of rows each worker may pull ahead on prefetch hints (sent "
             "by vLLM's API server when started with --middleware prefill_client.vllm.prefetch.EpdPrefetch) "
             "and keep until the scheduler orders them; the oldest go first past it. 0: take no hints")
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        settle_choices(self)
        require(bool(self.encoders), "encoders", self.encoders, "needs at least one target")
        require(bool(self.model_id), "model_id", self.model_id, "must be non-empty")
        require(self.prefault_mib >= 0, "prefault_mib", self.prefault_mib, "must be >= 0")
        require(self.prefetch_blocks >= 0, "prefetch_blocks", self.prefetch_blocks, "must be >= 0")
        require(0 <= self.idle_pull_wait_ms <= 1000, "idle_pull_wait_ms", self.idle_pull_wait_ms,
                "must be between 0 and 1000")
        for name in ("rpc_timeout_s", "pull_timeout_s", "landing_blocks", "local_cache_blocks",
                     "out_hidden_size", "max_model_len", "prefix_block_size", "prefix_cache_blocks",
                     "mm_cache_items"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        require(self.deepstack_levels >= 0, "deepstack_levels", self.deepstack_levels, "must be >= 0")
        require(self.membership_refresh_s >= 0, "membership_refresh_s", self.membership_refresh_s,
                "must be >= 0")
