"""A peer's posted READ handles: poll to completion, release, quarantine probes (prefill process).

:class:`~common.transport.peer.ProducerPeer` makes and posts READs; once a
handle is posted it is this module's: :meth:`TransferHandles.wait` polls it
until it finishes or the deadline passes, and every handle that can no longer
write is released here under the consumer's agent lock. A handle whose READ
timed out, or whose state a poll could not tell, is kept alive inside a
quarantine probe (see :mod:`common.transport.landing`) that releases it once
a later poll proves it quiet.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from common.errors import PeerDisconnected, TransferTimeout, TransportError
from common.transport.binding import AgentLike, TransferState, binding_errors, is_binding_error, translate_error
from common.transport.landing import QuietProbe

logger = logging.getLogger(__name__)

# The consumer's agent has no progress thread: these polls drive its UCX
# worker. Poll back to back for SPIN_S (a same-host READ completes within
# microseconds), then yield the CPU between polls (measured on 2 cores: a
# busy poll starves the producer and took a tag READ from 0.1 ms to 11 ms)
# until YIELD_S, then sleep between polls, backing off to MAX_PAUSE_S.
SPIN_S = 50e-6
YIELD_S = 20e-3
FIRST_PAUSE_S = 100e-6
MAX_PAUSE_S = 1e-3
PROBE_LOCK_WAIT_S = 0.05
# The agent lock is held for single NIXL calls; past this an unposted handle is left unreleased.
DISCARD_LOCK_WAIT_S = 1.0


class TransferHandles:
    """Waits for, releases and quarantines the READ handles of one producer peer.

    ``finished`` is called once for every posted handle that ends here
    (released after it finished, or proven quiet): the peer counts its
    outstanding transfers with it.
    """

    def __init__(self, agent: AgentLike, lock: threading.Lock, peer_name: str, finished: Callable[[], None]) -> None:
        self._agent = agent
        self._lock = lock
        self._peer_name = peer_name
        self._finished = finished

    def wait(
        self, action: str, handle: Any, deadline: float, quarantine: Callable[[QuietProbe], None]
    ) -> TransferState:
        """Poll ``handle`` until it finishes (released) or the deadline passes (quarantined)."""
        lock = self._lock
        started = time.monotonic()
        pause = FIRST_PAUSE_S
        while True:
            now = time.monotonic()
            if now >= deadline:
                quarantine(self.quiet_probe(handle))  # the probe owns the handle from here
                raise TransferTimeout(f"{action}: not complete by its deadline ({now - deadline:.3f} s ago)")
            if now - started < SPIN_S:
                pass
            elif now - started < YIELD_S:
                time.sleep(0)
            else:
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, MAX_PAUSE_S)
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                continue
            try:
                with binding_errors(action):
                    state = TransferState.parse(self._agent.check_xfer_state(handle))
            except PeerDisconnected:
                self.release_locked(handle)  # a dead endpoint delivers nothing more
                lock.release()
                self._finished()
                raise
            except TransportError:
                # The state is unknown, so the data may still come: quarantine, do not release.
                lock.release()
                quarantine(self.quiet_probe(handle))
                raise
            except BaseException:
                lock.release()
                raise
            if state is TransferState.PROCESSING:
                lock.release()
                continue
            self.release_locked(handle)
            lock.release()
            self._finished()
            return state

    def release_locked(self, handle: Any) -> None:
        """Release a transfer handle that can no longer write (caller holds the agent lock)."""
        try:
            with binding_errors("release transfer handle"):
                self._agent.release_xfer_handle(handle)
        except TransportError as exc:
            logger.warning("releasing a transfer handle of %s failed: %s", self._peer_name, exc)

    def discard(self, handle: Any) -> None:
        """Release a handle that was made and never posted (it cannot write)."""
        if not self._lock.acquire(timeout=DISCARD_LOCK_WAIT_S):
            logger.warning("agent of %s busy for %.0f s: an unposted transfer handle is left unreleased",
                           self._peer_name, DISCARD_LOCK_WAIT_S)
            return
        try:
            self.release_locked(handle)
        finally:
            self._lock.release()

    def release_probe(self, handle: Any) -> QuietProbe:
        """A quarantine probe for a handle never posted: quiet once the handle is released."""
        released = False

        def probe() -> bool:
            nonlocal released
            if not released and self._lock.acquire(timeout=PROBE_LOCK_WAIT_S):
                try:
                    self.release_locked(handle)
                    released = True
                finally:
                    self._lock.release()
            return released

        return probe

    def quiet_probe(self, handle: Any) -> QuietProbe:
        """A proof that the timed-out transfer ``handle`` can no longer write (see landing.py)."""
        lock = self._lock
        proven = False

        def probe() -> bool:
            nonlocal proven
            if proven:
                return True
            if not lock.acquire(timeout=PROBE_LOCK_WAIT_S):
                return False
            try:
                try:
                    state = TransferState.parse(self._agent.check_xfer_state(handle))
                except Exception as exc:
                    if not is_binding_error(exc):
                        raise
                    if not isinstance(translate_error(exc, "poll"), PeerDisconnected):
                        return False  # e.g. the remote agent was removed: no proof either way
                    state = TransferState.ERROR  # a dead endpoint delivers nothing more
                if state is TransferState.PROCESSING:
                    return False
                self.release_locked(handle)
                proven = True
            finally:
                lock.release()
            self._finished()
            return True

        return probe
