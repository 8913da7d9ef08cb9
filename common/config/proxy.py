"""Everything ``epd proxy``, the OpenAI-compatible front of encoders and vLLM, needs (proxy process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config.builder import require, setting, settle_choices
from common.config.choices import TransportKind
from common.config.shared import DEFAULT_GRPC_PORT, TlsConfig

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
        settle_choices(self)
        require(bool(self.encoders), "encoders", self.encoders, "needs at least one target")
        require(bool(self.backends), "backends", self.backends, "needs at least one URL")
        if self.model_id is not None:
            require(bool(self.model_id.strip()), "model_id", self.model_id, "must be non-empty when given")
        for url in self.backends:
            require(url.startswith(("http://", "https://")), "backend", url, "must be an http(s):// URL")
        require(0 <= self.port < 65536, "port", self.port, "must be in [0, 65535]")
        for name in ("media_fetch_timeout_s", "max_request_bytes", "backend_timeout_s", "rpc_timeout_s"):
            require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
