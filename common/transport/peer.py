"""One producer incarnation as seen by a consumer: prepped dlists, block and tag READs (prefill process).

A :class:`ProducerPeer` is built by :meth:`ConsumerTransport.connect` from
the handshake's plain numbers. Its remote dlists are prepped once; each
request is one ``make_prepped_xfer`` on int32 indices, so nothing is built
per descriptor on the request path.

Reads are synchronous and block a thread: call them from a worker thread
(``asyncio.to_thread``), never on an event loop (they refuse to), or use the
``*_async`` variants. Every NIXL call holds the consumer's agent lock; the
waits between polls do not. The deadline is checked between NIXL calls (a
same-host cross-memory-attach copy inside ``transfer()`` is not interruptible).
A posted READ's handle is polled, released or quarantined by this peer's
:class:`~common.transport.handles.TransferHandles`.

Outcomes: :class:`~common.errors.TransferTimeout` when the deadline passes
(the READ's slots are quarantined, see :mod:`common.transport.landing`);
:class:`~common.errors.PeerDisconnected` when NIXL reports the remote agent
gone (the peer closes itself; handshake again and ``connect`` anew);
:class:`~common.errors.TransportError` for a failed transfer (the peer closes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import PeerDisconnected, TransferTimeout, TransportError
from common.transport.binding import AgentLike, TransferState, binding_errors, is_binding_error, translate_error
from common.transport.handles import TransferHandles
from common.transport.landing import LandingPool, QuietProbe, SlotPool, checked_ids
from common.transport.regions import RegionDesc

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LocalSide:
    """What every peer of one consumer shares: its agent, lock, pools and local dlists."""

    agent: AgentLike
    lock: threading.Lock
    landing: LandingPool
    tag_slots: SlotPool
    tag_slot_row: int  # tag slot s lands in row tag_slot_row + s; landing block i's own row is i
    tag_values: np.ndarray  # int64 [rows, 2]: per row a fingerprint and a generation
    tag_words: memoryview  # tag_values as flat int64 words (row i: words 2i, 2i+1), read without numpy
    blocks_dlist: Any
    tags_dlist: Any
    on_closed: Callable[[ProducerPeer], None]
    on_drained: Callable[[ProducerPeer], None]


def _require_off_event_loop(what: str) -> None:
    if asyncio._get_running_loop() is None:  # the no-raise form: this runs on every READ
        return
    raise RuntimeError(f"{what} blocks; call it from a worker thread (asyncio.to_thread) or use {what}_async")


def _indices(ids: object, limit: int, what: str) -> np.ndarray:
    """int32 indices for ``make_prepped_xfer`` (about 15x faster than lists), range-checked."""
    return checked_ids(ids, limit, what).astype(np.int32, copy=False)


class ProducerPeer:
    """A producer incarnation's regions, prepped for READs by one consumer agent."""

    def __init__(
        self,
        side: LocalSide,
        *,
        agent_name: str,
        incarnation_id: str,
        metadata: bytes,
        buffer_region: RegionDesc,
        stamp_region: RegionDesc,
        blocks_dlist: Any,
        tags_dlist: Any,
    ) -> None:
        self._side = side
        self.agent_name = agent_name
        self.incarnation_id = incarnation_id
        self.metadata = metadata
        self.buffer_region = buffer_region
        self.stamp_region = stamp_region
        self.num_blocks = buffer_region.count
        self._blocks_dlist = blocks_dlist
        self._tags_dlist = tags_dlist
        self._state_lock = threading.Lock()
        self._closed: str | None = None
        self._outstanding = 0  # posted transfers neither finished nor proven quiet
        self._handles = TransferHandles(side.agent, side.lock, agent_name, self._finished)

    def __repr__(self) -> str:
        state = f"closed: {self._closed}" if self._closed else "open"
        return f"ProducerPeer({self.agent_name}, incarnation {self.incarnation_id[:8]}, {state})"

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def outstanding_transfers(self) -> int:
        """Transfers still in flight or quarantined and unproven; the remote agent stays until 0."""
        return self._outstanding

    # --- reads ---------------------------------------------------------------------------------

    def read_blocks(self, remote_ids: np.ndarray, local_ids: np.ndarray, deadline: float) -> None:
        """READ remote blocks ``remote_ids[i]`` into landing blocks ``local_ids[i]`` by ``deadline``.

        ``local_ids`` must be held (from ``landing.acquire``). On
        ``TransferTimeout`` they belong to the quarantine; releasing them
        afterwards is a harmless no-op.
        """
        _require_off_event_loop("read_blocks")
        self._check_open()
        side = self._side
        remote = _indices(remote_ids, self.num_blocks, "remote block id")
        local = _indices(local_ids, side.landing.num_blocks, "landing block id")
        if remote.size != local.size:
            raise ValueError(f"{remote.size} remote block ids but {local.size} landing block ids")
        side.landing.check_held(local)

        def quarantine(probe: QuietProbe) -> None:
            side.landing.quarantine(local, probe)

        self._read("block READ", side.blocks_dlist, local, self._blocks_dlist, remote, b"", deadline,
                   quarantine)

    def read_tags(
        self, remote_ids: np.ndarray, deadline: float, notif: bytes = b""
    ) -> tuple[np.ndarray, np.ndarray]:
        """READ the tags and generations of ``remote_ids``: ``(fingerprints, generations)`` int64.

        Call it only after ``read_blocks`` returned: a matching tag read
        after the data proves the data. ``notif`` (the lease release) rides
        on this READ: NIXL delivers it to the producer when the READ
        completes, and the READ completes only once it is out. (Sent on its
        own instead, a notification stays queued until this agent next makes
        progress, and the next READ waits for the producer anyway:
        measured, no faster.) The tags land in tag slots of this consumer;
        on ``TransferTimeout`` those are quarantined (the caller's landing
        blocks are not touched by this READ).
        """
        _require_off_event_loop("read_tags")
        self._check_open()
        side = self._side
        remote = _indices(remote_ids, self.num_blocks, "remote block id")
        slots = side.tag_slots.acquire(remote.size)
        if slots is None:
            raise TransportError(
                f"no free tag slots for {remote.size} tags ({side.tag_slots.num_quarantined} of "
                f"{side.tag_slots.size} quarantined by timed-out reads)")
        quarantined = False

        def quarantine(probe: QuietProbe) -> None:
            nonlocal quarantined
            side.tag_slots.quarantine(slots, probe)
            quarantined = True

        try:
            # One 16-byte descriptor per block: its tag and generation, side by side.
            rows = slots + side.tag_slot_row
            self._read("tag READ", side.tags_dlist, rows, self._tags_dlist, remote, bytes(notif),
                       deadline, quarantine)
            values = side.tag_values[rows]  # fancy indexing copies: the slots go back below
            return values[:, 0], values[:, 1]
        finally:
            if not quarantined:
                side.tag_slots.release(slots)

    def read_blocks_and_tags(
        self, remote_ids: np.ndarray, local_ids: np.ndarray, timeout_s: float
    ) -> tuple[list[int], list[int]]:
        """:meth:`read_blocks`, then the tags and generations of the same blocks: ``(fingerprints, generations)``.

        The pull as the client makes it: the same two READs in the same order
        (the tag READ is posted only once the block READ has completed), each
        with ``timeout_s``, and the same outcomes. The tags land in the landing
        blocks' own tag rows, which the caller holds with the blocks: no slots
        to take or give back, and a timed-out tag READ quarantines the landing
        blocks, whose rows it may still write.

        It costs less than the two calls because a block READ of a MiB or more
        evicts the interpreter's and the agent's working set from the CPU
        caches, and whatever runs between the two READs then runs several
        times slower (measured after 8 MiB: ``read_tags`` 115-145 us, its NIXL
        calls 32-45 us). So the ids are checked once, and both handles are made
        and the block READ posted under one hold of the agent lock. When the
        block READ completes at post (a same-host copy does), the tag READ is
        posted at once, under the same hold; otherwise this waits for the block
        READ as :meth:`read_blocks` does and then posts the tag READ. A handle
        made and never posted reads nothing; it is released unposted.
        """
        _require_off_event_loop("read_blocks_and_tags")
        self._check_open()
        side = self._side
        remote = _indices(remote_ids, self.num_blocks, "remote block id")
        local, rows = side.landing.held_ids(local_ids)  # in range, distinct, held
        if remote.size != local.size:
            raise ValueError(f"{remote.size} remote block ids but {local.size} landing block ids")

        def quarantine(probe: QuietProbe) -> None:
            side.landing.quarantine(local, probe)

        n = remote.size
        try:
            block, tag, what, state = self._post_pair(local, remote, timeout_s, quarantine)
            if block is not None:  # the block READ is in flight; the tag READ is made, not posted
                try:
                    state = self._handles.wait(self._action(what, n), block, time.monotonic() + timeout_s, quarantine)
                except BaseException:
                    self._handles.discard(tag)
                    raise
                if state is TransferState.DONE:
                    self._read("tag READ", side.tags_dlist, local, self._tags_dlist, remote, b"",
                               time.monotonic() + timeout_s, quarantine, tag)
                else:
                    self._handles.discard(tag)
            elif tag is not None:  # the block READ completed at post; the tag READ is in flight
                state = self._handles.wait(self._action(what, n), tag, time.monotonic() + timeout_s, quarantine)
        except PeerDisconnected as exc:
            self._teardown(f"disconnected: {exc}")
            raise
        if state is TransferState.ERROR:
            self._teardown(f"{what} failed")
            raise TransportError(f"{self._action(what, n)}: transfer failed (state ERR); the peer is closed")
        words = side.tag_words
        return [words[2 * row] for row in rows], [words[2 * row + 1] for row in rows]

    async def read_blocks_async(self, remote_ids: np.ndarray, local_ids: np.ndarray, deadline: float) -> None:
        await asyncio.to_thread(self.read_blocks, remote_ids, local_ids, deadline)

    async def read_tags_async(
        self, remote_ids: np.ndarray, deadline: float, notif: bytes = b""
    ) -> tuple[np.ndarray, np.ndarray]:
        return await asyncio.to_thread(self.read_tags, remote_ids, deadline, notif)

    # --- making and posting READs (TransferHandles waits for and releases what is posted) ------

    def _read(
        self,
        what: str,
        local_dlist: Any,
        local_idx: np.ndarray,
        remote_dlist: Any,
        remote_idx: np.ndarray,
        notif: bytes,
        deadline: float,
        quarantine: Callable[[QuietProbe], None],
        prepared: Any = None,
    ) -> None:
        """Post a READ (``prepared``: a handle made for exactly it, not yet posted) and wait for it."""
        action = self._action(what, local_idx.size)
        try:
            handle, state = self._post(action, local_dlist, local_idx, remote_dlist, remote_idx, notif,
                                       deadline, quarantine, prepared)
            if state is TransferState.PROCESSING:
                state = self._handles.wait(action, handle, deadline, quarantine)
        except PeerDisconnected as exc:
            self._teardown(f"disconnected: {exc}")
            raise
        if state is TransferState.ERROR:
            self._teardown(f"{what} failed")
            raise TransportError(f"{action}: transfer failed (state ERR); the peer is closed")

    def _post(
        self,
        action: str,
        local_dlist: Any,
        local_idx: np.ndarray,
        remote_dlist: Any,
        remote_idx: np.ndarray,
        notif: bytes,
        deadline: float,
        quarantine: Callable[[QuietProbe], None],
        prepared: Any = None,
    ) -> tuple[Any, TransferState]:
        """Make (unless ``prepared``) and post the READ. An in-flight handle counts as outstanding until released."""
        side = self._side
        if not side.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            # Nothing was posted: quiet at the next sweep (an unposted handle once it is released).
            quarantine((lambda: True) if prepared is None else self._handles.release_probe(prepared))
            raise TransferTimeout(f"{action}: agent busy past the deadline")
        handle: Any = prepared
        try:
            self._check_open()
            with binding_errors(action):
                if handle is None:
                    handle = side.agent.make_prepped_xfer(
                        "READ", local_dlist, local_idx, remote_dlist, remote_idx, notif)
                state = TransferState.parse(side.agent.transfer(handle))
            if state is TransferState.PROCESSING:
                with self._state_lock:
                    self._outstanding += 1
                return handle, state
            self._handles.release_locked(handle)  # finished at post (a same-host copy) or failed
            return None, state
        except BaseException:
            if handle is not None:  # refused at post: nothing is in flight
                self._handles.release_locked(handle)
            raise
        finally:
            side.lock.release()

    def _post_pair(
        self, local: np.ndarray, remote: np.ndarray, timeout_s: float, quarantine: Callable[[QuietProbe], None]
    ) -> tuple[Any, Any, str, TransferState]:
        """Make the block and tag READs and post the block READ, then (if it completed at post) the tags.

        All under one hold of the agent lock, which spares what runs between
        the two READs from running cold (see :meth:`read_blocks_and_tags`).
        Returns ``(block, tag, what, state)``: ``what`` is the last READ posted
        and ``state`` its state at post. ``block`` is the block READ's handle
        while it is in flight (``tag`` then is the tag READ's, made and not
        posted); otherwise ``block`` is ``None`` and ``tag`` is the tag READ's
        handle while it is in flight. Every handle not returned is released. In
        flight counts as outstanding until released. Raises with nothing in
        flight: ``TransferTimeout`` if the lock is busy past ``timeout_s`` (the
        landing blocks are quarantined until the next sweep, as a busy
        :meth:`_post` does), the translated binding error if a make or post is
        refused.
        """
        side = self._side
        agent = side.agent
        what = "block READ"
        if not side.lock.acquire(timeout=max(0.0, timeout_s)):
            quarantine(lambda: True)  # nothing was made: quiet at the next sweep, as in _post
            raise TransferTimeout(f"{self._action(what, remote.size)}: agent busy past the deadline")
        block = tag = None
        in_flight = False
        try:
            self._check_open()
            try:
                tag = agent.make_prepped_xfer("READ", side.tags_dlist, local, self._tags_dlist, remote, b"")
                block = agent.make_prepped_xfer("READ", side.blocks_dlist, local, self._blocks_dlist, remote, b"")
                state = TransferState.parse(agent.transfer(block))
                if state is TransferState.DONE:  # complete: its handle can no longer write
                    self._handles.release_locked(block)
                    block, what = None, "tag READ"
                    state = TransferState.parse(agent.transfer(tag))
            except Exception as exc:
                # binding_errors' translation, with the action formatted only on error: two
                # binding_errors blocks with their actions formatted up front measured 0.003-0.018
                # slower at 1 MiB x 8 (paired, five runs), most of it after the block READ's copy.
                if is_binding_error(exc):  # refused at make or post: nothing is in flight
                    raise translate_error(exc, self._action(what, remote.size)) from exc
                raise
            if state is not TransferState.PROCESSING:
                return None, None, what, state
            in_flight = True
            with self._state_lock:
                self._outstanding += 1
            return block, tag, what, state
        finally:
            if not in_flight:
                for handle in (block, tag):
                    if handle is not None:
                        self._handles.release_locked(handle)
            side.lock.release()

    def _action(self, what: str, n: int) -> str:
        return f"{what} of {n} descriptors from {self.agent_name}"

    def _finished(self) -> None:
        """One outstanding transfer ended; a closed peer with none left lets its agent go."""
        with self._state_lock:
            self._outstanding -= 1
            drained = self._closed is not None and self._outstanding == 0
        if drained:
            self._side.on_drained(self)

    # --- lifecycle -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed is not None:
            raise PeerDisconnected(
                f"peer {self.agent_name} (incarnation {self.incarnation_id}) is closed ({self._closed}); "
                f"handshake again")

    def close(self) -> None:
        """Release the remote dlists; the consumer removes the remote agent once nothing is in flight."""
        self._teardown("closed")

    def _teardown(self, reason: str) -> None:
        with self._state_lock:
            if self._closed is not None:
                return
            self._closed = reason
        side = self._side
        logger.info("closing peer %s (incarnation %s): %s", self.agent_name, self.incarnation_id[:8], reason)
        with side.lock:
            for dlist in (self._blocks_dlist, self._tags_dlist):
                try:
                    with binding_errors("release remote dlist"):
                        side.agent.release_dlist_handle(dlist)
                except TransportError as exc:
                    logger.warning("releasing a dlist of %s failed: %s", self.agent_name, exc)
        side.on_closed(self)
