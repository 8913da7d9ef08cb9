"""The proxy's aiohttp application: its routes, the chat handler, forwarding to the backends (proxy process).

``POST /v1/chat/completions`` reads the request's media (:mod:`.media`), places them on the
encoders in one ``Encode`` per encoder with the model id's client (:mod:`.clients`), rewrites
the request (:mod:`.rewrite`) and forwards it to a backend (:mod:`.backends`), relaying its
answer as it comes; ``GET /v1/models`` is forwarded; ``GET /health`` is the proxy's own.
Errors are answers (:mod:`.errors`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from common.config import ProxyConfig
from common.errors import EncoderCallError, EpdError
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.handoff import Placement
from prefill_client.proxy.backends import Backends, error_message, passed_headers
from prefill_client.proxy.clients import Clients, new_client
from prefill_client.proxy.errors import ENCODE_FAILURES, FIXED_MODEL_SOURCE, UNAVAILABLE, HttpError, encode_rule
from prefill_client.proxy.media import MediaReader, video_fps
from prefill_client.proxy.rewrite import Part, repeats, rewrite

CHAT_PATH = "/v1/chat/completions"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
MAX_MODEL_CHARS = 256  # as the encoder bounds the labels of a request


class Proxy:
    """The HTTP application over encoder clients (:class:`~.clients.Clients`).

    ``client``: the one client of every request (``--model-id``), its caller's to close; without
    it, ``make_client(model_id)`` makes one per model id (default :func:`~.clients.new_client`),
    closed here.
    """

    def __init__(self, cfg: ProxyConfig, client: EncoderCacheClient | None = None, *,
                 make_client: Callable[[str], EncoderCacheClient] | None = None) -> None:
        self.cfg = cfg
        self._clients = Clients(make_client or (lambda model: new_client(cfg, model)), client)
        self._backends = Backends(cfg.backends)
        self._media = MediaReader(cfg)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_request_bytes)
        app.router.add_post(CHAT_PATH, self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.backend_timeout_s))

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        await self._clients.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP client of backends and remote media (made when the application starts)."""
        assert self._session is not None
        return self._session

    # --- handlers ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "encoders": list(self._clients.targets or self.cfg.encoders),
                                  "backends": list(self.cfg.backends), "models": self._clients.models})

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._forward("GET", "/v1/models", None, request)
        except HttpError as exc:
            return exc.response()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise HttpError(400, f"request body is not JSON: {exc}") from exc
            except web.HTTPRequestEntityTooLarge as exc:
                raise HttpError(413, f"request body over {self.cfg.max_request_bytes} bytes") from exc
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise HttpError(400, "request body must be an object with a 'messages' list")
            parts = await self._media.parts(body["messages"], video_fps(body), self.session)
            if not parts:  # nothing to encode: no encoder, no model id
                return await self._forward("POST", CHAT_PATH, body, request)
            model, source = await self._model_id(body, request)
            async with self._clients.use(model) as client:
                placements = await self._place(client, model, source, parts)
                client.release_placed(repeats(placements))  # the same image twice: one lease is enough
                rewrite(body, parts, placements, client)
                return await self._forward("POST", CHAT_PATH, body, request, client, placements)
        except HttpError as exc:
            return exc.response()

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
            return await asyncio.to_thread(client.place, [p.spec for p in parts])
        except ENCODE_FAILURES as exc:
            rule = encode_rule(exc)
            if rule.drops_client:  # the encoders refused the model id: it keeps no client
                self._clients.drop(model)
            raise rule.answer(exc, model, source) from exc

    # --- forwarding --------------------------------------------------------------------------

    async def _forward(self, method: str, path: str, body: dict[str, Any] | None, request: web.Request,
                       client: EncoderCacheClient | None = None,
                       placements: Sequence[Placement] = ()) -> web.StreamResponse:
        """Send the request to a backend and relay its answer; ``client`` placed the ``placements``."""
        session = self.session
        assert client is not None or not placements
        headers = passed_headers(request.headers)
        errors: list[str] = []
        for base in self._backends.order():
            try:
                resp = await session.request(method, base + path, json=body, headers=headers)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                errors.append(f"{base}: {exc or type(exc).__name__}")
                continue
            if resp.status >= 400 and client is not None and placements:
                # Refused or failed: its leases may never be pulled (a second release is harmless).
                client.release_placed(placements)
            async with resp:
                if resp.status >= 500 and client is not None and placements:
                    text = await resp.text()
                    why = await asyncio.to_thread(self._diagnose, client, placements)
                    raise HttpError(resp.status, f"backend {base} failed the request ({resp.status}: "
                                                 f"{error_message(text)}); {why}", kind="server_error")
                out = web.StreamResponse(status=resp.status, headers={
                    k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        if client is not None:
            client.release_placed(placements)  # nobody will pull them
        raise HttpError(502, f"no backend reachable ({'; '.join(errors)})", kind=UNAVAILABLE)

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
