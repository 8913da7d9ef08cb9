"""Assembly of the encoder process: transport, cache, encoder, gRPC, health, /metrics, drain.

Start-up order matters and is the readiness contract. :meth:`EncoderServer.listen`
comes first and takes seconds, because building the graphs can take minutes and a
probe must see a live process meanwhile:

1. the gRPC server binds (health, reflection, and the cache service behind its
   gate, which refuses every call UNAVAILABLE "warming up"), with the probe port
   and /metrics; ``liveness`` is SERVING from here on, everything else NOT_SERVING.

Then :meth:`EncoderServer.warm_up`:

2. the encoder is loaded; the NIXL agent is created and the cache regions are
   allocated through it (the mock needs them in shared memory) and registered
   **once**;
3. the attention kernel is loaded (or built, once per machine), then every bucket
   graph is built (warm-up writes land in the scratch block only), one log line and
   one ``epd_encoder_warmup_buckets_ready`` step per bucket;
4. the engine starts, the gate opens (the first handshake, and so the agent
   metadata snapshot, comes after the registration), and the overall status,
   ``readiness`` and the service name become SERVING.

On SIGTERM: every status goes NOT_SERVING (``enter_graceful_shutdown``),
new Encode/Lookup calls are refused with UNAVAILABLE, in-flight calls finish,
outstanding leases are given up to ``drain_grace_s`` to be released, then the
server stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from common.config import LIVENESS_SERVICE, READINESS_SERVICE, EncoderServerConfig
from common.errors import ConfigError
from common.metrics import EncoderMetrics
from common.wire import SERVICE_NAME, pb2
from encoder_server.compile_cache import use_compile_cache
from encoder_server.gate import CacheServiceGate, add_to_server

# What needs torch (seconds to import) is imported by warm_up, off the event loop and once
# the port is up; a unit test checks that listening imports no torch. torch._dynamo is the
# compile backend's: its first use would import it on the event loop.
_WARM_UP_MODULES = ("common.transport", "encoder_server.service", "encoder_server.vision", "encoder_server.towers",
                    "torch._dynamo")
if TYPE_CHECKING:
    from common.transport import ProducerTransport
    from encoder_server.cache_blocks import EncoderCacheBlocks
    from encoder_server.engine import EncoderEngine
    from encoder_server.service import EncoderCacheServicer

logger = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 0.02
_PROTECTED_PREFIX = f"/{SERVICE_NAME}/"


class _TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` on the cache service; health and reflection stay open."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if details.method.startswith(_PROTECTED_PREFIX):
            presented = b""
            for key, value in details.invocation_metadata or ():
                if key == "authorization":
                    presented = value.encode() if isinstance(value, str) else value
            if not hmac.compare_digest(presented, self._expected):
                return self._deny
        return await continuation(details)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path!r}: {exc}") from exc


class WarmupAbandoned(Exception):
    """The warm-up stopped because the process is shutting down (:meth:`EncoderServer.abandon_warm_up`)."""


class EncoderServer:
    """One encoder process's worth of state; ``await start()`` (or ``listen()`` then ``warm_up()``),
    then ``await wait()``."""

    def __init__(self, config: EncoderServerConfig) -> None:
        self.config = config
        self.incarnation_id = uuid.uuid4().hex
        self.metrics = EncoderMetrics()
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.encoder_id = ""  # set once the port is bound (listen)
        self.metrics_port = -1
        self.health_port = -1
        self._probe_server: grpc.aio.Server | None = None
        self.transport_kind = config.transport  # resolved (auto -> nixl or mock) by warm_up
        self._server: grpc.aio.Server | None = None
        self._httpd: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._preprocess_proto: pb2.PreprocessParams | None = None
        self._weights_digest = ""
        self._tower = ""
        self.engine: EncoderEngine | None = None
        self.servicer: EncoderCacheServicer | None = None
        self.transport: ProducerTransport | None = None
        self.cache: EncoderCacheBlocks | None = None
        self.gate = CacheServiceGate(self.metrics)
        self._abandon = threading.Event()

    # --- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """:meth:`listen`, then :meth:`warm_up`: returns once the encoder is ready."""
        await self.listen()
        await self.warm_up()

    async def listen(self) -> None:
        """Bind gRPC, the probe port and /metrics; ``liveness`` SERVING, the rest NOT_SERVING (seconds)."""
        cfg = self.config
        if cfg.compile_cache_dir is not None:  # before anything compiles, and a bad path fails at once
            use_compile_cache(cfg.compile_cache_dir)
        for name in ("", LIVENESS_SERVICE, READINESS_SERVICE, SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._start_grpc()
        if cfg.metrics_port >= 0:
            self._httpd, _ = start_http_server(
                cfg.metrics_port, addr=cfg.host, registry=self.metrics.scrape_view)
            self.metrics_port = self._httpd.server_port
        self.encoder_id = cfg.encoder_id or f"{socket.gethostname()}:{self.port}"
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        logger.info("encoder %s listening on gRPC %s:%d (health port %d, metrics port %d); warming up, not ready",
                    self.encoder_id, cfg.host, self.port, self.health_port, self.metrics_port)

    async def warm_up(self) -> None:
        """Load the encoder, register the cache, build every bucket graph, start the engine; then ready.

        Until it returns, cache RPCs are refused as warming up (the gate says which step).
        :meth:`abandon_warm_up` stops it at the next step or bucket with :class:`WarmupAbandoned`.
        """
        cfg = self.config
        started = time.monotonic()
        self._step("loading the encoder")
        # Every slow step runs off the event loop, which keeps answering health meanwhile;
        # importing torch and what needs it is the first (the imports below then find them loaded).
        for module in _WARM_UP_MODULES:
            await asyncio.to_thread(importlib.import_module, module)
        from common.transport import ProducerTransport, resolve_transport_kind
        from encoder_server.cache_blocks import EncoderCacheBlocks
        from encoder_server.engine import EncoderEngine
        from encoder_server.service import EncoderCacheServicer, params_to_proto
        from encoder_server.towers import load as load_tower

        tower = await asyncio.to_thread(load_tower, cfg)
        layout = cfg.cache.layout(tower.out_hidden_size, tower.deepstack_levels)

        self._step("registering the cache")
        self.transport_kind = await asyncio.to_thread(resolve_transport_kind, cfg.transport)
        self.transport = await asyncio.to_thread(ProducerTransport, self.transport_kind)
        self.incarnation_id = self.transport.incarnation_id  # one id names agent and process
        # Allocate through the transport (shared memory for the mock), register once,
        # and only then take the agent metadata: it is a snapshot.
        self.cache = await asyncio.to_thread(
            EncoderCacheBlocks, layout, cfg.cache.effective_min_hold_ms, lease_ttl_ms=cfg.cache.lease_ttl_ms,
            device=cfg.device, allocator=self.transport.allocator)
        await asyncio.to_thread(
            self.transport.register, self.cache.buffer, self.cache.stamps)

        runner = await asyncio.to_thread(tower.make_runner, layout.block_size)
        preprocessor = tower.preprocessor
        self._preprocess_proto = params_to_proto(tower.params, tower.fingerprint)
        self._weights_digest = tower.weights_digest
        self._tower = tower.name.value
        total = len(runner.buckets)
        self.metrics.warmup_buckets.set(total)
        self.metrics.warmup_buckets_ready.set(0)
        self._step(f"0/{total} bucket graphs ready")
        # Build every bucket's graph now (writes land in the scratch block only), so no
        # request pays for a compile and readiness means "fast".
        await asyncio.to_thread(runner.warmup, self.cache.buffer, layout.scratch_block_id, self._bucket_ready)

        self._step("starting the engine")
        self.engine = EncoderEngine(
            cache=self.cache, preprocessor=preprocessor, runner=runner, metrics=self.metrics,
            model_id=cfg.model_id, preprocess_fingerprint=tower.fingerprint,
            input_cache_bytes=cfg.input_cache_bytes, preprocess_workers=cfg.encode_workers,
            batch_tokens=cfg.encode_batch_tokens)
        await self.engine.start()
        self.servicer = EncoderCacheServicer(
            engine=self.engine, metrics=self.metrics, model_id=cfg.model_id, layout=layout,
            incarnation_id=self.incarnation_id, handshake_extra=self._handshake_extra,
            min_hold_ms=cfg.cache.effective_min_hold_ms, lease_ttl_ms=cfg.cache.lease_ttl_ms,
            max_items=cfg.max_items_per_request, max_video_frames=cfg.max_video_frames)
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="epd-housekeeping"))
        self.gate.open(self.servicer)
        for name in ("", READINESS_SERVICE, SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "encoder %s serving model %r after a %.1f s warm-up: layout %s blocks x %s rows x %s (%s), "
            "buffer %.1f MiB, min hold %d ms, transport %s, gRPC %s:%d, metrics port %d",
            self.incarnation_id[:8], cfg.model_id, time.monotonic() - started, layout.num_blocks,
            layout.block_size, layout.fat_dim, cfg.cache.dtype, layout.buffer_bytes / 2**20,
            cfg.cache.effective_min_hold_ms, self.transport_kind.value, cfg.host, self.port, self.metrics_port)

    def abandon_warm_up(self) -> None:
        """Make a running :meth:`warm_up` stop at its next step or bucket (shutdown during start-up).

        The bucket being built finishes first: its thread cannot be interrupted, and the
        cache it writes must outlive it.
        """
        self._abandon.set()

    def _step(self, progress: str) -> None:
        if self._abandon.is_set():
            raise WarmupAbandoned(f"warm-up abandoned at: {self.gate.progress}")
        self.gate.progress = progress

    def _bucket_ready(self, ready: int, total: int) -> None:
        """Called on the warm-up thread after each bucket graph is built (the refusals' text, then the gauge)."""
        self._step(f"{ready}/{total} bucket graphs ready")
        self.metrics.warmup_buckets_ready.set(ready)

    async def _start_grpc(self) -> None:
        cfg = self.config
        interceptors = [_TokenAuthInterceptor(cfg.tls.auth_token)] if cfg.tls.auth_token else []
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        add_to_server(self.gate, server)  # malformed request bytes -> INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls.cert and cfg.tls.key:
            creds = grpc.ssl_server_credentials(
                [(_read(cfg.tls.key), _read(cfg.tls.cert))],
                root_certificates=_read(cfg.tls.ca) if cfg.tls.ca else None,
                require_client_auth=bool(cfg.tls.ca))
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise ConfigError(f"cannot listen on {address}")
        await server.start()
        self._server = server
        if cfg.health_port >= 0:
            # Probes (Kubernetes gRPC probes among them) speak neither TLS nor tokens.
            probe_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, probe_server)
            self.health_port = probe_server.add_insecure_port(f"{cfg.host}:{cfg.health_port}")
            await probe_server.start()
            self._probe_server = probe_server

    def _handshake_extra(self) -> pb2.HandshakeResponse:
        assert self.transport is not None and self._preprocess_proto is not None
        return self.transport.fill_handshake(
            pb2.HandshakeResponse(preprocess=self._preprocess_proto, weights_digest=self._weights_digest,
                                  encoder_id=self.encoder_id, tower=self._tower, keys_cache_salt=True))

    # --- background --------------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        from common.transport import decode_release_notification

        assert self.engine is not None and self.transport is not None
        while True:
            try:
                # Our poller collects them already: taking them is a deque pop, not worth a thread
                # hop every tick. Otherwise the drain calls the agent, which may block.
                if self.transport.collects_in_background:
                    messages = self.transport.drain_notifications()
                else:
                    messages = await asyncio.to_thread(self.transport.drain_notifications)
                lease_ids: list[int] = []
                for msg in messages:
                    try:
                        lease_ids += decode_release_notification(msg)
                    except ValueError as exc:
                        logger.warning("ignored a malformed notification: %s", exc)
                if lease_ids:
                    self.engine.release(lease_ids, None)
                self.engine.housekeeping()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("housekeeping step failed")
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)

    # --- stop ----------------------------------------------------------------------------------

    async def drain_and_stop(self) -> None:
        """Graceful shutdown: refuse new work, finish in-flight calls, wait for leases, stop."""
        if self._stopped.is_set():
            return
        await self.health.enter_graceful_shutdown()
        if self.servicer is not None:
            self.servicer.draining = True
        deadline = time.monotonic() + self.config.drain_grace_s
        while self.cache is not None and self.cache.num_pinned_items and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.cache is not None and self.cache.num_pinned_items:
            logger.warning("drain grace over with %d items still leased", self.cache.num_pinned_items)
        await self.stop(grace=max(0.0, deadline - time.monotonic()))

    async def stop(self, grace: float | None = 0.0) -> None:
        if self._stopped.is_set():
            return
        if self._server is not None:
            await self._server.stop(grace)
        if self._probe_server is not None:
            await self._probe_server.stop(0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self.engine is not None:
            await self.engine.stop()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self.transport is not None:
            self.transport.close()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()
