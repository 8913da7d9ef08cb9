"""What mock agents exchange: JSON metadata, process liveness, notification datagrams (both processes).

The mock agent's metadata is a JSON "card" (never pickle): the agent name,
its process id and start time, and every registered region that lives in
shared memory. Notifications travel as datagrams on an abstract-namespace
Unix socket named after the target's pid and agent name. A peer's process
state stands in for what UCX learns from the network: a stopped process
makes no progress, a vanished one is a disconnect.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import json
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from common.transport.shm import SEGMENT_NAME

logger = logging.getLogger(__name__)

CARD_FORMAT = "epd-mock-nixl"
CARD_VERSION = 1
MAX_CARD_BYTES = 1 << 20
MAX_CARD_REGIONS = 4096
# Kept below the default Unix datagram limit so a notification always fits.
MAX_NOTIF_BYTES = 60_000
# Notifications received but not yet drained. The kernel's datagram queue
# holds only net.unix.max_dgram_qlen (often 10), so a thread empties the
# socket into this queue; past the limit it stops reading and senders see
# back-pressure (their transfer stays in progress) rather than loss.
INBOX_LIMIT = 65536
_RX_POLL_S = 0.1
_NAME_LEN = struct.Struct("!H")
_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class ExportedRegion:
    """A registered DRAM region another process can read: where it is and which segment holds it."""

    address: int
    length: int
    device: int
    segment: str
    offset: int


@dataclass(frozen=True, slots=True)
class AgentCard:
    """A mock agent's metadata."""

    name: str
    pid: int
    start_ticks: int
    regions: tuple[ExportedRegion, ...]

    def encode(self) -> bytes:
        body = {
            "format": CARD_FORMAT,
            "version": CARD_VERSION,
            "name": self.name,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "regions": [
                {"address": r.address, "length": r.length, "device": r.device, "segment": r.segment,
                 "offset": r.offset}
                for r in self.regions
            ],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> AgentCard:
        """Parse and check a peer's card; ``ValueError`` naming the first problem."""
        if len(data) > MAX_CARD_BYTES:
            raise ValueError(f"mock agent metadata of {len(data)} bytes exceeds {MAX_CARD_BYTES}")
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"mock agent metadata is not JSON: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != CARD_FORMAT:
            raise ValueError("metadata is not a mock NIXL agent card")
        if body.get("version") != CARD_VERSION:
            raise ValueError(f"mock agent card version {body.get('version')!r} is not {CARD_VERSION}")
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"mock agent card has no valid name: {name!r}")
        raw_regions = body.get("regions")
        if not isinstance(raw_regions, list) or len(raw_regions) > MAX_CARD_REGIONS:
            raise ValueError("mock agent card regions must be a list of at most "
                             f"{MAX_CARD_REGIONS}")
        regions = tuple(_region(r) for r in raw_regions)
        return cls(name, _uint(body, "pid", 1 << 31), _uint(body, "start_ticks", _U64), regions)


def _uint(body: dict[str, Any], key: str, limit: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise ValueError(f"mock agent card field {key} must be an integer in 0..{limit - 1}, got {value!r}")
    return value


def _region(raw: object) -> ExportedRegion:
    if not isinstance(raw, dict):
        raise ValueError(f"mock agent card region must be an object, got {raw!r}")
    segment = raw.get("segment")
    # Only names we create: a peer must not make us open an arbitrary file.
    if not isinstance(segment, str) or SEGMENT_NAME.match(segment) is None:
        raise ValueError(f"mock agent card names an invalid segment {segment!r}")
    region = ExportedRegion(
        _uint(raw, "address", _U64), _uint(raw, "length", _U64), _uint(raw, "device", 1 << 32),
        segment, _uint(raw, "offset", _U64),
    )
    if region.address == 0 or region.length == 0 or region.address + region.length > _U64:
        raise ValueError(f"mock agent card region {region} is empty or out of range")
    return region


# --- process liveness -------------------------------------------------------------------------


class Liveness(enum.Enum):
    RUNNING = "running"
    STOPPED = "stopped"  # SIGSTOP / traced: a frozen peer, transfers make no progress
    GONE = "gone"  # exited, zombie, or the pid now names another process


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after it.
    return raw[raw.rfind(")") + 2 :].split()


def process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid apart); 0 if unknown."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else 0


def liveness(pid: int, start_ticks: int) -> Liveness:
    if pid == os.getpid():
        return Liveness.RUNNING
    fields = _stat_fields(pid)
    if not fields or len(fields) <= 19:
        return Liveness.GONE
    if start_ticks and int(fields[19]) != start_ticks:
        return Liveness.GONE
    state = fields[0]
    if state in ("Z", "X", "x"):
        return Liveness.GONE
    if state in ("T", "t"):
        return Liveness.STOPPED
    return Liveness.RUNNING


# --- notifications -------------------------------------------------------------------------------


def socket_address(pid: int, agent_name: str) -> bytes:
    """Abstract-namespace address of an agent's notification socket."""
    digest = hashlib.sha256(agent_name.encode()).hexdigest()[:24]
    return f"\0epd-mock-nixl/{pid}/{digest}".encode()


def encode_notif(sender: str, message: bytes) -> bytes:
    name = sender.encode()
    if len(message) + len(name) + _NAME_LEN.size > MAX_NOTIF_BYTES:
        raise ValueError(f"notification of {len(message)} bytes exceeds the mock limit of {MAX_NOTIF_BYTES}")
    return _NAME_LEN.pack(len(name)) + name + message


def decode_notif(datagram: bytes) -> tuple[str, bytes]:
    if len(datagram) < _NAME_LEN.size:
        raise ValueError(f"notification datagram of {len(datagram)} bytes has no header")
    (size,) = _NAME_LEN.unpack_from(datagram)
    end = _NAME_LEN.size + size
    if len(datagram) < end:
        raise ValueError("notification datagram is shorter than its sender name")
    return datagram[_NAME_LEN.size : end].decode("utf-8", "replace"), datagram[end:]


class NotificationInbox:
    """An agent's notification socket, emptied into a bounded queue by a daemon thread."""

    def __init__(self, pid: int, agent_name: str) -> None:
        self._name = agent_name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(socket_address(pid, agent_name))
        self._sock.settimeout(_RX_POLL_S)
        self._queue: collections.deque[tuple[str, bytes]] = collections.deque()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._receive, name=f"mock-nixl-rx-{agent_name}", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closing.is_set():
            if len(self._queue) >= INBOX_LIMIT:
                self._closing.wait(_RX_POLL_S)
                continue
            try:
                datagram = self._sock.recv(MAX_NOTIF_BYTES + 1024)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self._queue.append(decode_notif(datagram))
            except ValueError as exc:
                logger.warning("mock agent %s dropped a malformed notification: %s", self._name, exc)

    def drain(self, limit: int) -> list[tuple[str, bytes]]:
        """Up to ``limit`` received ``(sender, message)`` pairs, oldest first; never blocks."""
        out: list[tuple[str, bytes]] = []
        while len(out) < limit:
            try:
                out.append(self._queue.popleft())
            except IndexError:
                break
        return out

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=2 * _RX_POLL_S + 1.0)
        self._sock.close()
