"""Whether the proxy can serve now: an encoder ready and a backend answering its health (proxy process).

``GET /ready`` answers 200 only when both hold, 503 naming the side that does not otherwise;
``GET /health`` (liveness) stays 200 and carries the last check's ``ready`` without waiting
for a new one (a liveness probe must not fail because a check is slow).

- **Encoders**: the encoder pool's readiness (:class:`~prefill_client.consumer.pool.EncoderPool`:
  every target's ``grpc.health.v1`` ``readiness``, all at once with a short deadline, again every
  ``--membership-refresh-s``), over connections that only ask readiness: no handshake, no
  transport, no model id, so it works before the first request made an encoder client.
- **Backends**: each known backend's ``GET /health`` (vLLM answers 200 while its engine is
  alive), all at once within :data:`BACKEND_PROBE_TIMEOUT_S`; a backend that answered before
  and now misses the deadline stays ready until it misses it
  :data:`~prefill_client.consumer.pool.MISSED_PROBES` times in a row (a busy API server is
  not a dead one; a refused connection or another status counts at once). With
  ``--prefill``/``--decode`` the two pools are two sides, each needing a healthy member.

An answer is kept :data:`CACHE_S`, and probes that arrive together share one check: a busy
``/ready`` does not flood the backends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from common.config import ProxyConfig
from common.errors import ConfigError
from common.metrics import PrefillMetrics
from prefill_client.consumer.connection import EncoderConnection
from prefill_client.consumer.pool import EncoderPool, after_probe

logger = logging.getLogger(__name__)

BACKEND_PROBE_TIMEOUT_S = 1.0  # a backend that does not answer its /health this fast is not ready
ENCODER_CHECK_TIMEOUT_S = 5.0  # resolving the targets (DNS) and probing them, the first time included
CACHE_S = 1.0  # how long one answer serves the probes that follow
PROBE_CONSUMER_ID = "epd-proxy-readiness"
Members = Callable[[], Sequence[str]]  # a pool's base URLs now


@dataclass(frozen=True, slots=True)
class Side:
    """One side's members by readiness, and why it has none ("" when it has some)."""

    ready: tuple[str, ...] = ()
    not_ready: tuple[str, ...] = ()
    unknown: str = ""

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ready": list(self.ready), "not_ready": list(self.not_ready)}
        if self.unknown:
            out["error"] = self.unknown
        return out


@dataclass(frozen=True, slots=True)
class State:
    """What one check found: the encoders, and each pool of vLLM servers by name ("backends"; with
    ``--prefill``/``--decode``: "prefill" and "decode")."""

    encoders: Side
    pools: tuple[tuple[str, Side], ...]

    @property
    def ready(self) -> bool:
        return bool(self.encoders.ready) and all(side.ready for _, side in self.pools)

    def body(self) -> dict[str, Any]:
        """``/ready``'s answer: the verdict, the sides that are not ready, and each side's members."""
        sides = {"encoders": self.encoders, **dict(self.pools)}
        return {"ready": self.ready, "not_ready": [name for name, side in sides.items() if not side.ready],
                **{name: side.body() for name, side in sides.items()}}


class EncoderWatch:
    """The encoders' readiness, from an :class:`EncoderPool` of readiness-only connections, made on
    first use (a target that does not resolve yet is tried again on the next check)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self._cfg = cfg
        self._metrics = PrefillMetrics()  # the pool's own series; the proxy exports none of them
        self._pool: EncoderPool | None = None
        self._busy = threading.Lock()  # a check that outlived its deadline still runs: no second one
        self._closed = False

    def side(self) -> Side:
        """Which encoders are ready now (blocking: the first call resolves and probes them)."""
        if not self._busy.acquire(blocking=False):
            return Side(unknown="the last encoder check is still running (resolving the targets?)")
        try:
            return self._side()
        finally:
            self._busy.release()

    def _side(self) -> Side:
        if self._closed:
            return Side(unknown="the proxy is stopping")
        if self._pool is None:
            try:
                self._pool = EncoderPool(self._cfg.encoders, self._connect, self._metrics,
                                         refresh_interval_s=self._cfg.membership_refresh_s, identify=False)
            except ConfigError as exc:
                return Side(unknown=f"the encoder targets do not resolve: {exc}")
        elif self._cfg.membership_refresh_s == 0:  # the pool refreshes only when asked
            self._pool.refresh()
        pool = self._pool
        targets = pool.targets
        return Side(tuple(t for t in targets if pool.ready(t)), tuple(t for t in targets if not pool.ready(t)),
                    "" if targets else "no encoder known")

    def _connect(self, target: str) -> EncoderConnection:
        return EncoderConnection(target, "", PROBE_CONSUMER_ID, None, self._metrics,
                                 rpc_timeout_s=self._cfg.rpc_timeout_s, tls=self._cfg.tls)

    def close(self) -> None:
        """Close the pool, once a check still running is done (it could make the pool otherwise)."""
        got = self._busy.acquire(timeout=ENCODER_CHECK_TIMEOUT_S)
        try:
            self._closed = True
            if self._pool is not None:
                self._pool.close()
        finally:
            if got:
                self._busy.release()


class Readiness:
    """The proxy's readiness (:class:`State`), checked at most once per :data:`CACHE_S`.

    ``backends``: the backends' base URLs now, or such a callable per pool by name (each pool
    needs a healthy member); ``encoders``: what reports the encoders' side (blocking; run in a
    thread), default an :class:`EncoderWatch` of ``cfg``'s targets.
    """

    def __init__(self, cfg: ProxyConfig, backends: Members | Mapping[str, Members], *,
                 encoders: Callable[[], Side] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._watch = EncoderWatch(cfg) if encoders is None else None
        self._encoders = encoders or self._watch_side
        self._pools = dict(backends) if isinstance(backends, Mapping) else {"backends": backends}
        self._clock = clock
        self._lock = asyncio.Lock()
        self._last: tuple[float, State] | None = None
        self._background: asyncio.Task[State] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probed: dict[str, tuple[bool, int]] = {}  # backend -> (ready, deadlines missed in a row)

    def _watch_side(self) -> Side:
        assert self._watch is not None
        return self._watch.side()

    def _fresh(self) -> bool:
        return self._last is not None and self._clock() - self._last[0] < CACHE_S

    def peek(self) -> State | None:
        """The last check's answer (None before the first), without waiting; when it is stale a
        new check starts in the background."""
        if not self._fresh() and (self._background is None or self._background.done()):
            self._background = asyncio.get_running_loop().create_task(self.state())
        return self._last[1] if self._last is not None else None

    async def state(self) -> State:
        """The last check's answer while it is fresh, else a new check (one at a time)."""
        async with self._lock:
            if self._last is not None and self._fresh():
                return self._last[1]
            encoders, *pools = await asyncio.gather(self._encoder_side(),
                                                    *(self._backend_side(urls) for urls in self._pools.values()))
            state = State(encoders, tuple(zip(self._pools, pools)))
            members = {u for side in pools for u in (*side.ready, *side.not_ready)}
            self._probed = {u: v for u, v in self._probed.items() if u in members}  # backends that left
            if self._last is None or self._last[1].ready != state.ready:
                logger.info("epd proxy is %s", "ready" if state.ready else
                            f"not ready ({', '.join(state.body()['not_ready'])} not ready)")
            self._last = (self._clock(), state)
            return state

    async def _encoder_side(self) -> Side:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._encoders), ENCODER_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            return Side(unknown=f"the encoder check took over {ENCODER_CHECK_TIMEOUT_S:.0f} s")

    async def _backend_side(self, members: Members) -> Side:
        urls = list(members())
        if not urls:
            return Side(unknown="no backend known")
        if self._session is None:  # its own session: these calls are no request's backend calls
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BACKEND_PROBE_TIMEOUT_S))
        answers = await asyncio.gather(*(self._healthy(self._session, url) for url in urls))
        ok = [self._verdict(url, answer) for url, answer in zip(urls, answers)]
        return Side(tuple(u for u, good in zip(urls, ok) if good), tuple(u for u, good in zip(urls, ok) if not good))

    def _verdict(self, url: str, answer: bool | None) -> bool:
        """Ready or not from this probe's ``answer`` (None: no answer in time) and the probes before
        (a backend not probed before is not ready)."""
        ready, missed = after_probe(*self._probed.get(url, (False, 0)), answer)
        self._probed[url] = (ready, missed)
        return ready

    @staticmethod
    async def _healthy(session: aiohttp.ClientSession, url: str) -> bool | None:
        """Whether ``url`` answers its /health with 200; None when it did not answer in time."""
        try:
            async with session.get(url.rstrip("/") + "/health") as resp:
                return resp.status == 200
        except asyncio.TimeoutError:
            logger.debug("backend %s health: no answer within %.1f s", url, BACKEND_PROBE_TIMEOUT_S)
            return None
        except aiohttp.ClientError as exc:
            logger.debug("backend %s health unknown: %s", url, exc or type(exc).__name__)
            return False

    async def close(self) -> None:
        if self._background is not None:
            self._background.cancel()
        if self._session is not None:
            await self._session.close()
        if self._watch is not None:
            await asyncio.to_thread(self._watch.close)
