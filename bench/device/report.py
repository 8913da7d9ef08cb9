"""Results, errors and logs as the device check writes and reads them (device check driver and step processes)."""

from __future__ import annotations

import json
import os
import re
import traceback
from pathlib import Path
from typing import Any

# UCX_PROTO_INFO lines: "[time] [host:pid:thread]   | cells |".
_UCX_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]]*\]\s*")


def describe_error(exc: BaseException) -> dict[str, str]:
    """What failed and why: type, message, the traceback's last lines."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": "".join(lines)[-3000:]}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically: a run killed mid-write leaves the previous version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


class Partial:
    """A step's result, written to its file after every measurement."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"ok": False}

    def save(self) -> None:
        write_json(self.path, self.data)


def log_lines(path: Path, pattern: re.Pattern[str], limit: int) -> list[str]:
    """Distinct lines of a log that match ``pattern``, in order, at most ``limit``."""
    if not path.is_file():
        return []
    out: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        if pattern.search(line):
            text = line.strip()[:300]
            if text and text not in out:
                out.append(text)
                if len(out) >= limit:
                    break
    return out


def ucx_protocols(path: Path, limit: int = 24) -> list[str]:
    """What UCX chose for each remote-memory operation, from the ``UCX_PROTO_INFO=y`` tables in a log.

    One line per operation and scope: ``remote memory read by ucp_get* from cuda/GPU0 to cuda
    (intra-node): 0..inf zero-copy cuda_ipc/cuda`` (scope: ``self`` within one process,
    ``intra-node`` between processes of one host).
    """
    if not path.is_file():
        return []
    found: dict[str, list[str]] = {}
    scope = operation = ""
    for line in path.read_text(errors="replace").splitlines():
        text = _UCX_PREFIX.sub("", line).strip()
        if not (text.startswith("|") and text.endswith("|")):
            continue
        cells = [cell.strip() for cell in text.strip("|").split("|")]
        if len(cells) == 1:
            if " cfg#" in cells[0]:
                scope = "intra-node" if "intra-node" in cells[0] else "inter-node" if "inter-node" in cells[0] \
                    else "self"
            else:
                operation = cells[0]
        elif len(cells) == 3 and cells[0] != "Range" and operation.startswith("remote memory"):
            rows = found.setdefault(f"{operation} ({scope})", [])
            row = " ".join(cells)
            if row not in rows:
                rows.append(row)
    return [f"{key}: {'; '.join(rows)}" for key, rows in list(found.items())[:limit]]


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""
