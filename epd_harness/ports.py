"""Fixed ports for the processes a test or bench run must tell their port before they start (that run's process).

A port found by binding port 0 and closing the socket is an *ephemeral* port: the kernel hands
the same range to every later ``bind(0)`` and outgoing connection, so between our close and the
child's bind another process (a vLLM engine opening its ZMQ sockets, a gRPC channel) can take
it, and the child dies on ``EADDRINUSE``. These ports come from below the ephemeral range
instead, which the kernel never assigns by itself, and each is handed out once per process.
"""

from __future__ import annotations

import random
import socket
import threading

_SPAN = 12_000  # how far below the ephemeral range the ports come from
_given: set[int] = set()
_lock = threading.Lock()


def ephemeral_floor() -> int:
    """The lowest port the kernel assigns to ``bind(0)`` (``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every IPv4 address: a listener on any of them conflicts
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port no process listens on, outside the kernel's ephemeral range, not handed out before."""
    top = ephemeral_floor()
    bottom = max(1024, top - _SPAN)
    if top - bottom < 100:
        raise RuntimeError(f"ephemeral port range starts at {top}: no room below it for fixed test ports")
    with _lock:
        for _ in range(200):
            port = random.randrange(bottom, top)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port in [{bottom}, {top}) after 200 tries")
