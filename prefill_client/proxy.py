"""``epd proxy``: an OpenAI-compatible HTTP front that encodes media on our encoders, then forwards to vLLM.

For ``/v1/chat/completions`` (streaming or not), every ``image_url`` part is read (a ``data:`` URL;
a ``file://`` URL only under ``--allow-local-media``; an ``http(s)://`` URL only for a host in
``--allow-remote-media``), and so is every ``video_url`` part in vLLM's frame-sequence form
(``data:video/jpeg;base64,FRAME,FRAME,...``, at ``media_io_kwargs.video.fps``, default 1). All of
the request's media are sent in one ``Encode`` per encoder (rendezvous routing over the encoder
pool, fail-over included). Each part is then rewritten into vLLM's embeddings form without a
tensor::

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [t, h, w]}, "uuid": MM_HASH}
    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [t, h, w], "timestamps": [...]},
     "uuid": MM_HASH}

and the leased locations go in the request's ``ec_transfer_params``
(:mod:`prefill_client.vllm.params`), where the backend's ``EpdCacheConnector`` finds them and
pulls the rows, verified. The request then goes to a backend (round robin, the next one when one
is unreachable) and its answer comes back as it is, streamed when it streams.

Errors: bad media 400 (naming the part), cache full 429 with ``Retry-After``, no encoder
reachable 503, no backend reachable 502. When a backend fails a request that carried items
(vLLM answers 500 when its connector could not get them), the proxy asks the encoders what
became of the items and says so in the error. The proxy keeps no state a restart would lose:
leases it handed on end when the connector releases them, or at the encoder's lease ttl.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import aiohttp
import grpc
from aiohttp import web

from common.config import ProxyConfig, add_arguments, build
from common.errors import (
    CacheFullError,
    ConfigError,
    ECLoadFailure,
    EpdError,
    InvalidMediaError,
    LimitExceededError,
    LoadFailureReason,
)
from prefill_client.client import EncoderCacheClient, Placement
from prefill_client.encoder_conn import MediaSpec
from prefill_client.vllm.params import KEY as PARAMS_KEY
from prefill_client.vllm.params import to_params

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


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

    def rewritten(self, placed: Placement) -> dict[str, Any]:
        """vLLM's embeddings form of this part, without the tensor: what sizes its placeholders."""
        if self.spec.kind == "image":
            return {"type": "image_embeds", "image_embeds": {"image_grid_thw": list(placed.grid_thw)},
                    "uuid": placed.mm_hash}
        grid = list(placed.grid_thw)
        return {"type": "video_embeds", "uuid": placed.mm_hash, "video_embeds": {
            "video_grid_thw": grid, "timestamps": video_timestamps(len(self.spec.frames), self.fps, grid[0])}}


def video_timestamps(num_frames: int, fps: float, grid_t: int) -> list[float]:
    """Seconds of each temporal patch of a video of ``num_frames`` frames at ``fps``, all kept (the
    "<t seconds>" Qwen3-VL writes before each): the mean time of its frames, the last frame
    repeated to fill the last patch, as vLLM computes them for a frame sequence."""
    per_patch = -(-num_frames // grid_t)
    indices = list(range(num_frames)) + [num_frames - 1] * (grid_t * per_patch - num_frames)
    return [(indices[i] + indices[i + per_patch - 1]) / 2 / fps for i in range(0, len(indices), per_patch)]


class Proxy:
    """The HTTP application; one :class:`EncoderCacheClient` (no pulls: placements only)."""

    def __init__(self, cfg: ProxyConfig, client: EncoderCacheClient) -> None:
        self.cfg = cfg
        self.client = client
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

    # --- handlers ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "encoders": list(self.client.targets),
                                  "backends": list(self.cfg.backends)})

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._forward("GET", "/v1/models", None, request)
        except HttpError as exc:
            return exc.response()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        placements: list[Placement] = []
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
            if parts:
                placements = await self._place(parts)
                self.client.release_placed(_repeats(placements))  # the same image twice: one lease is enough
                for part, placed in zip(parts, placements):
                    part.content[part.index] = part.rewritten(placed)
                params = dict(body.get("ec_transfer_params") or {})
                params[PARAMS_KEY] = to_params(placements)[PARAMS_KEY]
                body["ec_transfer_params"] = params
            return await self._forward("POST", CHAT_PATH, body, request, placements)
        except HttpError as exc:
            return exc.response()

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

    async def _place(self, parts: Sequence[_Part]) -> list[Placement]:
        try:
            return await asyncio.to_thread(self.client.place, [p.spec for p in parts])
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
        except EpdError as exc:
            raise HttpError(502, f"encoding failed: {type(exc).__name__}: {exc}", kind="service_unavailable") from exc

    # --- forwarding --------------------------------------------------------------------------

    async def _forward(self, method: str, path: str, body: dict[str, Any] | None, request: web.Request,
                       placements: Sequence[Placement] = ()) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "x-request-id", "accept")}
        errors: list[str] = []
        start = next(self._backends)
        for k in range(len(self.cfg.backends)):
            base = self.cfg.backends[(start + k) % len(self.cfg.backends)].rstrip("/")
            try:
                resp = await self._session.request(method, base + path, json=body, headers=headers)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                errors.append(f"{base}: {exc or type(exc).__name__}")
                continue
            if resp.status >= 400 and placements:
                # Refused or failed: its leases may never be pulled (a second release is harmless).
                self.client.release_placed(placements)
            async with resp:
                if resp.status >= 500 and placements:
                    text = await resp.text()
                    why = await asyncio.to_thread(self._diagnose, placements)
                    raise HttpError(resp.status, f"backend {base} failed the request ({resp.status}: "
                                                 f"{_error_message(text)}); {why}", kind="server_error")
                out = web.StreamResponse(status=resp.status, headers={
                    k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        self.client.release_placed(placements)  # nobody will pull them
        raise HttpError(502, f"no backend reachable ({'; '.join(errors)})", kind="service_unavailable")

    def _diagnose(self, placements: Sequence[Placement]) -> str:
        """What became of a failed request's items, asked of their encoders (leases given back at once)."""
        notes: list[str] = []
        by_encoder: dict[str, list[str]] = {}
        for p in placements:
            by_encoder.setdefault(p.encoder, []).append(p.mm_hash)
        for target, hashes in by_encoder.items():
            conn = self.client.connection(target)
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


async def _serve(cfg: ProxyConfig, client: EncoderCacheClient) -> None:
    runner = web.AppRunner(Proxy(cfg, client).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = int(runner.addresses[0][1]) if runner.addresses else cfg.port
    logger.info("epd proxy listening on http://%s:%d (encoders %s, backends %s)", cfg.host, port,
                ",".join(cfg.encoders), ",".join(cfg.backends))
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
    client = EncoderCacheClient(
        cfg.encoders, cfg.model_id, transport_kind=cfg.transport, rpc_timeout_s=cfg.rpc_timeout_s,
        landing_blocks=1, local_cache_blocks=0, tls=cfg.tls, weights_digest=cfg.weights_digest,
        membership_refresh_s=cfg.membership_refresh_s)
    try:
        asyncio.run(_serve(cfg, client))
    finally:
        client.close()
    return 0
