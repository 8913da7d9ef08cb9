"""Everything ``epd proxy``, the OpenAI-compatible front of encoders and vLLM, needs (proxy process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config.builder import require, setting, settle_choices
from common.config.choices import RoutingPolicy, TransportKind
from common.config.shared import DEFAULT_GRPC_PORT, DERIVE_MIN_BYTES, TlsConfig
from common.errors import ConfigError

DEFAULT_PROXY_PORT = 8000
DEFAULT_BACKEND = "http://127.0.0.1:8100"
MAX_WORKERS = 64  # proxy processes on one port; more is a typo, not a plan


@dataclass(frozen=True)
class ProxyConfig:
    """Everything ``epd proxy`` (the OpenAI-compatible front of encoders + vLLM) needs."""

    encoders: tuple[str, ...] = setting(
        (f"127.0.0.1:{DEFAULT_GRPC_PORT}",), env="EPD_ENCODERS", flag="--encoder",
        help="encoder targets, comma separated: HOST:PORT, dns:///NAME:PORT or file:PATH (as for epd prefill)")
    backends: tuple[str, ...] = setting(
        (), env="EPD_PROXY_BACKENDS", flag="--backend",
        help="vLLM servers (running the EpdCacheConnector), comma separated: http(s)://HOST:PORT base URLs, "
             "dns:///NAME:PORT (http:// to every address of the name) or file:PATH (one URL, HOST:PORT or "
             "dns:/// entry a line); names and files are read again every --membership-refresh-s. Which one "
             f"serves a request: --routing. Unset: {DEFAULT_BACKEND}, unless --prefill and --decode are given")
    prefill: tuple[str, ...] = setting(
        (), env="EPD_PROXY_PREFILL", flag="--prefill",
        help="prefill vLLM servers of a prefill/decode split (EpdCacheConnector and a KV connector as producer), "
             "written as --backend; each request is prefilled on one (max_tokens 1), then decoded on one of "
             "--decode with the KV the prefill handed over. Given together with --decode, and instead of --backend")
    decode: tuple[str, ...] = setting(
        (), env="EPD_PROXY_DECODE", flag="--decode",
        help="decode vLLM servers of a prefill/decode split (a KV connector as consumer), written as --backend; "
             "they serve /v1/models too. Given together with --prefill")
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
    encode_timeout_s: float = setting(
        60.0, env="EPD_PROXY_ENCODE_TIMEOUT_S",
        help="deadline of an Encode, which waits in the encoder's queue and runs the tower (busy encoders "
             "answer late, not never); the other encoder calls keep --rpc-timeout-s")
    transport: TransportKind = setting(
        TransportKind.AUTO, env="EPD_TRANSPORT", help="nixl, mock, or auto; must match the encoder's (handshake)")
    weights_digest: str | None = setting(
        None, env="EPD_WEIGHTS_DIGEST",
        help="vision weights digest the encoders must announce; others are refused and their items go elsewhere")
    membership_refresh_s: float = setting(
        2.0, env="EPD_MEMBERSHIP_REFRESH_S",
        help="how often encoder targets and readiness, and dns:/// and file: backends, are checked again")
    lookup_min_bytes: int = setting(
        DERIVE_MIN_BYTES, env="EPD_PROXY_LOOKUP_MIN_BYTES",
        help="an image this proxy process has not placed before is first looked up on its encoder by the "
             "mm_hash derived from its bytes when it has at least this many: found, its bytes are not sent; "
             "not found, the Lookup's round trip comes before the Encode. Above the largest image: never")
    # --- routing across backends (prefill_client/proxy/routing.py) ---
    routing: RoutingPolicy = setting(
        RoutingPolicy.AFFINITY, env="EPD_PROXY_ROUTING",
        help="which backend serves a request: affinity (the one its conversation's leading messages hash to, "
             "for vLLM's prefix cache, while that one is within the load bound; else the next in the key's "
             "order), least-outstanding (fewest requests in flight), or round-robin. Counts are per proxy "
             "process")
    affinity_load_factor: float = setting(
        1.25, env="EPD_PROXY_AFFINITY_LOAD_FACTOR",
        help="c of --routing affinity: a backend takes a request while its requests in flight, this one "
             "included, are at most ceil(c x the average over the backends); >= 1 (1: strict balance)")
    backend_retry_s: float = setting(
        5.0, env="EPD_PROXY_BACKEND_RETRY_S",
        help="a backend that refused a connection or timed out gets no requests for this long (unless every "
             "backend is down); then one request tries it, and its answer brings it back")
    backend_connect_timeout_s: float = setting(
        5.0, env="EPD_PROXY_BACKEND_CONNECT_TIMEOUT_S",
        help="deadline of connecting to a backend; past it the request goes to the next backend")
    tls: TlsConfig = field(default_factory=TlsConfig)
    # --- the front door: who may call, how many requests at once, how many processes ---
    api_keys: tuple[str, ...] = setting(
        (), env="EPD_PROXY_API_KEY", flag="--api-key", repeat=True, secret=True,
        help="API keys a caller must send (Authorization: Bearer KEY) on every route but /health, /ready and "
             "/metrics, checked before the body is read: comma separated, or the flag repeated (as vLLM's "
             "--api-key). None here nor in --api-key-file: no key is asked. The caller's header goes on to the "
             "backends: a vLLM started with --api-key must accept the same keys")
    api_key_file: str | None = setting(
        None, env="EPD_PROXY_API_KEY_FILE",
        help="file of API keys, one a line (blank lines skipped), read at start; accepted besides --api-key")
    max_inflight: int = setting(
        256, env="EPD_PROXY_MAX_INFLIGHT",
        help="requests one proxy process serves at once, from the key check until the answer is relayed "
             "(streams included); past it a request is answered 429 with Retry-After: 1 at once, its body "
             "unread. 0: no bound. 256 is vLLM's default max_num_seqs on GPUs under 70 GiB, and each request "
             "in flight keeps its body and media in the proxy's memory: raise it with the backends' capacity "
             "and the proxy's memory")
    access_log: bool = setting(
        False, env="EPD_PROXY_ACCESS_LOG",
        help="log one line per request answered, at INFO on the logger aiohttp.access: the caller's address, "
             "the request line, the status, the bytes sent, the seconds taken, the User-Agent and X-Request-Id "
             "(never another header's value, nor a body); true/false. Off, the proxy spends nothing on it")
    prefetch_hints: bool = setting(
        True, env="EPD_PROXY_PREFETCH_HINTS",
        help="repeat a request's placements in its X-Epd-Prefetch header (at most 8 KiB, else none), so that a "
             "vLLM started with --middleware prefill_client.vllm.prefetch.EpdPrefetch starts its pulls while it "
             "still renders the request; a vLLM without it ignores the header. true/false")
    drain_grace_s: float = setting(
        20.0, env="EPD_PROXY_DRAIN_GRACE_S",
        help="on SIGTERM (or SIGINT) the proxy stops listening at once and gives the requests in flight, streams "
             "included, this long to finish; those still running are then cut (their backend requests closed, "
             "which vLLM aborts) and it exits. In a pod, keep terminationGracePeriodSeconds above the preStop "
             "pause plus this")
    workers: int = setting(
        1, env="EPD_PROXY_WORKERS",
        help="proxy processes serving the one port (SO_REUSEPORT), sharing nothing else; the bounds and "
             "counts above are per process, and each one's /metrics adds up all of them")

    def __post_init__(self) -> None:
        settle_choices(self)
        require(bool(self.encoders), "encoders", self.encoders, "needs at least one target")
        self._settle_pools()
        if self.model_id is not None:
            require(bool(self.model_id.strip()), "model_id", self.model_id, "must be non-empty when given")
        for name, urls in (("backend", self.backends), ("prefill", self.prefill), ("decode", self.decode)):
            for url in urls:
                require(url.startswith(("http://", "https://", "dns:///", "file:")), name, url,
                        "must be an http(s):// URL, dns:///NAME:PORT or file:PATH")
        require(self.affinity_load_factor >= 1, "affinity_load_factor", self.affinity_load_factor, "must be >= 1")
        require(self.backend_retry_s >= 0, "backend_retry_s", self.backend_retry_s, "must be >= 0")
        require(self.backend_connect_timeout_s > 0, "backend_connect_timeout_s", self.backend_connect_timeout_s,
                "must be > 0")
        require(0 <= self.port < 65536, "port", self.port, "must be in [0, 65535]")
        require(self.drain_grace_s >= 0, "drain_grace_s", self.drain_grace_s, "must be >= 0")
        for name in ("media_fetch_timeout_s", "max_request_bytes", "backend_timeout_s", "rpc_timeout_s",
                     "encode_timeout_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for key in self.api_keys:
            require(bool(key) and not any(c.isspace() for c in key), "api_key", "<redacted>",
                    "must be non-empty, without spaces")
        require(self.lookup_min_bytes >= 0, "lookup_min_bytes", self.lookup_min_bytes, "must be >= 0")
        require(self.max_inflight >= 0, "max_inflight", self.max_inflight, "must be >= 0 (0: no bound)")
        require(1 <= self.workers <= MAX_WORKERS, "workers", self.workers, f"must be in [1, {MAX_WORKERS}]")

    @property
    def disaggregated(self) -> bool:
        """Whether requests are prefilled on ``prefill`` and decoded on ``decode`` (else served by ``backends``)."""
        return bool(self.prefill)

    def _settle_pools(self) -> None:
        """Either ``backends`` (its default when unset) or ``prefill`` and ``decode`` together."""
        if not self.prefill and not self.decode:
            if not self.backends:
                object.__setattr__(self, "backends", (DEFAULT_BACKEND,))
            return
        if self.backends:
            raise ConfigError(f"--backend excludes --prefill and --decode (a request is served by one backend, or "
                              f"prefilled and decoded on two): got backend {list(self.backends)}, prefill "
                              f"{list(self.prefill)}, decode {list(self.decode)}")
        if not self.prefill or not self.decode:
            raise ConfigError(f"--prefill and --decode go together (a prefill hands its KV to a decode): got "
                              f"prefill {list(self.prefill)}, decode {list(self.decode)}")
