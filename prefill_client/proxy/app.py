"""The proxy's aiohttp application: its routes, the chat handler, forwarding to the backends (proxy process).

``POST /v1/chat/completions`` reads the request's media (:mod:`.media`), places them on the
encoders in one ``Encode`` per encoder with the model id's client (:mod:`.clients`), rewrites
the request (:mod:`.rewrite`) and forwards it to a backend (:mod:`.backends`), relaying its
answer as it comes. ``POST /v1/completions`` (text prompts: nothing to encode) goes on as the
caller wrote it, routed and relayed the same way; ``GET /v1/models`` is forwarded. Every such
request first passes the front door (:mod:`.front`: its API key, the in-flight bound), before
its body is read.
``GET /health`` (liveness), ``GET /ready`` (:mod:`.readiness`) and ``GET /metrics`` are the
proxy's own, and open. Errors are answers (:mod:`.errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from common.config import ProxyConfig
from common.errors import EncoderCallError, EpdError
from common.metrics import ProxyMetrics
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.handoff import Placement
from prefill_client.proxy.backends import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Backends,
    error_message,
    no_answer,
    passed_headers,
    relayed_response,
    with_hint,
)
from prefill_client.proxy.clients import Clients, new_client
from prefill_client.proxy.disagg import Disaggregated
from prefill_client.proxy.errors import ENCODE_FAILURES, FIXED_MODEL_SOURCE, UNAVAILABLE, HttpError, encode_rule
from prefill_client.proxy.front import Front, count_media_parts, load_api_keys
from prefill_client.proxy.media import MediaReader, cache_salt, video_fps
from prefill_client.proxy.readiness import Readiness
from prefill_client.proxy.rewrite import Part, rewrite, this_turns
from prefill_client.proxy.routing import affinity_key, make_policy

logger = logging.getLogger(__name__)

MAX_MODEL_CHARS = 256  # as the encoder bounds the labels of a request
# vLLM applies mm_processor_kwargs when it preprocesses media; here the encoders did, by their own settings.
PROCESSOR_KWARGS_REFUSED = (
    "mm_processor_kwargs is not supported by epd proxy: the encoders preprocess with their own settings (the "
    "checkpoint's processor configuration), so the request's would not apply to its media; send the request "
    "without mm_processor_kwargs")
# Threads that wait on the encoders' RPCs when --max-inflight sets no bound (asyncio's own pool
# has os.cpu_count() + 4: on a small pod, a few slow encodes would queue every other request).
UNBOUNDED_PLACE_THREADS = 256
T = TypeVar("T")


class Proxy:
    """The HTTP application over encoder clients (:class:`~.clients.Clients`).

    ``client``: the one client of every request (``--model-id``), its caller's to close; without
    it, ``make_client(model_id)`` makes one per model id (default :func:`~.clients.new_client`),
    closed here. ``metrics``: what ``/metrics`` serves (a fresh registry by default);
    ``readiness``: what ``/ready`` asks (default: ``cfg``'s encoders and the backends).
    """

    def __init__(self, cfg: ProxyConfig, client: EncoderCacheClient | None = None, *,
                 make_client: Callable[[str], EncoderCacheClient] | None = None,
                 metrics: ProxyMetrics | None = None, readiness: Readiness | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics if metrics is not None else ProxyMetrics()
        self._clients = Clients(make_client or (lambda model: new_client(cfg, model)), client)
        # With --prefill/--decode the decode pool is the backends (/v1/models), the prefill pool the split's own.
        self._backends = Backends(cfg.backends or cfg.decode, make_policy(cfg.routing, cfg.affinity_load_factor),
                                  retry_s=cfg.backend_retry_s, refresh_s=cfg.membership_refresh_s)
        self._disagg = Disaggregated(cfg, self._backends, lambda: self.session, lambda c, p: self._blocking(
            self._diagnose, c, p)) if cfg.disaggregated else None
        self._media = MediaReader(cfg)
        self._session: aiohttp.ClientSession | None = None
        self._front = Front(load_api_keys(cfg), cfg.max_inflight, self.metrics, lambda: self._backends.urls + (
            self._disagg.prefill.urls if self._disagg is not None else ()))
        self._readiness = readiness or Readiness(
            cfg, self._disagg.pools if self._disagg is not None else lambda: self._backends.urls)
        # The encoder client's calls block: each request's wait on them runs here, one thread per
        # request in flight at most (made as needed), so none waits for another's encode.
        self._rpc_threads = ThreadPoolExecutor(max_workers=cfg.max_inflight or UNBOUNDED_PLACE_THREADS,
                                               thread_name_prefix="epd-proxy-rpc")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_request_bytes, middlewares=[self._front.middleware])
        app.router.add_post(CHAT_PATH, self.chat, expect_handler=self._front.expect)
        app.router.add_post(COMPLETIONS_PATH, self.completions, expect_handler=self._front.expect)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_text)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app.on_response_prepare.append(self._front.on_response_prepare)
        return app

    async def _start(self, app: web.Application) -> None:
        # aiohttp holds at most 100 connections by default: more streams than that would queue
        # here, unseen. The in-flight bound is the bound (0: none, as aiohttp reads it too).
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.backend_timeout_s),
                                              connector=aiohttp.TCPConnector(limit=self.cfg.max_inflight),
                                              trace_configs=[self._front.trace_config()])

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        await self._readiness.close()
        await self._clients.close()
        self._rpc_threads.shutdown(wait=False, cancel_futures=True)

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet answered in full, in this process."""
        return self._front.inflight

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP client of backends and remote media (made when the application starts)."""
        assert self._session is not None
        return self._session

    # --- handlers ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 200 while the process serves; ``ready`` is the last readiness check's (no wait)."""
        state = self._readiness.peek()
        return web.json_response({"status": "ok", "ready": state is not None and state.ready,
                                  "encoders": list(self._clients.targets or self.cfg.encoders),
                                  "backends": list(self.cfg.backends), "models": self._clients.models,
                                  **({"prefill": list(self.cfg.prefill), "decode": list(self.cfg.decode)}
                                     if self._disagg is not None else {})})

    async def ready(self, request: web.Request) -> web.Response:
        """200 when an encoder is ready and a backend answers its health; 503 naming the side that is not."""
        state = await self._readiness.state()
        return web.json_response(state.body(), status=200 if state.ready else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._forward("GET", "/v1/models", None, request)
        except HttpError as exc:
            return self._front.refusal(exc)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise HttpError(400, "request body must be an object with a 'messages' list")
            media_items = count_media_parts(body["messages"])
            self._front.media_read(media_items)
            if media_items and body.get("mm_processor_kwargs"):
                raise HttpError(400, PROCESSOR_KWARGS_REFUSED)
            parts = await self._media.parts(body["messages"], video_fps(body), self.session, cache_salt(body))
            if not parts:  # nothing to encode: no encoder, no model id
                if self._disagg is not None:  # prefill on one vLLM, decode on another
                    return await self._disagg.serve(body, request)
                # Nothing rewritten: the caller's own bytes go on, not a second serialisation of them.
                return await self._forward("POST", CHAT_PATH, body, request, raw=await request.read())
            model, source = await self._model_id(body, request)
            async with self._clients.use(model) as client:
                placements = await self._place(client, model, source, parts)
                self._front.placed(placements)
                rewrite(body, parts, placements, client)
                hint = this_turns(body["messages"], parts, placements) if self.cfg.prefetch_hints else []
                if self._disagg is not None:
                    return await self._disagg.serve(body, request, client, placements, hint=hint)
                return await self._forward("POST", CHAT_PATH, body, request, client, placements, hint=hint)
        except HttpError as exc:
            return self._front.refusal(exc)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """A text completion: no media (the completions API takes none), so no encoder; the caller's
        bytes go on unchanged, to the backend its prompt's start hashes to (or prefilled and decoded)."""
        try:
            body = await self._json_body(request)
            if not isinstance(body, dict) or "prompt" not in body:
                raise HttpError(400, "request body must be an object with a 'prompt'")
            if self._disagg is not None:
                return await self._disagg.serve(body, request, path=COMPLETIONS_PATH)
            return await self._forward("POST", COMPLETIONS_PATH, body, request, raw=await request.read())
        except HttpError as exc:
            return self._front.refusal(exc)

    async def _json_body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"request body is not JSON: {exc}") from exc
        except web.HTTPRequestEntityTooLarge as exc:
            raise HttpError(413, f"request body over {self.cfg.max_request_bytes} bytes") from exc

    # --- model id ----------------------------------------------------------------------------

    async def _model_id(self, body: dict[str, Any], request: web.Request) -> tuple[str, str]:
        """The model id for the encoder handshake, and where it came from (for error messages)."""
        fixed = self._clients.fixed_model or self.cfg.model_id
        if fixed is not None:
            return fixed, FIXED_MODEL_SOURCE
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str) or not model.strip():
                raise HttpError(400, f"model must be a non-empty string, got {model!r:.80}")
            if len(model) > MAX_MODEL_CHARS:
                raise HttpError(400, f"model is {len(model)} characters; at most {MAX_MODEL_CHARS}")
            return model, "the request's model"
        served = await self._backends.served_models(self.session, passed_headers(request.headers))
        if len(served) == 1:
            return served[0], "the one model of the backends' /v1/models"
        if not served:
            raise HttpError(400, "'model' is required: the backends' /v1/models lists no model")
        raise HttpError(400, f"'model' is required: the backends serve {len(served)} models "
                             f"({', '.join(repr(m) for m in served)})")

    # --- encoding ----------------------------------------------------------------------------

    async def _place(self, client: EncoderCacheClient, model: str, source: str,
                     parts: Sequence[Part]) -> list[Placement]:
        try:
            with self.metrics.encode_latency.time():
                return await self._blocking(client.place, [p.spec for p in parts])
        except ENCODE_FAILURES as exc:
            rule = encode_rule(exc)
            if rule.drops_client:  # the encoders refused the model id: it keeps no client
                self._clients.drop(model)
            raise rule.answer(exc, model, source) from exc

    async def _blocking(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` on one of the proxy's RPC threads (the encoder client blocks), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._rpc_threads, call, *args)

    # --- forwarding --------------------------------------------------------------------------

    async def _forward(self, method: str, path: str, body: dict[str, Any] | None, request: web.Request,
                       client: EncoderCacheClient | None = None, placements: Sequence[Placement] = (), *,
                       raw: bytes | None = None, hint: Sequence[Placement] = ()) -> web.StreamResponse:
        """Send the request to a backend and relay its answer; ``client`` placed the ``placements``.
        ``raw``: the JSON bytes to send, ``body`` as the caller wrote it (else ``body`` is serialised);
        ``hint``: the placements to name in its prefetch header."""
        session = self.session
        assert client is not None or not placements
        headers = passed_headers(request.headers)
        if hint:
            with_hint(headers, hint)
        data = raw if raw is not None or body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        errors: list[str] = []
        timeout = aiohttp.ClientTimeout(total=self.cfg.backend_timeout_s,
                                        sock_connect=self.cfg.backend_connect_timeout_s)
        for base in self._backends.order(lambda: affinity_key(body)):
            with self._backends.sending(base):  # outstanding until its answer is relayed
                logger.debug("%s %s to backend %s (%d outstanding there)", method, path, base,
                             self._backends.outstanding(base))
                try:
                    resp = await session.request(method, base + path, data=data, headers=headers, timeout=timeout)
                except aiohttp.ClientConnectionError as exc:  # not reached, or it died with the request
                    why = str(exc) or type(exc).__name__
                    errors.append(f"{base}: {why}")
                    self._backends.failed(base, why)
                    continue
                except asyncio.TimeoutError:  # it took the request: not sent again (a slow one would see it twice)
                    error = no_answer("backend", base, self.cfg.backend_timeout_s)
                    self._backends.failed(base, str(error))
                    if client is not None:
                        client.release_placed(placements)
                    raise error from None
                self._backends.answered(base)
                if resp.status >= 400 and client is not None and placements:
                    # Refused or failed: its leases may never be pulled (a second release is harmless).
                    client.release_placed(placements)
                async with resp:
                    if resp.status >= 500 and client is not None and placements:
                        text = await resp.text()
                        why = await self._blocking(self._diagnose, client, placements)
                        raise HttpError(resp.status, f"backend {base} failed the request ({resp.status}: "
                                                     f"{error_message(text)}); {why}", kind="server_error")
                    out = relayed_response(resp)
                    await out.prepare(request)
                    async for chunk in resp.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                    return out
        if client is not None:
            client.release_placed(placements)  # nobody will pull them
        raise HttpError(502, f"no backend reachable ({'; '.join(errors) or self._backends.none_known()})",
                        kind=UNAVAILABLE)

    def _diagnose(self, client: EncoderCacheClient, placements: Sequence[Placement]) -> str:
        """What became of a failed request's items, asked of their encoders (leases given back at once)."""
        notes: list[str] = []
        by_encoder: dict[str, list[str]] = {}
        for p in placements:
            by_encoder.setdefault(p.encoder, []).append(p.mm_hash)
        for target, hashes in by_encoder.items():
            conn = client.connection(target)
            if conn is None:
                notes.append(f"encoder {target} left the encoder list")
                continue
            try:
                found = conn.lookup(hashes)
            except EncoderCallError as exc:  # the RPC failed (a gRPC status)
                notes.append(f"encoder {target} is unreachable ({exc.code.name})")
                continue
            except EpdError as exc:
                notes.append(f"encoder {target}: {exc}")
                continue
            conn.release([loc.lease_id for loc in found if loc is not None])
            gone = [h for h, loc in zip(hashes, found) if loc is None]
            if gone:
                notes.append(f"item {', '.join(gone)} is no longer on encoder {target} (evicted)")
        return "; ".join(notes) if notes else "its items are still on their encoders (see the backend's log)"
