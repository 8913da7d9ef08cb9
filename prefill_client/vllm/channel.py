"""The connector's side channel between vLLM's scheduler and its workers, ZeroMQ on one host
(vLLM scheduler process: :class:`SchedulerChannel`; vLLM worker process: :class:`WorkerChannel`).

Why a channel of our own. vLLM hands connector metadata to the workers only inside a step that
runs tokens: a step whose requests are all deferred (every one waiting for its pulls) never
calls the worker-side connector, so neither pull orders nor completions could travel while an
engine waits on its only request. Mooncake's EC connector has its own channel for the same
reason. What must stay in step order (which rows to place into ``encoder_cache``, which to drop)
still travels in the step's metadata; orders and reports travel here.

The scheduler binds a ROUTER socket on an ``ipc://`` path derived from the engine's identity
(:func:`address`); each worker's DEALER connects, says hello with its rank, and then receives
every order and sends its reports. Messages are the typed ones of :mod:`prefill_client.handoff`
(:class:`~prefill_client.handoff.PullOrder`, ``Cancel``, ``PullDone``, ``PullFailed``; the hello
is the channel's own business), small JSON objects (locations, ids, reasons), never rows.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from common.errors import ConfigError
from prefill_client.handoff import (
    Cancel,
    Hello,
    Order,
    PullDone,
    PullFailed,
    PullOrder,
    Report,
    decode_message,
    encode_message,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a worker's loop looks up from an idle socket (to notice close)
HINT_QUEUE = 256  # prefetch hints a worker's socket queues before it drops new ones (hints are optional)


def address(vllm_config: VllmConfig) -> str:
    """The channel of one engine: the same in its scheduler and in every worker (both get the
    engine's config, whose ``instance_id`` is fixed when it is made), distinct per data-parallel rank."""
    parallel = vllm_config.parallel_config
    name = f"epd-ec-{vllm_config.instance_id}-dp{parallel.data_parallel_rank}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"ipc://{os.path.join(tempfile.gettempdir(), safe)}"


def prefetch_address(channel_address: str, rank: int) -> str:
    """Where tensor-parallel ``rank`` of the engine whose channel is ``channel_address`` takes
    prefetch hints (:mod:`prefill_client.vllm.prefetch`): vLLM's API server sends them there."""
    return f"{channel_address}-prefetch-tp{rank}"


def _bind_anew(sock: zmq.Socket[Any], addr: str) -> None:
    """Bind ``sock`` to ``addr``, first removing the socket file an engine that died with the same
    identity left there (``ipc://``)."""
    _remove_socket_file(addr)
    sock.bind(addr)


def _remove_socket_file(addr: str) -> None:
    if addr.startswith("ipc://"):
        try:
            os.unlink(addr.removeprefix("ipc://"))
        except FileNotFoundError:
            pass


class SchedulerChannel:
    """The scheduler's end: knows which ranks joined, sends orders to all of them, collects reports.

    Used from the scheduler's thread only (vLLM calls every scheduler-side hook from one thread).
    """

    def __init__(self, addr: str, ranks: int) -> None:
        self.address = addr
        self.ranks = ranks
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _bind_anew(self._sock, addr)
        self._peers: dict[int, bytes] = {}

    @property
    def joined(self) -> int:
        return len(self._peers)

    @property
    def ready(self) -> bool:
        """Every rank said hello: an order sent now reaches all of them."""
        return len(self._peers) >= self.ranks

    def send(self, order: Order) -> None:
        """``order`` to every rank that joined."""
        data = encode_message(order)
        for rank, ident in list(self._peers.items()):
            try:
                self._sock.send_multipart([ident, data], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the worker is gone (engine shutting down) or its queue is full
                logger.warning("EpdCacheConnector: order to rank %d not sent: %s", rank, exc)

    def wait(self, timeout_s: float) -> bool:
        """Block until a message is there to :meth:`poll` (True), or ``timeout_s`` passed (False)."""
        return bool(self._sock.poll(max(1, math.ceil(timeout_s * 1e3)), zmq.POLLIN))

    def poll(self) -> list[Report]:
        """Every report that arrived since the last call (hellos are taken here)."""
        out: list[Report] = []
        while True:
            try:
                ident, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = decode_message(data)
            except ConfigError as exc:
                logger.error("EpdCacheConnector: unreadable message from a worker dropped: %s", exc)
                continue
            if isinstance(msg, Hello):
                self._peers[msg.rank] = ident
                logger.info("EpdCacheConnector: worker rank %d joined (%d of %d)", msg.rank, len(self._peers),
                            self.ranks)
            elif isinstance(msg, (PullDone, PullFailed)):
                out.append(msg)
            else:
                logger.error("EpdCacheConnector: a worker sent a %s message, which only the scheduler sends; dropped",
                             msg.op.value)

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
        _remove_socket_file(self.address)


class WorkerChannel:
    """A worker's end: a thread that hands each order to ``on_order`` and sends what :meth:`report` gets.

    ``on_order`` runs on that thread and must not block (it submits work). :meth:`report` may be
    called from any thread: each thread gets its own in-process socket to the loop. With
    ``on_hint``, the thread also takes prefetch hints (:func:`prefetch_address`) and hands each
    one's bytes to it, on the same terms as ``on_order``.
    """

    def __init__(self, addr: str, rank: int, on_order: Callable[[Order], None],
                 on_hint: Callable[[bytes], None] | None = None) -> None:
        self.rank = rank
        self._on_order = on_order
        self._ctx = zmq.Context()
        self._inproc = f"inproc://epd-reports-{secrets.token_hex(6)}"
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.IDENTITY, f"rank-{rank}-{secrets.token_hex(4)}".encode())
        self._dealer.connect(addr)
        self._reports = self._ctx.socket(zmq.PULL)
        self._reports.setsockopt(zmq.LINGER, 0)
        self._reports.bind(self._inproc)
        self._on_hint = on_hint
        self._hints: zmq.Socket[Any] | None = None
        if on_hint is not None:
            self.hint_address = prefetch_address(addr, rank)
            self._hints = self._ctx.socket(zmq.PULL)
            self._hints.setsockopt(zmq.LINGER, 0)
            self._hints.setsockopt(zmq.RCVHWM, HINT_QUEUE)
            _bind_anew(self._hints, self.hint_address)
        self._local = threading.local()
        self._senders: list[zmq.Socket[Any]] = []
        self._senders_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"epd-ec-channel-{rank}", daemon=True)
        self._thread.start()

    def report(self, report: Report) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._inproc)
            self._local.sock = sock
            with self._senders_lock:
                self._senders.append(sock)
        sock.send(encode_message(report))

    def _run(self) -> None:
        # DEALER queues this until the scheduler's socket is bound (it starts after the workers).
        self._dealer.send(encode_message(Hello(self.rank)))
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._reports, zmq.POLLIN)
        if self._hints is not None:
            poller.register(self._hints, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                ready = dict(poller.poll(POLL_MS))
                if self._reports in ready:
                    while True:
                        try:
                            self._dealer.send(self._reports.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                if self._dealer in ready:
                    while True:
                        try:
                            data = self._dealer.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._take(data)
                if self._hints is not None and self._hints in ready:
                    self._take_hints(self._hints)
            except zmq.ZMQError as exc:
                if self._closed.is_set():
                    return
                logger.error("EpdCacheConnector: worker channel: %s", exc)
            except Exception:  # an order we could not act on: say so, keep serving the others
                logger.exception("EpdCacheConnector: worker channel: order failed")

    def _take(self, data: bytes) -> None:
        try:
            msg = decode_message(data)
        except ConfigError as exc:
            logger.error("EpdCacheConnector rank %d: unreadable order dropped: %s", self.rank, exc)
            return
        if isinstance(msg, (PullOrder, Cancel)):
            self._on_order(msg)
        else:
            logger.error("EpdCacheConnector rank %d: unknown order %r", self.rank, msg.op.value)

    def _take_hints(self, sock: zmq.Socket[Any]) -> None:
        assert self._on_hint is not None
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_hint(data)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5 * POLL_MS / 1000)
        with self._senders_lock:
            for sock in self._senders:
                sock.close(0)
        self._dealer.close(0)
        self._reports.close(0)
        if self._hints is not None:
            self._hints.close(0)
            _remove_socket_file(self.hint_address)
        self._ctx.term()
