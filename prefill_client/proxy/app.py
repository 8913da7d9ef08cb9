"""``epd proxy``: an OpenAI-compatible HTTP front that encodes media on our encoders, then forwards to vLLM.

For ``/v1/chat/completions`` (streaming or not), every ``image_url`` part is read (a ``data:`` URL;
a ``file://`` URL only under ``--allow-local-media``; an ``http(s)://`` URL only for a host in
``--allow-remote-media``), and so is every ``video_url`` part in vLLM's frame-sequence form
(``data:video/jpeg;base64,FRAME,FRAME,...``, at ``media_io_kwargs.video.fps``, default 1). All of
the request's media are sent in one ``Encode`` per encoder (rendezvous routing over the encoder
pool, fail-over included). Each part is then rewritten into vLLM's embeddings form without a
tensor, from the placeholder metadata the encoder answered for the item (whatever fields the
model declares; Qwen-VL's grid here)::

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]}, "uuid": MM_HASH}
    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [t, h, w], "timestamps": [...]},
     "uuid": MM_HASH}

A model that sizes its placeholders from the media itself (no metadata: LLaVA, Gemma 3, ...)
gets the media the encoder encoded, as a data URL, with ``"uuid": MM_HASH``: vLLM's processor
counts the placeholders, and the rows still come from the encoder.

and the leased locations go in the request's ``ec_transfer_params``
(:mod:`prefill_client.handoff`), where the backend's ``EpdCacheConnector`` finds them and
pulls the rows, verified. The request then goes to a backend (round robin, the next one when one
is unreachable) and its answer comes back as it is, streamed when it streams.

The model id sent in the encoder handshake is ``--model-id`` when given; else the request's
``model``, else the one model the backends' ``/v1/models`` lists (asked once): one
:class:`EncoderCacheClient` per model id, made on first use, at most :data:`MAX_MODELS` at once.
A request without media needs no encoder, and no model id.

Errors: bad media or a bad ``model`` 400 (naming the part or the model), cache full 429 with
``Retry-After``, no encoder reachable 503, the encoders refuse the model id 502 (naming both
ids), no backend reachable 502. When a backend fails a request that carried items
(vLLM answers 500 when its connector could not get them), the proxy asks the encoders what
became of the items and says so in the error. The proxy keeps no state a restart would lose:
leases it handed on end when the connector releases them, or at the encoder's lease ttl.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import io
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import aiohttp
import grpc
from aiohttp import web
from PIL import Image

from common.config import ProxyConfig, add_arguments, build
from common.errors import (
    CacheFullError,
    ConfigError,
    ECLoadFailure,
    EpdError,
    HandshakeError,
    InvalidMediaError,
    LimitExceededError,
    LoadFailureReason,
    WeightsMismatchError,
)
from common.placeholder import as_json
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.handoff import Placement
from prefill_client.consumer.connection import MediaSpec
from prefill_client.handoff import KEY as PARAMS_KEY
from prefill_client.handoff import to_params

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
_PASSED_HEADERS = ("authorization", "x-request-id", "accept")
MAX_MODELS = 4  # encoder clients (model ids) at once without --model-id
MAX_MODEL_CHARS = 256  # as the encoder bounds the labels of a request
MODELS_TIMEOUT_S = 10.0  # deadline of asking a backend for /v1/models


class HttpError(Exception):
    """An answer for the caller: status, OpenAI-style error body, extra headers."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "code": self.status}}
        return web.json_response(body, status=self.status, headers=self.headers)


class _Part:
    """A media part of a request, where it sits, and its bytes (a video: its frames and their rate)."""

    def __init__(self, content: list[Any], index: int, label: str, spec: MediaSpec, fps: float = 0.0) -> None:
        self.content, self.index, self.label, self.spec, self.fps = content, index, label, spec, fps

    def rewritten(self, placed: Placement, *, ours: bool = False) -> dict[str, Any]:
        """The part as the backend gets it, named by ``uuid = mm_hash`` (the connector's identifier).

        With placeholder metadata from the encoder: vLLM's embeddings form without the tensor
        (``{"type": "image_embeds", "image_embeds": {FIELD: VALUE, ...}}``), whatever the
        fields. Without (a model that sizes its placeholders from the media itself), and for a
        video the vLLM tower encoded: the media the encoder encoded (an image as a data URL, a
        video as the request gave it), for vLLM's processor to lay out the prompt. ``ours``:
        the item comes from epd-cache's Qwen3-VL tower.
        """
        kind = self.spec.kind
        # An encoder of before placeholder fields answers the Qwen grid alone.
        fields = as_json(placed.placeholder) or (
            {f"{kind}_grid_thw": list(placed.grid_thw)} if placed.grid_thw else {})
        # A video from vLLM's tower goes as it came: a model's placeholder metadata sizes the range
        # but may leave out the timing its positions take (Qwen2.5-VL's second_per_grid_ts).
        if not fields or (kind == "video" and not ours):
            if kind == "image":
                return {"type": "image_url", "image_url": {"url": _data_url(self.spec.frames[0])},
                        "uuid": placed.mm_hash}
            return {**self.content[self.index], "uuid": placed.mm_hash}
        if ours and kind == "video" and "timestamps" not in fields:
            # epd-cache's Qwen3-VL tower (``ours``) encodes the frames without the request's frame
            # rate: the "<t seconds>" Qwen3-VL writes for each temporal patch come from it here.
            fields["timestamps"] = video_timestamps(len(self.spec.frames), self.fps, fields["video_grid_thw"][0])
        return {"type": f"{kind}_embeds", f"{kind}_embeds": fields, "uuid": placed.mm_hash}


def _data_url(data: bytes) -> str:
    """``data:image/FORMAT;base64,...`` of encoded image bytes (the format from their header)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = (image.format or "png").lower()
    except (OSError, ValueError):
        fmt = "png"  # the encoder decoded it; the backend's decoder reads the bytes, not the name
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


def video_timestamps(num_frames: int, fps: float, grid_t: int) -> list[float]:
    """Seconds of each temporal patch of a video of ``num_frames`` frames at ``fps``, all kept (the
    "<t seconds>" Qwen3-VL writes before each): the mean time of its frames, the last frame
    repeated to fill the last patch, as vLLM computes them for a frame sequence."""
    per_patch = -(-num_frames // grid_t)
    indices = list(range(num_frames)) + [num_frames - 1] * (grid_t * per_patch - num_frames)
    return [(indices[i] + indices[i + per_patch - 1]) / 2 / fps for i in range(0, len(indices), per_patch)]


@dataclass
class _Entry:
    """A model id's client, the requests using it, and whether it was dropped (closed when unused)."""

    client: EncoderCacheClient
    users: int = 0
    dropped: bool = False


class _Clients:
    """The proxy's encoder clients, one per model id: ``fixed`` (``--model-id``) for every model,
    else one made by ``make`` on a model's first use, at most ``limit`` at once. A client the
    encoders refused in the handshake is dropped, so names nobody serves keep no place."""

    def __init__(self, make: Callable[[str], EncoderCacheClient], fixed: EncoderCacheClient | None,
                 limit: int = MAX_MODELS) -> None:
        self._make, self._limit = make, limit
        self._fixed = _Entry(fixed) if fixed is not None else None
        self._entries: dict[str, _Entry] = {}
        self._creating = asyncio.Lock()

    @property
    def fixed_model(self) -> str | None:
        """The model id of the fixed client, if there is one."""
        return self._fixed.client.model_id if self._fixed is not None else None

    @property
    def models(self) -> list[str]:
        """The model ids with a client now."""
        return [self._fixed.client.model_id] if self._fixed is not None else list(self._entries)

    @property
    def targets(self) -> tuple[str, ...] | None:
        """The encoders a client knows now; None before the first client."""
        entries = [self._fixed] if self._fixed is not None else list(self._entries.values())
        return entries[0].client.targets if entries else None

    @contextlib.asynccontextmanager
    async def use(self, model: str) -> AsyncIterator[EncoderCacheClient]:
        """The client for ``model`` while the block runs (a client dropped meanwhile closes after it)."""
        entry = self._fixed or await self._get(model)
        entry.users += 1
        try:
            yield entry.client
        finally:
            entry.users -= 1
            if entry.dropped and entry.users == 0:
                await asyncio.to_thread(entry.client.close)

    async def _get(self, model: str) -> _Entry:
        entry = self._entries.get(model)
        if entry is not None:  # not behind the lock: a client being made must not hold up the others
            return entry
        async with self._creating:  # one client per model, even for requests that arrive together
            entry = self._entries.get(model)
            if entry is not None:
                return entry
            if len(self._entries) >= self._limit:
                raise HttpError(400, f"model {model!r}: epd proxy already has encoder clients for {self._limit} "
                                     f"models ({', '.join(map(repr, self._entries))}), its most; start it with "
                                     f"--model-id to serve one model id")
            try:
                client = await asyncio.to_thread(self._make, model)
            except EpdError as exc:  # ConfigError: a target that does not resolve
                raise HttpError(503, f"cannot reach the encoders: {exc}", kind="service_unavailable") from exc
            entry = self._entries[model] = _Entry(client)
            logger.info("encoder client for model %r (%d of at most %d)", model, len(self._entries), self._limit)
            return entry

    def drop(self, model: str) -> None:
        """Forget ``model``'s client (not the fixed one): the next request makes a new one."""
        entry = self._entries.pop(model, None)
        if entry is not None:
            entry.dropped = True

    async def close(self) -> None:
        """Close the clients made here (the fixed one is its owner's)."""
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            await asyncio.to_thread(entry.client.close)


def new_client(cfg: ProxyConfig, model_id: str) -> EncoderCacheClient:
    """The proxy's client for one model id (no pulls: placements only)."""
    return EncoderCacheClient(
        cfg.encoders, model_id, transport_kind=cfg.transport, rpc_timeout_s=cfg.rpc_timeout_s,
        landing_blocks=1, local_cache_blocks=0, tls=cfg.tls, weights_digest=cfg.weights_digest,
        membership_refresh_s=cfg.membership_refresh_s)


class Proxy:
    """The HTTP application over encoder clients (:class:`_Clients`).

    ``client``: the one client of every request (``--model-id``), its caller's to close; without
    it, ``make_client(model_id)`` makes one per model id (default :func:`new_client`), closed here.
    """

    def __init__(self, cfg: ProxyConfig, client: EncoderCacheClient | None = None, *,
                 make_client: Callable[[str], EncoderCacheClient] | None = None) -> None:
        self.cfg = cfg
        self._clients = _Clients(make_client or (lambda model: new_client(cfg, model)), client)
        self._served: list[str] | None = None  # the backends' /v1/models, once asked
        self._served_lock = asyncio.Lock()
        self._backends = itertools.cycle(range(len(cfg.backends)))
        self._session: aiohttp.ClientSession | None = None
        self._local_root = Path(cfg.allow_local_media).resolve() if cfg.allow_local_media else None

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
            parts = await self._media_parts(body["messages"], _video_fps(body))
            if not parts:  # nothing to encode: no encoder, no model id
                return await self._forward("POST", CHAT_PATH, body, request)
            model, source = await self._model_id(body, request)
            async with self._clients.use(model) as client:
                placements = await self._place(client, model, source, parts)
                client.release_placed(_repeats(placements))  # the same image twice: one lease is enough
                for part, placed in zip(parts, placements):
                    conn = client.connection(placed.encoder)
                    ours = conn is not None and conn.tower == "qwen3vl"
                    part.content[part.index] = part.rewritten(placed, ours=ours)
                params = dict(body.get("ec_transfer_params") or {})
                params[PARAMS_KEY] = to_params(placements)[PARAMS_KEY]
                body["ec_transfer_params"] = params
                return await self._forward("POST", CHAT_PATH, body, request, client, placements)
        except HttpError as exc:
            return exc.response()

    # --- model id ----------------------------------------------------------------------------

    async def _model_id(self, body: dict[str, Any], request: web.Request) -> tuple[str, str]:
        """The model id for the encoder handshake, and where it came from (for error messages)."""
        fixed = self._clients.fixed_model or self.cfg.model_id
        if fixed is not None:
            return fixed, "--model-id"
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str) or not model.strip():
                raise HttpError(400, f"model must be a non-empty string, got {model!r:.80}")
            if len(model) > MAX_MODEL_CHARS:
                raise HttpError(400, f"model is {len(model)} characters; at most {MAX_MODEL_CHARS}")
            return model, "the request's model"
        served = await self._served_models(request)
        if len(served) == 1:
            return served[0], "the one model of the backends' /v1/models"
        if not served:
            raise HttpError(400, "'model' is required: the backends' /v1/models lists no model")
        raise HttpError(400, f"'model' is required: the backends serve {len(served)} models "
                             f"({', '.join(repr(m) for m in served)})")

    async def _served_models(self, request: web.Request) -> list[str]:
        """The model names the backends' ``/v1/models`` lists (asked once; a failure is not kept)."""
        async with self._served_lock:  # requests that arrive together ask once
            if not self._served:  # an empty list is asked again
                self._served = await self._ask_models(request)
            return self._served

    def _backend_order(self) -> list[str]:
        """Every backend's base URL, from the next one in the round robin on."""
        start, count = next(self._backends), len(self.cfg.backends)
        return [self.cfg.backends[(start + k) % count].rstrip("/") for k in range(count)]

    async def _ask_models(self, request: web.Request) -> list[str]:
        assert self._session is not None
        errors: list[str] = []
        for base in self._backend_order():
            try:
                async with self._session.get(base + "/v1/models", headers=_passed_headers(request),
                                             timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(f"{base}: {exc or type(exc).__name__}")
                continue
            if resp.status in (401, 403):  # the caller's credentials: theirs to fix
                raise HttpError(resp.status, f"'model' is not given and {base}/v1/models answered "
                                             f"{resp.status}: {_error_message(text)}", kind="authentication_error")
            names = _model_names(text) if resp.status == 200 else None
            if names is None:
                errors.append(f"{base}: /v1/models answered {resp.status}: {_error_message(text)}")
                continue
            logger.info("the backends serve %s", ", ".join(names) or "no model")
            return names
        raise HttpError(502, f"'model' is not given and no backend listed its models ({'; '.join(errors)})",
                        kind="service_unavailable")

    # --- media -------------------------------------------------------------------------------

    async def _media_parts(self, messages: list[Any], video_fps: float) -> list[_Part]:
        parts: list[_Part] = []
        for m, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for p, part in enumerate(content):
                if not isinstance(part, dict):
                    continue
                label = f"messages[{m}].content[{p}]"
                kind = part.get("type")
                if kind == "image_url":
                    data = await self._read_url(_part_url(part, kind, label), label)
                    parts.append(_Part(content, p, label, MediaSpec.image(data, uuid=label)))
                elif kind == "video_url":
                    frames = _video_frames(_part_url(part, kind, label), label)
                    # fps 0: the encoder keeps every frame, as vLLM does with a frame sequence.
                    parts.append(_Part(content, p, label, MediaSpec.video(frames, 0.0, uuid=label), video_fps))
                elif kind in ("input_audio", "audio_url"):
                    raise HttpError(400, f"{label}: {kind} parts are not supported by epd proxy (images and videos)")
        return parts

    async def _read_url(self, url: str, label: str) -> bytes:
        if url.startswith("data:"):
            head, sep, payload = url.partition(",")
            if not sep or not head.endswith(";base64"):
                raise HttpError(400, f"{label}: a data URL must be base64 (data:<type>;base64,...)")
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise HttpError(400, f"{label}: data URL is not valid base64 ({exc})") from exc
        parsed = urlparse(url)
        if parsed.scheme == "file":
            return await asyncio.to_thread(self._read_local, unquote(parsed.path), label)
        if parsed.scheme in ("http", "https"):
            if parsed.hostname not in self.cfg.allow_remote_media:
                raise HttpError(400, f"{label}: remote media URLs are refused (host {parsed.hostname!r} is "
                                     f"not in --allow-remote-media)")
            return await self._fetch(url, label)
        raise HttpError(400, f"{label}: unsupported media URL scheme {parsed.scheme!r}")

    def _read_local(self, path: str, label: str) -> bytes:
        if self._local_root is None:
            raise HttpError(400, f"{label}: local files are refused (start the proxy with --allow-local-media DIR)")
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(self._local_root):
            raise HttpError(400, f"{label}: {path} is outside --allow-local-media {self._local_root}")
        try:
            if resolved.stat().st_size > self.cfg.max_request_bytes:
                raise HttpError(400, f"{label}: {path} is over {self.cfg.max_request_bytes} bytes")
            return resolved.read_bytes()
        except OSError as exc:
            raise HttpError(400, f"{label}: cannot read {path}: {exc.strerror}") from exc

    async def _fetch(self, url: str, label: str) -> bytes:
        assert self._session is not None
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=self.cfg.media_fetch_timeout_s)) as r:
                if r.status != 200:
                    raise HttpError(400, f"{label}: fetching {url} answered {r.status}")
                data = await r.content.read(self.cfg.max_request_bytes + 1)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise HttpError(400, f"{label}: cannot fetch {url}: {exc or type(exc).__name__}") from exc
        if len(data) > self.cfg.max_request_bytes:
            raise HttpError(400, f"{label}: {url} is over {self.cfg.max_request_bytes} bytes")
        return data

    async def _place(self, client: EncoderCacheClient, model: str, source: str,
                     parts: Sequence[_Part]) -> list[Placement]:
        try:
            return await asyncio.to_thread(client.place, [p.spec for p in parts])
        except InvalidMediaError as exc:
            raise HttpError(400, str(exc)) from exc
        except CacheFullError as exc:
            seconds = max(1, -(-exc.retry_after_ms // 1000))
            raise HttpError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": str(seconds)}) from exc
        except LimitExceededError as exc:
            raise HttpError(400, str(exc)) from exc
        except ECLoadFailure as exc:
            status = 503 if exc.reason in (LoadFailureReason.HANDSHAKE, LoadFailureReason.DISCONNECT) else 502
            raise HttpError(status, f"encoding failed: {exc}", kind="service_unavailable") from exc
        except grpc.RpcError as exc:
            raise HttpError(503, f"encoder error: {exc.code().name}: {exc.details()}", kind="service_unavailable") from exc
        except HandshakeError as exc:
            if isinstance(exc, WeightsMismatchError):
                raise HttpError(502, f"encoding failed: {exc}", kind="service_unavailable") from exc
            self._clients.drop(model)
            hint = ("epd proxy's --model-id must be the encoders'" if source == "--model-id" else
                    "the encoders' --model-id must be the name vLLM serves the model under, or start epd proxy "
                    "with --model-id set to the encoders'")
            # The encoder's message names both model ids ("this encoder serves 'X', request names 'Y'").
            raise HttpError(502, f"the encoders refused the handshake for model {model!r} (from {source}): "
                                 f"{exc} ({hint})", kind="service_unavailable") from exc
        except EpdError as exc:
            raise HttpError(502, f"encoding failed: {type(exc).__name__}: {exc}", kind="service_unavailable") from exc

    # --- forwarding --------------------------------------------------------------------------

    async def _forward(self, method: str, path: str, body: dict[str, Any] | None, request: web.Request,
                       client: EncoderCacheClient | None = None,
                       placements: Sequence[Placement] = ()) -> web.StreamResponse:
        """Send the request to a backend and relay its answer; ``client`` placed the ``placements``."""
        assert self._session is not None
        assert client is not None or not placements
        headers = _passed_headers(request)
        errors: list[str] = []
        for base in self._backend_order():
            try:
                resp = await self._session.request(method, base + path, json=body, headers=headers)
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
                                                 f"{_error_message(text)}); {why}", kind="server_error")
                out = web.StreamResponse(status=resp.status, headers={
                    k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        if client is not None:
            client.release_placed(placements)  # nobody will pull them
        raise HttpError(502, f"no backend reachable ({'; '.join(errors)})", kind="service_unavailable")

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
            except grpc.RpcError as exc:
                notes.append(f"encoder {target} is unreachable ({exc.code().name})")
                continue
            except EpdError as exc:
                notes.append(f"encoder {target}: {exc}")
                continue
            conn.release([loc.lease_id for loc in found if loc is not None])
            gone = [h for h, loc in zip(hashes, found) if loc is None]
            if gone:
                notes.append(f"item {', '.join(gone)} is no longer on encoder {target} (evicted)")
        return "; ".join(notes) if notes else "its items are still on their encoders (see the backend's log)"


def _part_url(part: dict[str, Any], kind: str, label: str) -> str:
    """The URL of an ``image_url`` / ``video_url`` part (``{"url": ...}`` or the bare string)."""
    url = part.get(kind)
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise HttpError(400, f"{label}: {kind} has no url")
    return url


def _video_frames(url: str, label: str) -> list[bytes]:
    """The frames of a ``data:video/jpeg;base64,FRAME,FRAME,...`` URL (vLLM's frame-sequence form)."""
    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or head.lower() != "data:video/jpeg;base64":
        raise HttpError(400, f"{label}: videos must be frame sequences, data:video/jpeg;base64,FRAME,FRAME,... "
                             f"(epd proxy does not decode video containers)")
    try:
        return [base64.b64decode(frame, validate=True) for frame in payload.split(",")]
    except (binascii.Error, ValueError) as exc:
        raise HttpError(400, f"{label}: a frame of the video is not valid base64 ({exc})") from exc


def _video_fps(body: dict[str, Any]) -> float:
    """The frame rate vLLM assumes for the request's frame sequences: ``media_io_kwargs.video.fps``, else 1."""
    kwargs = body.get("media_io_kwargs")
    video = kwargs.get("video") if isinstance(kwargs, dict) else None
    fps = video.get("fps", 1.0) if isinstance(video, dict) else 1.0
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise HttpError(400, f"media_io_kwargs.video.fps must be a positive number, got {fps!r}")
    return float(fps)


def _repeats(placements: Sequence[Placement]) -> list[Placement]:
    """Placements of an mm_hash placed before in the same request."""
    seen: set[str] = set()
    out: list[Placement] = []
    for p in placements:
        if p.mm_hash in seen:
            out.append(p)
        seen.add(p.mm_hash)
    return out


def _passed_headers(request: web.Request) -> dict[str, str]:
    """The caller's headers a backend gets too (its credentials, its request id)."""
    return {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}


def _model_names(text: str) -> list[str] | None:
    """The model names of an OpenAI ``/v1/models`` answer (``{"data": [{"id": NAME}, ...]}``), or None."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return None
    names = [m.get("id") for m in models if isinstance(m, dict)]
    return [n for n in names if isinstance(n, str) and n] if len(names) == len(models) else None


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:200]
    return text[:200]


# --- CLI -----------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd proxy", description="OpenAI-compatible front: encode media on epd encoders, forward to vLLM")
    add_arguments(parser, ProxyConfig)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


async def _serve(cfg: ProxyConfig, client: EncoderCacheClient | None) -> None:
    runner = web.AppRunner(Proxy(cfg, client).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = int(runner.addresses[0][1]) if runner.addresses else cfg.port
    logger.info("epd proxy listening on http://%s:%d (encoders %s, backends %s, model id %s)", cfg.host, port,
                ",".join(cfg.encoders), ",".join(cfg.backends),
                cfg.model_id or "from each request's model, else the backends' /v1/models")
    print(json.dumps({"proxy_port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        cfg = build(ProxyConfig, args, dict(os.environ))
    except ConfigError as exc:
        print(f"epd proxy: {exc}", file=sys.stderr)
        return 2
    # --model-id: one client, made now, for every request; else one per model id, made on first use.
    client = new_client(cfg, cfg.model_id) if cfg.model_id is not None else None
    try:
        asyncio.run(_serve(cfg, client))
    finally:
        if client is not None:
            client.close()
    return 0
