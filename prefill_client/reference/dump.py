"""Dump of what the prefill worker merged, per request and item, for checking outside it (prefill process).

``epd prefill --dump-dir DIR`` wraps the worker's row store in a
:class:`MergeRecorder`. After each step has staged its rows, the recorder
reads back, for every placement, exactly the rows the merge gathers (its
blocks, each block's real rows) and keeps a copy. Once the request is done,
:func:`write_request` stores them and appends one JSON line:

- ``DIR/requests.jsonl``: one object per request, in order: the fields of
  ``epd prefill --json`` for the request (index, first token, TTFT, prompt and
  prefix-hit tokens, each item's ``mm_hash``, offset and serving layer) plus
  ``dumps``, one entry per merged item: ``item`` (index in the request),
  ``mm_hash``, ``lo`` (first item-local row merged; > 0 when the item's head
  lay inside the prefix hit), ``rows`` and ``file``;
- ``DIR/r{request}-i{item}-{mm_hash}.pt``: ``torch.save`` of
  ``{"mm_hash", "lo", "rows"}``, ``rows`` being ``[n, fat_dim]`` in the
  staging dtype (main rows then the deepstack levels, as the encoder wrote them).

Items served from the prefix cache are not merged (their KV is reused), so
they have no file; a checker proves them by the request that first merged them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.config import CacheMode
from prefill_client.reference.positions import ItemPlacement
from prefill_client.reference.rows import RowStore, ScheduledItem

logger = logging.getLogger(__name__)

REQUESTS_FILE = "requests.jsonl"


@dataclass(frozen=True, slots=True)
class MergedRows:
    """Rows of one item that one step merged into the sequence."""

    mm_hash: str
    offset: int  # sequence position of the item's first placeholder
    lo: int  # item-local index of the first merged row
    rows: torch.Tensor  # [n, fat_dim], a copy taken from the buffer the merge gathers from


class MergeRecorder:
    """A :class:`RowStore` that keeps a copy of every placed item's rows."""

    def __init__(self, inner: RowStore) -> None:
        self.inner = inner
        self._merged: list[MergedRows] = []

    @property
    def mode(self) -> CacheMode:
        return self.inner.mode

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def place(
        self, items: Sequence[ScheduledItem], window: tuple[int, int]
    ) -> tuple[torch.Tensor, list[ItemPlacement]]:
        buffer, placements = self.inner.place(items, window)
        # A placement starts at its item's first row inside the window: that
        # sequence position names the item (two items never share a position).
        by_start: dict[int, ScheduledItem] = {}
        for item in items:
            lo, hi = item.window_part(window)
            if hi > lo:
                by_start[item.offset + lo] = item
        # One step per request: what an earlier, failed step staged is not this request's.
        self._merged = []
        for p in placements:
            owner = by_start.get(p.offset)
            if owner is None or owner.mm_hash != p.mm_hash:
                raise ValueError(f"placement of {p.mm_hash} at {p.offset} matches no scheduled item")
            rows = torch.cat([buffer[b, :n] for b, n in zip(p.block_ids, p.tokens_per_block, strict=True)])
            self._merged.append(MergedRows(p.mm_hash, owner.offset, p.offset - owner.offset, rows.clone()))
        return buffer, placements

    def take(self) -> list[MergedRows]:
        """The rows merged by the last step, forgotten here."""
        merged, self._merged = self._merged, []
        return merged


def write_request(
    dump_dir: Path, index: int, record: Mapping[str, Any], merged: Sequence[MergedRows]
) -> dict[str, Any]:
    """Store one request's merged rows and append its JSON line; returns the line's object.

    ``record`` is the request's ``--json`` object; its ``items`` (with
    ``offset``) tell which item each merged row set belongs to.
    """
    item_at = {int(item["offset"]): k for k, item in enumerate(record["items"])}
    dumps: list[dict[str, Any]] = []
    for m in merged:
        k = item_at.get(m.offset)
        if k is None:
            raise ValueError(f"request {index}: merged rows of {m.mm_hash} at {m.offset} match no item")
        name = f"r{index:05d}-i{k:03d}-{m.mm_hash}.pt"
        torch.save({"mm_hash": m.mm_hash, "lo": m.lo, "rows": m.rows}, dump_dir / name)
        dumps.append({"item": k, "mm_hash": m.mm_hash, "lo": m.lo, "rows": int(m.rows.shape[0]), "file": name})
    line = {**record, "dumps": dumps}
    with open(dump_dir / REQUESTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    logger.debug("request %d: dumped %d merged items", index, len(dumps))
    return line
