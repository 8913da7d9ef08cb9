"""Mock NIXL agent: the ``nixl_agent`` subset we use, over POSIX shared memory (both processes).

This is a stand-in shipped with the package: the demo and the loopback tests
fall back to it where NIXL is not installed, and every instance says so in
the log. It has the same method names, return values and exception class
names as NIXL 1.5's ``nixl_agent`` for what this project calls: register /
deregister memory, agent metadata, add / remove remote agents, prepped
descriptor lists, ``make_prepped_xfer("READ", ...)``, ``transfer``,
``check_xfer_state``, handle release and notifications. It works across
processes like the real one: a READ copies from the target's shared-memory
segment (see :mod:`common.transport.shm`) into the initiator's registered
memory.

Semantics it reproduces, measured on NIXL 1.5.1 + UCX:

- a transfer progresses only while the target process runs; a stopped target
  leaves it in progress, a vanished one raises ``nixlRemoteDisconnectError``;
- releasing an in-progress handle or removing the remote agent does not stop
  the data: the copy still lands once the target runs again;
- a handle of a removed remote agent reports ``nixlNotFoundError``; a dlist
  prepped for it (a stale dlist) cannot make new transfers;
- re-adding a known agent name with different metadata is refused.

:class:`MockFaults` injects what the tests need: in progress for N polls,
stall, disconnect, registration failure, and a callback before each post
(to reuse a block between the block READ and the tag READ).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.transport import mock_wire as wire
from common.transport.mock_descs import MockDlistHandle, MockRegDList, as_descriptors, merge_runs
from common.transport.mock_errors import (
    nixlBackendError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
)
from common.transport.shm import ReadOnlyMapping, find_segment, map_segment_readonly

logger = logging.getLogger(__name__)

_LOCAL_NAMES = ("", "NIXL_INIT_AGENT")
_DRAIN_LIMIT = 4096  # notifications per get_new_notifs call: bounded, non-blocking


@dataclass(frozen=True, slots=True)
class PostInfo:
    """What :attr:`MockFaults.before_post` is told about a transfer about to be posted."""

    index: int  # posts by this agent before this one
    remote: str
    descriptors: int
    nbytes: int
    notif: bytes


@dataclass(slots=True)
class MockFaults:
    """Fault-injection knobs, read at every call; tests flip them while transfers run."""

    pending_polls: int = 0  # every transfer reports PROC for this many check_xfer_state calls
    stall: bool = False  # transfers make no progress (no data lands) until cleared
    disconnect: bool = False  # posts and polls raise nixlRemoteDisconnectError; pending ones fail
    fail_registration: bool = False  # register_memory raises nixlBackendError
    before_post: Callable[[PostInfo], None] | None = None  # runs before each transfer() posts


@dataclass(slots=True)
class _Remote:
    card: wire.AgentCard
    metadata: bytes
    address: bytes
    # per exported region: (start, end, source address of start in our mapping)
    starts: np.ndarray
    ends: np.ndarray
    sources: np.ndarray
    mappings: list[ReadOnlyMapping]


@dataclass(slots=True)
class _Op:
    remote: _Remote
    dst: np.ndarray
    src: np.ndarray
    lengths: np.ndarray
    notif: bytes
    polls_left: int
    state: str = "PROC"
    copied: bool = False
    disconnected: bool = False


@dataclass(slots=True, eq=False)
class MockXferHandle:
    """A transfer request; ``release()`` like ``nixl_xfer_handle``."""

    agent: MockNixlAgent
    remote: _Remote
    dst: np.ndarray
    src: np.ndarray
    lengths: np.ndarray
    notif: bytes
    op: _Op | None = None
    released: bool = field(default=False)

    def release(self) -> None:
        self.released = True  # an in-flight op keeps going: cancellation is not a fence


class MockNixlAgent:
    """A NIXL-compatible agent that copies through shared memory (no RDMA; one host)."""

    def __init__(self, agent_name: str, faults: MockFaults | None = None) -> None:
        self.name = agent_name
        self.faults = faults if faults is not None else MockFaults()
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._start_ticks = wire.process_start_ticks(self._pid)
        self._local: list[tuple[int, int, int]] = []  # (start, end, device) of registered memory
        self._exported: list[wire.ExportedRegion] = []
        self._remotes: dict[str, _Remote] = {}
        self._pending: list[_Op] = []
        self._posts = 0
        self._inbox = wire.NotificationInbox(self._pid, agent_name)
        self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        logger.info("mock NIXL agent %s: copies through POSIX shared memory on this host, no RDMA", agent_name)

    def close(self) -> None:
        self._inbox.close()
        self._outbox.close()

    # --- memory ---------------------------------------------------------------------------

    def register_memory(self, reg_list: Any, mem_type: str | None = None, backends: Any = ()) -> MockRegDList:
        if self.faults.fail_registration:
            raise nixlBackendError("mock: registration failure injected")
        descs = as_descriptors(reg_list, mem_type)
        if descs.memory != "DRAM":
            raise nixlNotSupportedError(f"mock agent supports DRAM only, got {descs.memory}")
        with self._lock:
            for addr, length, dev in descs.rows:
                self._local.append((addr, addr + length, dev))
                seg = find_segment(addr, length)
                if seg is not None:
                    self._exported.append(wire.ExportedRegion(addr, length, dev, seg.name, seg.offset))
                else:
                    logger.debug("mock agent %s: %#x+%d is not shared memory; local use only",
                                 self.name, addr, length)
            self._local.sort()
        return descs

    def deregister_memory(self, dereg_list: MockRegDList, backends: Any = ()) -> None:
        with self._lock:
            for addr, length, dev in dereg_list.rows:
                try:
                    self._local.remove((addr, addr + length, dev))
                except ValueError:
                    raise nixlNotFoundError(f"{addr:#x}+{length} is not registered") from None
                self._exported = [r for r in self._exported if (r.address, r.length) != (addr, length)]

    def get_agent_metadata(self) -> bytes:
        with self._lock:
            return wire.AgentCard(self.name, self._pid, self._start_ticks, tuple(self._exported)).encode()

    # --- remote agents ---------------------------------------------------------------------

    def add_remote_agent(self, metadata: bytes) -> bytes:
        try:
            card = wire.AgentCard.decode(bytes(metadata))
        except ValueError as exc:
            raise nixlMismatchError(f"mock: bad remote metadata: {exc}") from None
        with self._lock:
            known = self._remotes.get(card.name)
            if known is not None:
                if known.metadata == metadata:
                    return card.name.encode()
                raise nixlNotAllowedError(f"mock: agent {card.name!r} is already known with other metadata")
            self._remotes[card.name] = self._open_remote(card, bytes(metadata))
        return card.name.encode()

    def _open_remote(self, card: wire.AgentCard, metadata: bytes) -> _Remote:
        maps: dict[str, ReadOnlyMapping] = {}
        rows: list[tuple[int, int, int]] = []
        for region in sorted(card.regions, key=lambda r: r.address):
            try:
                mapping = maps.get(region.segment) or map_segment_readonly(
                    region.segment, region.offset + region.length)
            except ValueError as exc:
                raise nixlBackendError(f"mock: cannot map {card.name}'s memory: {exc}") from None
            if region.offset + region.length > mapping.size:
                raise nixlMismatchError(f"mock: region {region} runs past segment {region.segment}")
            maps[region.segment] = mapping
            rows.append((region.address, region.address + region.length, mapping.address + region.offset))
        table = np.asarray(rows, dtype=np.uint64).reshape(-1, 3)
        return _Remote(card, metadata, wire.socket_address(card.pid, card.name),
                       table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy(), list(maps.values()))

    def make_connection(self, remote_agent: str, backends: Any = ()) -> None:
        with self._lock:
            if remote_agent not in self._remotes:
                raise nixlNotFoundError(f"mock: metadata for remote agent {remote_agent!r} not found")

    def remove_remote_agent(self, agent: str) -> None:
        with self._lock:
            self._remotes.pop(agent, None)  # in-flight ops keep their mappings: late data still lands

    # --- descriptor lists and transfers -----------------------------------------------------

    def prep_xfer_dlist(
        self, agent_name: str, xfer_list: Any, mem_type: str | None = None, backends: Any = ()
    ) -> MockDlistHandle:
        descs = as_descriptors(xfer_list, mem_type)
        addrs = np.asarray([r[0] for r in descs.rows], dtype=np.uint64)
        lengths = np.asarray([r[1] for r in descs.rows], dtype=np.uint64)
        ends = addrs + lengths
        with self._lock:
            if agent_name in _LOCAL_NAMES:
                table = np.asarray([(s, e) for s, e, _ in self._local], dtype=np.uint64).reshape(-1, 2)
                self._require_inside(addrs, ends, table[:, 0], table[:, 1], "local")
                return MockDlistHandle(None, addrs, lengths)
            remote = self._remotes.get(agent_name)
            if remote is None:
                raise nixlNotFoundError(f"mock: metadata for remote agent {agent_name!r} not found")
            where = self._require_inside(addrs, ends, remote.starts, remote.ends, agent_name)
            sources = remote.sources[where] + (addrs - remote.starts[where])
            return MockDlistHandle(remote, sources, lengths)

    @staticmethod
    def _require_inside(
        addrs: np.ndarray, ends: np.ndarray, starts: np.ndarray, stops: np.ndarray, who: str
    ) -> np.ndarray:
        if len(addrs) == 0:
            raise nixlInvalidParamError("mock: empty descriptor list")
        where = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
        ok = where >= 0
        ok[ok] &= ends[ok] <= stops[where[ok]]
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise nixlNotFoundError(
                f"mock: descriptor {bad} ({int(addrs[bad]):#x}) is not in memory registered by {who}")
        return where

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: MockDlistHandle,
        local_indices: Any,
        remote_xfer_side: MockDlistHandle,
        remote_indices: Any,
        notif_msg: bytes = b"",
        backends: Any = (),
        skip_desc_merge: bool = False,
    ) -> MockXferHandle:
        if operation != "READ":
            raise nixlNotSupportedError(f"mock agent implements READ only, not {operation!r}")
        local, remote = local_xfer_side, remote_xfer_side
        if local.released or remote.released or local.remote is not None or remote.remote is None:
            raise nixlInvalidParamError("mock: released or mismatched descriptor list handles")
        with self._lock:
            if self._remotes.get(remote.remote.card.name) is not remote.remote:
                raise nixlInvalidParamError("mock: the remote dlist belongs to a removed agent (stale dlist)")
        lidx = np.asarray(local_indices, dtype=np.int64).reshape(-1)
        ridx = np.asarray(remote_indices, dtype=np.int64).reshape(-1)
        if len(lidx) != len(ridx) or len(lidx) == 0:
            raise nixlInvalidParamError(f"mock: index counts local {len(lidx)}, remote {len(ridx)}")
        for idx, handle, side in ((lidx, local, "local"), (ridx, remote, "remote")):
            if idx.min() < 0 or idx.max() >= len(handle.addresses):
                raise nixlInvalidParamError(f"mock: {side} index out of range 0..{len(handle.addresses) - 1}")
        lengths = local.lengths[lidx]
        if not np.array_equal(lengths, remote.lengths[ridx]):
            raise nixlInvalidParamError("mock: local and remote descriptor lengths differ")
        dst, src, runs = merge_runs(local.addresses[lidx], remote.addresses[ridx], lengths)
        return MockXferHandle(self, remote.remote, dst, src, runs, bytes(notif_msg))

    def transfer(self, handle: MockXferHandle, notif_msg: bytes = b"") -> str:
        if handle.released:
            raise nixlInvalidParamError("mock: transfer of a released handle")
        if handle.op is not None and handle.op.state == "PROC":
            raise nixlRepostActiveError("mock: transfer request is still in progress")
        notif = bytes(notif_msg) or handle.notif
        if len(notif) > wire.MAX_NOTIF_BYTES - 1024:
            raise nixlInvalidParamError(f"mock: notification of {len(notif)} bytes is too long")
        callback = self.faults.before_post
        if callback is not None:  # outside our lock: it may talk to other processes
            callback(PostInfo(self._posts, handle.remote.card.name, len(handle.dst),
                              int(handle.lengths.sum()), notif))
        with self._lock:
            self._posts += 1
            card = handle.remote.card
            if self.faults.disconnect or wire.liveness(card.pid, card.start_ticks) is wire.Liveness.GONE:
                raise nixlRemoteDisconnectError(f"mock: remote agent {card.name!r} was disconnected")
            if self._remotes.get(card.name) is not handle.remote:
                raise nixlNotFoundError(f"mock: remote agent {card.name!r} was removed")
            op = _Op(handle.remote, handle.dst, handle.src, handle.lengths, notif, self.faults.pending_polls)
            handle.op = op
            self._pending.append(op)
            self._progress()
            return op.state

    def check_xfer_state(self, handle: MockXferHandle) -> str:
        with self._lock:
            op = handle.op
            if handle.released:
                raise nixlInvalidParamError("mock: state of a released handle")
            if op is None:
                raise nixlNotPostedError("mock: transfer was never posted")
            if self.faults.disconnect and op.state == "PROC":
                op.state, op.disconnected = "ERR", True
            if op.polls_left > 0 and op.state == "PROC":
                op.polls_left -= 1  # this poll is one of the N that report "in progress"
                return "PROC"
            self._progress()
            if op.disconnected:
                raise nixlRemoteDisconnectError(f"mock: remote agent {op.remote.card.name!r} disconnected")
            if op.state == "PROC" and self._remotes.get(op.remote.card.name) is not op.remote:
                raise nixlNotFoundError("mock: remote agent was invalidated during the transfer")
            return op.state

    def release_xfer_handle(self, handle: MockXferHandle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: MockDlistHandle) -> None:
        handle.release()

    # --- progress --------------------------------------------------------------------------

    def _progress(self) -> None:
        """Advance every pending op, released ones included (caller holds the lock)."""
        if not self._pending:
            return
        seen: dict[int, wire.Liveness] = {}
        for op in self._pending:
            self._advance(op, seen)
        self._pending = [op for op in self._pending if op.state == "PROC"]

    def _advance(self, op: _Op, seen: dict[int, wire.Liveness]) -> None:
        if op.state != "PROC" or self.faults.stall or op.polls_left > 0:
            return
        card = op.remote.card
        state = seen.get(card.pid)
        if state is None:
            state = seen[card.pid] = wire.liveness(card.pid, card.start_ticks)
        if state is wire.Liveness.GONE:
            op.state, op.disconnected = "ERR", True
            return
        if state is wire.Liveness.STOPPED:
            return
        if not op.copied:
            for dst, src, length in zip(op.dst.tolist(), op.src.tolist(), op.lengths.tolist(), strict=True):
                ctypes.memmove(dst, src, length)
            op.copied = True
        if op.notif:
            try:
                self._outbox.sendto(wire.encode_notif(self.name, op.notif), op.remote.address)
            except BlockingIOError:
                return  # the target's queue is full: try again at the next poll
            except (ConnectionRefusedError, FileNotFoundError):
                op.state, op.disconnected = "ERR", True
                return
        op.state = "DONE"

    # --- notifications ---------------------------------------------------------------------

    def get_new_notifs(self, backends: Any = ()) -> dict[str, list[bytes]]:
        with self._lock:
            self._progress()
        out: dict[str, list[bytes]] = {}
        for sender, message in self._inbox.drain(_DRAIN_LIMIT):
            out.setdefault(sender, []).append(message)
        return out

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: str | None = None) -> None:
        with self._lock:
            remote = self._remotes.get(remote_agent_name)
            if remote is None:
                raise nixlNotFoundError(f"mock: remote agent {remote_agent_name!r} not found")
            try:
                self._outbox.sendto(wire.encode_notif(self.name, bytes(notif_msg)), remote.address)
            except ValueError as exc:
                raise nixlInvalidParamError(f"mock: {exc}") from None
            except BlockingIOError:
                raise nixlBackendError(f"mock: notification queue of {remote_agent_name!r} is full") from None
            except (ConnectionRefusedError, FileNotFoundError):
                raise nixlRemoteDisconnectError(f"mock: remote agent {remote_agent_name!r} is gone") from None
