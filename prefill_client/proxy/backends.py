"""The vLLM servers behind the proxy: their list, which one gets a request, their models (proxy process).

The list (``--backend``) holds base URLs, ``dns:///NAME:PORT`` names (a headless Service: one
``http://ADDR:PORT`` per address) and ``file:PATH`` lists, resolved as the encoder targets are
(:func:`prefill_client.consumer.routing.resolve_targets`) and again every refresh interval, in
the background of the event loop; a resolution that fails keeps the last set. A backend that
leaves the set keeps its requests in flight. A request tries the backends in the order of the
routing policy (:mod:`.routing`) over those that take requests, then the ones marked down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from common.errors import ConfigError
from prefill_client.consumer.routing import file_targets, resolve_targets
from prefill_client.handoff import PREFETCH_HEADER, Placement, prefetch_hint
from prefill_client.proxy.errors import UNAVAILABLE, HttpError
from prefill_client.proxy.routing import Policy, RoundRobin

logger = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 10.0  # deadline of asking a backend for /v1/models
RESOLVE_TIMEOUT_S = 10.0  # deadline of resolving the backend list once (DNS, a file)
DEFAULT_RETRY_S = 5.0
DEFAULT_REFRESH_S = 2.0
_PASSED_HEADERS = ("authorization", "x-request-id", "accept")
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"  # text prompts only: passed on as the caller wrote them
# A backend's headers that describe its own connection and framing, not the answer: never relayed.
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
_URL_SCHEMES = ("http://", "https://")


@dataclass(slots=True)
class _Backend:
    """One backend's state in this proxy process."""

    outstanding: int = 0  # requests sent and not yet answered in full
    down_until: float | None = None  # marked down: no requests before then (None: up)
    probes: int = 0  # requests trying it while it is down: no other until they are answered

    def takes_requests(self, now: float) -> bool:
        return self.down_until is None or (self.down_until <= now and not self.probes)


class Backends:
    """The backends (base URLs, kept current), the order a request tries them in (``policy``, default
    :class:`~.routing.RoundRobin`), their requests in flight and failures, and the model names their
    ``/v1/models`` lists (asked once).

    ``retry_s``: how long a backend that failed gets no requests; ``refresh_s``: how often
    ``dns:///`` and ``file:`` entries are resolved again (0: never); ``clock``: seconds, monotonic.
    """

    def __init__(self, specs: Sequence[str], policy: Policy | None = None, *, retry_s: float = DEFAULT_RETRY_S,
                 refresh_s: float = DEFAULT_REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.specs = tuple(specs)
        self.retry_s = retry_s
        self.refresh_s = refresh_s
        self._policy = policy or RoundRobin()
        self._clock = clock
        self._known: dict[str, _Backend] = {}
        self._unresolved = ""  # why the list resolved to nothing yet
        self._refreshing: asyncio.Task[None] | None = None
        self._served: list[str] | None = None  # the backends' /v1/models, once asked
        self._served_lock = asyncio.Lock()
        # Plain URLs never change; names and files are read again.
        self._dynamic = not all(spec.startswith(_URL_SCHEMES) for spec in self.specs)
        self._next_refresh = clock() + refresh_s
        try:
            self._apply(resolve_backends(self.specs))
        except ConfigError as exc:  # e.g. the Service has no pod yet: requests answer 502 until it has
            self._unresolved = str(exc)
            logger.warning("the backends did not resolve (%s); trying again every %.0f s", exc, refresh_s)

    @property
    def urls(self) -> tuple[str, ...]:
        """Every known backend's base URL, up or down, in the order resolved."""
        return tuple(self._known)

    def order(self, key: Callable[[], str] = lambda: "") -> list[str]:
        """The base URLs to try for one request, the first choice first: the policy's order of the
        backends that take requests, then those marked down, the soonest due first (tried only when
        the others fail). ``key``: the request's affinity key, computed only when the policy asks.
        Called on the event loop: it starts a background resolution when one is due."""
        self._refresh_when_due()
        now = self._clock()
        known = dict(self._known)
        up = [url for url, b in known.items() if b.takes_requests(now)]
        down = sorted((url for url in known if url not in up), key=lambda url: known[url].down_until or 0.0)
        return self._policy.order(up, {url: known[url].outstanding for url in up}, key) + down

    @contextlib.contextmanager
    def sending(self, url: str) -> Iterator[None]:
        """Counts one request to ``url`` as outstanding while the block runs (sending it, relaying its
        answer); a request to a backend marked down is its probe. A backend that leaves the list
        meanwhile is counted on, unseen."""
        backend = self._known.get(url) or _Backend()
        probe = backend.down_until is not None
        backend.outstanding += 1
        backend.probes += probe
        try:
            yield
        finally:
            backend.outstanding -= 1
            backend.probes -= probe

    def failed(self, url: str, why: str) -> None:
        """``url`` refused a connection or timed out: no requests for ``retry_s``; resolve the list
        again soon (a pod that moved has a new address)."""
        backend = self._known.get(url)
        if backend is None:
            return
        if backend.down_until is None:
            logger.warning("backend %s is down (%s); no requests for %.0f s", url, why, self.retry_s)
        backend.down_until = self._clock() + self.retry_s
        self._next_refresh = min(self._next_refresh, self._clock())

    def outstanding(self, url: str) -> int:
        """``url``'s requests in flight from this process, the one being sent included."""
        backend = self._known.get(url)
        return backend.outstanding if backend is not None else 0

    def answered(self, url: str) -> None:
        """``url`` answered a request: it is up."""
        backend = self._known.get(url)
        if backend is not None and backend.down_until is not None:
            logger.info("backend %s answers again", url)
            backend.down_until = None

    def none_known(self) -> str:
        """Why no backend is known ("" when some are)."""
        return "" if self._known else f"no backend known: {self._unresolved or 'the list resolved to none'}"

    # --- the list ------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Resolve the list again (in a thread: DNS blocks); a failure keeps the last set."""
        try:
            urls = await asyncio.wait_for(asyncio.to_thread(resolve_backends, self.specs), RESOLVE_TIMEOUT_S)
        except (ConfigError, asyncio.TimeoutError) as exc:
            self._unresolved = str(exc) or f"resolving took over {RESOLVE_TIMEOUT_S:.0f} s"
            logger.warning("the backends did not resolve (%s); keeping %d known", self._unresolved,
                           len(self._known))
        else:
            self._apply(urls)
        finally:
            self._next_refresh = self._clock() + self.refresh_s
            self._refreshing = None

    def _refresh_when_due(self) -> None:
        if (self._dynamic and self.refresh_s > 0 and self._refreshing is None
                and self._clock() >= self._next_refresh):
            self._refreshing = asyncio.get_running_loop().create_task(self.refresh())

    def _apply(self, urls: Sequence[str]) -> None:
        added = [url for url in urls if url not in self._known]
        gone = [url for url in self._known if url not in urls]
        self._known = {url: self._known.get(url) or _Backend() for url in urls}
        if added or gone:
            logger.info("backends: %d known (added %s, left %s)", len(urls), added or "none", gone or "none")

    async def served_models(self, session: aiohttp.ClientSession, headers: Mapping[str, str]) -> list[str]:
        """The model names the backends' ``/v1/models`` lists (asked once; a failure is not kept)."""
        async with self._served_lock:  # requests that arrive together ask once
            if not self._served:  # an empty list is asked again
                self._served = await self._ask_models(session, headers)
            return self._served

    async def _ask_models(self, session: aiohttp.ClientSession, headers: Mapping[str, str]) -> list[str]:
        errors: list[str] = []
        for base in self.order():
            try:
                async with session.get(base + "/v1/models", headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(f"{base}: {exc or type(exc).__name__}")
                continue
            if resp.status in (401, 403):  # the caller's credentials: theirs to fix
                raise HttpError(resp.status, f"'model' is not given and {base}/v1/models answered "
                                             f"{resp.status}: {error_message(text)}", kind="authentication_error")
            names = model_names(text) if resp.status == 200 else None
            if names is None:
                errors.append(f"{base}: /v1/models answered {resp.status}: {error_message(text)}")
                continue
            logger.info("the backends serve %s", ", ".join(names) or "no model")
            return names
        raise HttpError(502, f"'model' is not given and no backend listed its models "
                             f"({'; '.join(errors) or self.none_known()})",
                        kind=UNAVAILABLE)


def no_answer(role: str, base: str, timeout_s: float) -> HttpError:
    """504 for a request ``role``'s ``base`` took and did not answer within ``--backend-timeout-s``
    (``timeout_s``): sent to another, it would wait as long again, so it is sent nowhere else."""
    return HttpError(504, f"{role} {base} did not answer within --backend-timeout-s ({timeout_s:g} s)",
                     kind=UNAVAILABLE)


def resolve_backends(specs: Sequence[str]) -> list[str]:
    """The base URLs of ``--backend``: an ``http(s)://`` URL as it is; ``dns:///NAME:PORT`` and
    ``HOST:PORT`` as ``http://ADDR:PORT``, one per address; ``file:PATH``: the entries it lists."""
    urls: list[str] = []
    for spec in specs:
        entries = file_targets(spec[len("file:"):], "backend") if spec.startswith("file:") else [spec]
        for entry in entries:
            if entry.startswith(_URL_SCHEMES):
                found = [entry.rstrip("/")]
            else:
                found = ["http://" + target for target in resolve_targets([entry], "backend")]
            urls += [url for url in found if url not in urls]
    if not urls:
        raise ConfigError("no backend listed")
    return urls


def relayed_response(resp: aiohttp.ClientResponse) -> web.StreamResponse:
    """The caller's answer for a backend's ``resp``: its status and headers, hop-by-hop ones left out
    (not prepared yet; the body is relayed as it comes)."""
    return web.StreamResponse(status=resp.status, headers={
        k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS})


def passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The caller's headers a backend gets too (its credentials, its request id)."""
    return {k: v for k, v in headers.items() if k.lower() in _PASSED_HEADERS}


def with_hint(headers: dict[str, str], placements: Sequence[Placement]) -> dict[str, str]:
    """``headers`` with the placements' prefetch hint (:func:`prefill_client.handoff.prefetch_hint`)
    when it fits; a caller's own ``X-Epd-Prefetch`` never gets this far (:func:`passed_headers`)."""
    hint = prefetch_hint(placements)
    if hint is not None:
        headers[PREFETCH_HEADER] = hint
    return headers


def model_names(text: str) -> list[str] | None:
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


def error_message(text: str) -> str:
    """The message of a backend's error answer (OpenAI's ``{"error": {"message": ...}}``), else its text, cut."""
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:200]
    return text[:200]
