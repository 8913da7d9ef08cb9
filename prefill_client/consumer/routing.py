"""Routing of items to encoder pods by rendezvous hashing (any process that pulls or places).

An item lives on exactly one encoder: the one whose ``score(key, target)`` is
highest. When that encoder is down the item goes to the next in the same
order, so every client that sees the same set of encoders agrees on where an
item lives, and removing one encoder moves only that encoder's items.

Targets are ``HOST:PORT`` strings; ``dns:///NAME:PORT``, which is resolved
to every address behind the name (a headless Service lists every encoder pod);
or ``file:PATH``, a file with one target per line (``#`` starts a comment),
such as a mounted ConfigMap. :class:`prefill_client.consumer.pool.EncoderPool`
resolves them again while it runs, so encoders come and go without a restart.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.errors import ConfigError


def rendezvous_order(key: str, targets: Sequence[str], identity: Mapping[str, str] | None = None) -> list[str]:
    """Targets from most to least preferred for ``key`` (highest random weight first).

    A target's weight comes from ``identity[target]`` when given (the name an encoder announces,
    which survives its restarts), else from the target itself.
    """

    def score(target: str) -> int:
        name = identity.get(target, target) if identity is not None else target
        digest = hashlib.blake2b(f"{name}|{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(targets, key=lambda t: (score(t), t), reverse=True)


def split_host_port(target: str, what: str = "encoder") -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} target {target!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def file_targets(path: str, what: str = "encoder") -> list[str]:
    """The entries of a ``file:`` list, one a line (``#`` starts a comment), not resolved."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} list {path!r}: {exc}") from exc
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    found = [line for line in lines if line]
    if any(line.startswith("file:") for line in found):
        raise ConfigError(f"{what} list {path!r} names another file; list HOST:PORT or dns:/// targets")
    return found


def resolve_targets(targets: Sequence[str], what: str = "encoder") -> list[str]:
    """Expand ``dns:///NAME:PORT`` into one ``ADDR:PORT`` per resolved address and ``file:PATH``
    into the targets it lists (resolved the same way); ``what`` names them in errors."""
    out: list[str] = []
    expanded: list[str] = []
    for target in targets:
        expanded += file_targets(target[len("file:"):], what) if target.startswith("file:") else [target]
    for target in expanded:
        if target.startswith("dns:///"):
            host, port = split_host_port(target[len("dns:///"):], what)
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ConfigError(f"cannot resolve {what} name {host!r}: {exc}") from exc
            for info in infos:
                addr = str(info[4][0])
                entry = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
                if entry not in out:
                    out.append(entry)
        else:
            split_host_port(target, what)
            if target not in out:
                out.append(target)
    if not out:
        raise ConfigError(f"no {what} targets given")
    return out
