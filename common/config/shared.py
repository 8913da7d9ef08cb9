"""Ports, health service names, TLS and the freed-memory switch: what every process shares (every process)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config.builder import setting
from common.errors import ConfigError

DEFAULT_GRPC_PORT = 50051
DEFAULT_METRICS_PORT = 9400
DEFAULT_PREFILL_METRICS_PORT = 9401

# grpc.health.v1 service names the encoder registers besides the overall ""
# status. Kubernetes probes name them; the deploy test imports these.
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"


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


# By default an item a consumer does not remember placing is looked up by its derived mm_hash from
# this many bytes on (prefill_client/consumer/known.py; epd proxy's --lookup-min-bytes): a Lookup
# that finds a 150 KB image saves about what one that misses adds before the Encode (a round trip,
# ~1 ms here), and bigger ones save more (bench/hit_path.py, BENCHMARKS.md).
DERIVE_MIN_BYTES = 64 << 10

KEEP_FREED_MEMORY_HELP = (
    "keep freed memory for reuse (glibc mallopt: buffers up to 64 MiB from the heap, up to 256 MiB of freed "
    "memory kept): requests of tens of MB otherwise page-fault fresh memory each time (common/malloc.py; "
    "true/false)")
