"""The proxy's front door: API keys, the in-flight bound, what each request counts as (proxy process).

Every route but the open ones (``/health``, ``/ready``, ``/metrics``: probes and scrapes) goes
through :meth:`Front.middleware` before its handler runs, so before its body is read, any media
is fetched or any encoder is called:

1. its ``Authorization: Bearer KEY`` must name one of the proxy's keys (``--api-key``,
   ``--api-key-file``), else 401 ``authentication_error`` (:class:`common.api_keys.ApiKeys`:
   compared so that the time a check takes says nothing about any key);
2. it must fit under ``--max-inflight``, else 429 ``rate_limit_error`` with ``Retry-After: 1``
   at once: a front that queued without bound would hold every waiting body in memory;
3. it is then in flight until its answer is relayed in full (a stream's too); its route,
   status and latency are counted when it ends.

A caller that sends ``Expect: 100-continue`` hears steps 1 and 2's refusal instead of "100
Continue" (:meth:`Front.expect`), so it never sends the body at all.

What happens between the proxy and its backends (requests in flight per backend, the time to
their answers' first byte, their failures) is counted by hooks on the HTTP client
(:meth:`Front.trace_config`), in the context of the request that made the call, so the
forwarding code carries no metric calls. The metrics: :class:`common.metrics.ProxyMetrics`.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from common.api_keys import ApiKeys
from common.config import ProxyConfig
from common.errors import ConfigError
from common.metrics import ProxyMetrics
from common.wire import pb2
from prefill_client.handoff import Placement
from prefill_client.proxy.errors import AUTHENTICATION, RATE_LIMITED, SERVER_ERROR, HttpError

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: no key, not counted
RETRY_AFTER_S = 1  # what a request over --max-inflight is told: requests in flight end all the time
OTHER_ROUTE = "other"  # the route label of a path the proxy does not serve (not one label per path)
_MEDIA_PARTS = ("image_url", "video_url")  # the parts media.py reads


def load_api_keys(cfg: ProxyConfig) -> ApiKeys:
    """``--api-key`` and the keys of ``--api-key-file`` (one a line, blank lines skipped), read now.

    A file that cannot be read, holds no key or a key with a space is a :class:`ConfigError`:
    a proxy started with a key file it cannot use must not start open, nor closed to everyone.
    """
    keys = list(cfg.api_keys)
    if cfg.api_key_file is not None:
        try:
            lines = Path(cfg.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --api-key-file {cfg.api_key_file}: {exc}") from exc
        found = [(number, line.strip()) for number, line in enumerate(lines, 1) if line.strip()]
        if not found:
            raise ConfigError(f"--api-key-file {cfg.api_key_file} holds no key")
        for number, key in found:
            if any(c.isspace() for c in key):
                raise ConfigError(f"--api-key-file {cfg.api_key_file}: the key on line {number} has a space")
        keys += [key for _, key in found]
    return ApiKeys(keys)


def rejection_reason(error: HttpError) -> str | None:
    """Why the proxy refused a request with ``error`` (a label of ``epd_proxy_rejections``), or None
    when the error is a backend's failure relayed (counted as a backend error instead)."""
    if error.kind == SERVER_ERROR:
        return None
    if error.status in (401, 403):
        return "auth"
    if error.status == 429:  # the encoders' cache is pinned full; over --max-inflight is counted at the door
        return "cache_full"
    return "bad_request" if error.status < 500 else "unavailable"


@dataclass(slots=True)
class _Admitted:
    """One admitted request, as the hooks that count its backend calls and its end see it."""

    route: str
    started: float
    media_items: int = 0  # media parts in its body, once read
    placed: bool = False  # its media are on the encoders
    sent: list[str] = field(default_factory=list)  # backends whose answer is not relayed in full yet
    answered_by: str = ""  # the backend whose answer is being relayed
    status_sent: int = 0  # the status its answer went out with, once it did


_ADMITTED: contextvars.ContextVar[_Admitted | None] = contextvars.ContextVar("epd_proxy_admitted", default=None)


class Front:
    """The door every request but the open routes goes through (:meth:`middleware`), and the
    hooks that count its calls to the backends (:meth:`trace_config`).

    ``backends``: the backends' base URLs now (calls to other hosts, e.g. remote media, are not
    backend calls). ``max_inflight`` 0: no bound.
    """

    def __init__(self, keys: ApiKeys, max_inflight: int, metrics: ProxyMetrics,
                 backends: Callable[[], Sequence[str]]) -> None:
        self.keys = keys
        self.max_inflight = max_inflight
        self.metrics = metrics
        self._backends = backends
        self.inflight = 0  # admitted requests not yet answered in full, in this process

    # --- the door ------------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        route = _route(request)
        refused = self._refused(request, route)
        if refused is not None:
            return refused
        admitted = _Admitted(route, time.monotonic())
        token = _ADMITTED.set(admitted)
        self.inflight += 1
        self.metrics.requests_running.inc()
        status = 500  # what aiohttp answers an exception that escapes the handler with
        try:
            response = await handler(request)
            status = response.status
            return response
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:  # a route the proxy does not serve
            status = exc.status
            return unserved(request, exc).response()
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # The backend's answer broke off while it was relayed (a caller that hung up is not its fault).
            if admitted.answered_by and not _caller_left(request):
                kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "stream"
                self.metrics.backend_errors.labels(backend=admitted.answered_by, kind=kind).inc()
            raise
        finally:
            _ADMITTED.reset(token)
            self.inflight -= 1
            self.metrics.requests_running.dec()
            for backend in admitted.sent:
                self.metrics.backend_running.labels(backend=backend).dec()
            status = admitted.status_sent or status  # an answer that broke off went out with its own
            self.metrics.requests.labels(route=route, code=str(status)).inc()
            self.metrics.e2e_latency.labels(route=route).observe(time.monotonic() - admitted.started)
            if 400 <= status < 500 and admitted.media_items and not admitted.placed:
                self.metrics.media_items.labels(outcome="refused").inc(admitted.media_items)

    async def expect(self, request: web.Request) -> web.Response | None:
        """(A route's ``expect_handler``) A request sent with ``Expect: 100-continue`` hears the
        door's refusal instead of "100 Continue": its body is never asked for. Else it is asked
        for, as aiohttp's own handler does, and the request then goes through :meth:`middleware`."""
        refused = self._refused(request, _route(request))
        if refused is not None:
            return refused
        expect = request.headers.get(hdrs.EXPECT, "")
        if request.version != aiohttp.HttpVersion11:
            return None
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes start after it
        return None

    def _refused(self, request: web.Request, route: str) -> web.Response | None:
        """The door's answer for a request it does not let in (no valid key; over the bound), or None."""
        if self.keys and not self.keys.allows(request.headers.get(hdrs.AUTHORIZATION)):
            return self._turn_away(route, "auth", HttpError(
                401, "a valid API key is required (Authorization: Bearer KEY)", kind=AUTHENTICATION))
        if self.max_inflight and self.inflight >= self.max_inflight:
            return self._turn_away(route, "inflight", HttpError(
                429, f"epd proxy is serving {self.inflight} requests, its most (--max-inflight); retry after "
                     f"{RETRY_AFTER_S} s", kind=RATE_LIMITED, headers={"Retry-After": str(RETRY_AFTER_S)}))
        return None

    def _turn_away(self, route: str, reason: str, error: HttpError) -> web.Response:
        self.metrics.rejections.labels(reason=reason).inc()
        self.metrics.requests.labels(route=route, code=str(error.status)).inc()
        return error.response()

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """(``Application.on_response_prepare``) The status an admitted request's answer goes out with."""
        admitted = _ADMITTED.get()
        if admitted is not None:
            admitted.status_sent = response.status

    # --- what a handler reports ----------------------------------------------------------------

    def refusal(self, error: HttpError) -> web.Response:
        """The answer for an error a handler found, counted by its reason (:func:`rejection_reason`)."""
        reason = rejection_reason(error)
        if reason is not None:
            self.metrics.rejections.labels(reason=reason).inc()
        return error.response()

    def media_read(self, items: int) -> None:
        """The request has ``items`` media parts (refused together if it is refused before placing them)."""
        admitted = _ADMITTED.get()
        if admitted is not None:
            admitted.media_items = items

    def placed(self, placements: Sequence[Placement]) -> None:
        """The request's media are on the encoders: hits (the encoder had the item) and misses."""
        admitted = _ADMITTED.get()
        if admitted is not None:
            admitted.placed = True
        hits = sum(1 for p in placements if p.location.result == pb2.CACHE_RESULT_HIT)
        self.metrics.media_items.labels(outcome="hit").inc(hits)
        self.metrics.media_items.labels(outcome="miss").inc(len(placements) - hits)

    # --- the backends' side --------------------------------------------------------------------

    def trace_config(self) -> aiohttp.TraceConfig:
        """Hooks for the HTTP client that calls the backends (``ClientSession(trace_configs=...)``)."""
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._backend_called)
        trace.on_request_end.append(self._backend_answered)
        trace.on_request_exception.append(self._backend_failed)
        return trace

    def _backend_of(self, url: str) -> str:
        for base in self._backends():
            if url == base or url.startswith(base.rstrip("/") + "/"):
                return base
        return ""

    async def _backend_called(self, session: aiohttp.ClientSession, ctx: SimpleNamespace,
                              params: aiohttp.TraceRequestStartParams) -> None:
        admitted = _ADMITTED.get()
        ctx.backend = self._backend_of(str(params.url)) if admitted is not None else ""
        if admitted is None or not ctx.backend:
            return
        ctx.called = time.monotonic()
        admitted.sent.append(ctx.backend)
        self.metrics.backend_running.labels(backend=ctx.backend).inc()

    async def _backend_answered(self, session: aiohttp.ClientSession, ctx: SimpleNamespace,
                                params: aiohttp.TraceRequestEndParams) -> None:
        admitted = _ADMITTED.get()
        if admitted is None or not ctx.backend:
            return
        # Status line and headers: for a stream, when vLLM starts it (vllm:time_to_first_token_seconds
        # has the first token); for a whole answer, when it is done.
        self.metrics.backend_ttfb.labels(backend=ctx.backend).observe(time.monotonic() - ctx.called)
        admitted.answered_by = ctx.backend
        if params.response.status >= 500:
            self.metrics.backend_errors.labels(backend=ctx.backend, kind="server_error").inc()

    async def _backend_failed(self, session: aiohttp.ClientSession, ctx: SimpleNamespace,
                              params: aiohttp.TraceRequestExceptionParams) -> None:
        admitted = _ADMITTED.get()
        if admitted is None or not ctx.backend:
            return
        kind = "timeout" if isinstance(params.exception, asyncio.TimeoutError) else "connect"
        self.metrics.backend_errors.labels(backend=ctx.backend, kind=kind).inc()
        admitted.sent.remove(ctx.backend)  # no answer to relay: it is not in flight any more
        self.metrics.backend_running.labels(backend=ctx.backend).dec()


def _route(request: web.Request) -> str:
    """The route a request matched (its pattern), or :data:`OTHER_ROUTE`."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else OTHER_ROUTE


def unserved(request: web.Request, exc: web.HTTPException) -> HttpError:
    """An OpenAI-form answer for a path or method the proxy does not serve, naming what it serves
    (``Allow`` kept on a 405)."""
    served = sorted({f"{route.method} {route.resource.canonical}" for route in request.app.router.routes()
                     if route.resource is not None and route.method != hdrs.METH_HEAD})
    allow = {"Allow": exc.headers[hdrs.ALLOW]} if hdrs.ALLOW in exc.headers else None
    return HttpError(exc.status, f"epd proxy does not serve {request.method} {request.path}; it serves "
                                 f"{', '.join(served)}", headers=allow)


def _caller_left(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def count_media_parts(messages: list[object]) -> int:
    """The media parts (``image_url``, ``video_url``) of a chat request's messages, unread."""
    return sum(1 for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") in _MEDIA_PARTS)
