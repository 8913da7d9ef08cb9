"""The encoders a consumer routes to, kept current while it runs (any process that pulls or places).

:class:`EncoderPool` owns one :class:`EncoderConnection` per encoder and
answers "which encoders, in which order, for this item". It follows the
cluster without a restart:

- **Membership.** The targets (``HOST:PORT``, ``dns:///NAME:PORT``,
  ``file:PATH``; :mod:`prefill_client.consumer.routing`) are resolved again every
  ``refresh_interval_s``, and at once after an encoder failed a call. New
  encoders join the rendezvous; encoders that are no longer listed leave it
  (their connection is closed a grace period later, once the leases it
  queued for release are out). A resolution that fails keeps the last set.
- **Readiness.** Every refresh asks each encoder's ``grpc.health.v1`` for
  ``readiness``, all at once with a short deadline. An encoder that is warming
  up or draining (NOT_SERVING), refuses the connection, or misses the deadline
  :data:`MISSED_PROBES` times in a row gets no new item (one slow answer on a
  busy node does not move an encoder's items elsewhere, where they would be
  encoded again): items go
  to the first *ready* encoder in their rendezvous order, and only when none
  is ready to the others, in the same order (the call then fails over as
  before). Items already leased on a non-ready encoder are still pulled and
  released there: the client calls that connection directly. An encoder
  that stops answering (missed deadlines, not NOT_SERVING) also loses the
  ``Encode`` and ``Lookup`` calls it has in flight, while another encoder is
  ready: they are cancelled and their items fail over, instead of waiting
  out the calls' deadlines on a frozen process.
- **Identity and first contact.** Encoders are ranked for an item by the name
  each announces in its handshake (``--encoder-id``; the pod's host name and
  port by default), not by address: behind a headless Service a restarted pod
  comes back on another IP and keeps its items. The pool handshakes with each
  ready encoder as it appears, a lone one included (once per incarnation, as
  the first call would); until then an encoder is ranked by its address. The
  handshake also connects the transport (and, for a client that probes its
  connections, reads once over it), so a request does not pay for first
  contact: on a busy vLLM worker that set-up has been seen to take longer
  than a pull's deadline. An encoder that was not ready and is ready again is
  asked again (it may have restarted): a new incarnation is connected then,
  not by the next request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2

from common.errors import ConfigError, EpdError, HandshakeError, LoadFailureReason, WeightsMismatchError
from common.metrics import PrefillMetrics
from prefill_client.consumer.connection import EncoderConnection
from prefill_client.consumer.pull import load_failure
from prefill_client.consumer.routing import rendezvous_order, resolve_targets

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_REFRESH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 0.5
MISSED_PROBES = 2  # readiness probes in a row without an answer in time before a ready encoder is not
# How long a connection to an encoder that left the list stays open: its queued lease
# releases go out meanwhile (they get at least MIN_RELEASE_TIMEOUT_S each).
RETIRE_GRACE_S = 10.0
# An encoder serving other vision weights (WeightsMismatchError) is asked again after this long:
# it may have rolled to the expected ones.
REFUSED_RETRY_S = 30.0


def after_probe(ready: bool, missed: int, answer: bool | None) -> tuple[bool, int]:
    """Readiness and the deadlines missed in a row after one probe of a member that was ``ready``
    with ``missed`` before. ``answer``: the probe's verdict, None when it got no answer by its
    deadline. An answer decides at once; a ready member stays ready through missed deadlines until
    the :data:`MISSED_PROBES`-th in a row; a member that was not ready stays not ready."""
    if answer is not None:
        return answer, 0
    missed += 1
    return ready and missed < MISSED_PROBES, missed


class EncoderDown(EpdError):
    """An encoder did not answer, or serves other weights; the item moves to the next encoder in rendezvous order."""


@dataclass(slots=True)
class _Member:
    conn: EncoderConnection
    ready: bool = True  # until the first probe says otherwise
    refused_until: float = 0.0  # serves other vision weights: no new items before then
    missed: int = 0  # readiness probes in a row that got no answer by their deadline
    identify_after: float = 0.0  # refused the last handshake (weights, model id, layout): no early one before then
    lost: bool = False  # handshaken, then not ready: it may come back as another incarnation (restarted)

    def takes_items(self, now: float) -> bool:
        return self.ready and self.refused_until <= now


class EncoderPool:
    """Encoders by target, their readiness, and each item's order over them."""

    def __init__(
        self,
        specs: Sequence[str],
        connect: Callable[[str], EncoderConnection],
        metrics: PrefillMetrics,
        *,
        refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
        identify: bool = True,
    ) -> None:
        """Resolves ``specs`` now (a failure raises :class:`ConfigError`) and probes readiness once;
        ``refresh_interval_s`` 0 never refreshes in the background (call :meth:`refresh`).
        ``identify`` False: no handshake ever, only readiness (a pool that watches encoders for
        another process's sake, as ``epd proxy``'s ``/ready`` does)."""
        if not refresh_interval_s >= 0:
            raise ConfigError(f"refresh interval must be >= 0 seconds, got {refresh_interval_s}")
        self.specs = tuple(specs)
        self.metrics = metrics
        self.refresh_interval_s = refresh_interval_s
        self.health_timeout_s = health_timeout_s
        self._identifies = identify
        self._connect = connect
        self._lock = threading.Lock()  # membership changes; readers take a snapshot
        self._members: dict[str, _Member] = {t: _Member(connect(t)) for t in resolve_targets(self.specs)}
        self._order: tuple[str, ...] = tuple(self._members)
        self._retired: list[tuple[float, EncoderConnection]] = []
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._probe()
        self._identify()
        self._thread: threading.Thread | None = None
        if refresh_interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="epd-encoder-pool", daemon=True)
            self._thread.start()

    # --- what callers read -----------------------------------------------------------------

    @property
    def targets(self) -> tuple[str, ...]:
        """Every known encoder, ready or not, in the order resolved."""
        return self._order

    def conn(self, target: str) -> EncoderConnection | None:
        member = self._members.get(target)
        return member.conn if member is not None else None

    def connections(self) -> list[EncoderConnection]:
        return [m.conn for m in list(self._members.values())]

    def ready(self, target: str) -> bool:
        member = self._members.get(target)
        return member is not None and member.ready

    def order(self, key: Callable[[], str], *, counted: bool = True) -> list[str]:
        """Targets for an item, most preferred first: ready encoders in rendezvous order, then the rest.

        ``key`` (the item's content digest) is computed only when there is a choice to make.
        ``counted``: an item routed past a not-ready encoder counts in ``epd_items_routed_away``
        (off for a look that sends nothing).
        """
        members = dict(self._members)
        if len(members) <= 1:
            return list(members)
        names = {t: m.conn.encoder_id for t, m in members.items() if m.conn.encoder_id}
        ranked = rendezvous_order(key(), list(members), names)
        now = time.monotonic()
        ready = [t for t in ranked if members[t].takes_items(now)]
        if counted and ready and ready[0] != ranked[0]:
            self.metrics.routed_away.inc()
        return ready + [t for t in ranked if not members[t].takes_items(now)]

    def with_failover(self, key: Callable[[], str], first: str,
                       call: Callable[[EncoderConnection], list[_T]]) -> list[_T]:
        """Run ``call(conn)`` on the item's encoder, moving down the rendezvous order when one is down."""
        reasons: list[str] = []
        for target in self.failover_order(key, first):
            conn = self.conn(target)
            if conn is None:  # left the list meanwhile
                reasons.append(f"{target}: left the encoder list")
                continue
            try:
                return call(conn)
            except EncoderDown as exc:
                logger.warning("encoder %s is down (%s); trying the next one", target, exc)
                self.report_down(target)
                reasons.append(f"{target}: {exc}")
        raise load_failure(self.metrics, LoadFailureReason.HANDSHAKE, [], mm_hash=key(),
                           detail=f"no encoder reachable ({'; '.join(reasons) or 'none known'})")

    def failover_order(self, key: Callable[[], str], first: str) -> Iterator[str]:
        """``first``, then every other known encoder in the item's order; the rest (and the key) are
        computed only when the first choice is down. Encoders that joined while the call ran are
        tried too: the order is taken again until it names none that was not tried."""
        tried = {first}
        yield first
        while True:
            fresh = [t for t in self.order(key) if t not in tried]
            if not fresh:
                return
            for target in fresh:
                tried.add(target)
                yield target

    def report_down(self, target: str) -> None:
        """A call to ``target`` failed as if it were gone: route around it and refresh now."""
        member = self._members.get(target)
        if member is not None:
            member.ready = False
        self._count()
        self._wake.set()

    # --- refresh -----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Resolve the targets again, add and retire encoders, probe every encoder's readiness."""
        try:
            found = resolve_targets(self.specs)
        except ConfigError as exc:
            self.metrics.membership_refreshes.labels(result="failed").inc()
            logger.warning("encoder targets did not resolve (%s); keeping %d known", exc, len(self._members))
            found = list(self._members)
        else:
            changed = set(found) != set(self._members)
            self.metrics.membership_refreshes.labels(result="changed" if changed else "unchanged").inc()
        with self._lock:
            added = [t for t in found if t not in self._members]
            gone = [t for t in self._members if t not in found]
            members = {t: self._members.get(t) or _Member(self._connect(t), ready=False) for t in found}
            now = time.monotonic()
            self._retired += [(now + RETIRE_GRACE_S, self._members[t].conn) for t in gone]
            self._members, self._order = members, tuple(found)
        if added or gone:
            logger.info("encoders: %d known (added %s, left %s)", len(found), added or "none", gone or "none")
        self._probe()
        self._identify()
        self._close_retired(time.monotonic())

    def _probe(self) -> None:
        """Readiness of every known encoder, asked at once: SERVING is ready; NOT_SERVING or a
        failed call is not; no answer in time keeps a ready encoder ready until the
        :data:`MISSED_PROBES`-th time in a row."""
        members = list(self._members.items())
        calls = [(target, member, member.conn.readiness(self.health_timeout_s)) for target, member in members]
        stopped: list[_Member] = []  # ready until this probe, which it missed once too often
        for target, member, call in calls:
            answer: bool | None
            try:
                answer = call.result().status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as exc:
                answer = None if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
                logger.debug("encoder %s readiness unknown: %s (%d missed before)", target, exc.code(), member.missed)
            ready, member.missed = after_probe(member.ready, member.missed, answer)
            if not ready and member.conn.incarnation_id:
                member.lost = True
            if ready != member.ready:
                logger.info("encoder %s is %s", target, "ready" if ready else "not ready (no new items)")
                if answer is None:
                    stopped.append(member)
            member.ready = ready
        self._count()
        self._give_up_on(stopped)

    def _give_up_on(self, stopped: Sequence[_Member]) -> None:
        """Cancel the Encodes and Lookups in flight on encoders that stopped answering (frozen, or cut
        off), so that their items go to the next encoder now rather than at the calls' deadlines; but only
        while another encoder is ready to take them. An encoder that answers NOT_SERVING (draining)
        finishes the calls it has; with no other encoder ready, a late answer is the only one."""
        now = time.monotonic()
        if not stopped or not any(m.takes_items(now) for m in self._members.values()):
            return
        for member in stopped:
            why = (f"encoder {member.conn.target} missed {member.missed} readiness checks in a row "
                   f"({self.health_timeout_s} s each); its calls were given up")
            cancelled = member.conn.give_up_calls(why)
            self.metrics.calls_given_up.inc(cancelled)
            if cancelled:
                logger.warning("encoder %s stopped answering: %d Encode or Lookup calls given up, their items "
                               "go to the next encoder", member.conn.target, cancelled)

    def _count(self) -> None:
        members = list(self._members.values())
        now = time.monotonic()
        self.metrics.encoders_known.set(len(members))
        self.metrics.encoders_ready.set(sum(m.takes_items(now) for m in members))

    def _identify(self) -> None:
        """Handshake with ready encoders not handshaken yet, and again with those lost and ready
        again: to rank them by their announced names, and to make first contact (handshake,
        transport connection) with each incarnation before a request needs it.

        A failure leaves the encoder ranked by address; its own calls report the error.
        """
        if not self._identifies:
            return
        members = list(self._members.values())
        now = time.monotonic()
        for member in members:
            if member.ready and (member.lost or not member.conn.incarnation_id) and member.identify_after <= now:
                try:
                    if not member.lost:
                        member.conn.peer()
                    elif member.conn.recheck():
                        logger.info("encoder %s is back as incarnation %s: reconnected", member.conn.target,
                                    member.conn.incarnation_id[:8])
                    member.lost = False
                except WeightsMismatchError as exc:
                    # Unusable for this client until it rolls: asked again only after a while.
                    member.refused_until = member.identify_after = now + REFUSED_RETRY_S
                    logger.warning("%s; no items go there (asked again in %.0f s)", exc, REFUSED_RETRY_S)
                except HandshakeError as exc:
                    # Another model id or layout: a redeploy fixes it, not a retry every refresh. Calls
                    # still go there and fail with this error, naming both sides.
                    member.identify_after = now + REFUSED_RETRY_S
                    logger.info("%s (handshake asked again in %.0f s, or by the next call)", exc, REFUSED_RETRY_S)
                except EpdError as exc:
                    logger.debug("encoder %s not identified yet: %s", member.conn.target, exc)
        self._count()

    def _close_retired(self, now: float) -> None:
        with self._lock:
            due = [conn for when, conn in self._retired if when <= now]
            self._retired = [(when, conn) for when, conn in self._retired if when > now]
        for conn in due:
            conn.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.refresh_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - the pool must outlive one bad refresh
                logger.exception("encoder pool refresh failed")

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            conns = [m.conn for m in self._members.values()] + [conn for _, conn in self._retired]
            self._members, self._order, self._retired = {}, (), []
        for conn in conns:
            conn.close()
