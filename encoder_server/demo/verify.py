"""Check every item the demo's workers merged against a local reference encode (demo orchestrator).

The reference is the default encoder (``load_encoder()``, seed 0, the same
one ``epd encoder`` builds without ``--weights``) run plainly on the same
bytes. A merged item passes when

1. its rows are the reference's rows ``lo .. num_tokens - 1`` up to the
   cache dtype's rounding (bf16: ``rtol = atol = 2e-2``), and
2. no other item's reference is at least as close: a wrong item that happens
   to be within tolerance is still caught.

Every item's ``mm_hash`` as the worker reports it must be the one computed
here from the bytes the orchestrator sent at that position (model id,
preprocessing fingerprint, content hash). Items a worker served from its
prefix cache were not merged (their KV was reused); they pass when the same
worker verified the same ``mm_hash`` in an earlier request, the one whose KV
it reused.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common import media as media_hash
from common.config import EncoderServerConfig
from encoder_server.demo.procs import DemoFailure
from encoder_server.demo.workload import Media, PlannedRequest
from encoder_server.preprocess import PreprocessConfig, Preprocessor
from encoder_server.vision import load_encoder

logger = logging.getLogger(__name__)

RTOL = 2e-2
ATOL = 2e-2
REQUESTS_FILE = "requests.jsonl"  # written by `epd prefill --dump-dir`
PREFIX_LAYER = "prefix"


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    error: float  # mean absolute difference from the item's own reference rows
    detail: str


def compare_rows(rows: torch.Tensor, lo: int, own: str, references: Mapping[str, torch.Tensor]) -> Verdict:
    """Do ``rows`` equal rows ``lo ..`` of ``references[own]``, and match no other reference as well?"""
    ref = references[own]
    n = int(rows.shape[0]) if rows.dim() == 2 else -1
    if rows.dim() != 2 or rows.shape[1] != ref.shape[1]:
        return Verdict(False, float("inf"), f"rows {tuple(rows.shape)}, expected [*, {ref.shape[1]}]")
    if lo < 0 or lo + n != ref.shape[0]:
        return Verdict(False, float("inf"),
                       f"rows {lo}..{lo + n - 1} do not end the item's {ref.shape[0]} reference rows")
    got = rows.float()
    want = ref[lo:].float()
    error = float((got - want).abs().mean())
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        worst = float((got - want).abs().max())
        return Verdict(False, error, f"differs from its reference: max |diff| {worst:.4g}, mean {error:.4g}")
    for key, other in references.items():
        if key == own or other.shape[0] < lo + n or other.shape[1] != ref.shape[1]:
            continue
        other_error = float((got - other[lo:lo + n].float()).abs().mean())
        if other_error <= error:
            return Verdict(False, error, f"matches {key} at least as well (mean {other_error:.4g} <= {error:.4g})")
    return Verdict(True, error, "ok")


@dataclass(frozen=True, slots=True)
class References:
    """What the encoder should produce for each media item, by media key."""

    rows: dict[str, torch.Tensor]  # [num_tokens, fat_dim], float32
    hashes: dict[str, str]  # mm_hash


class ReferenceEncoder:
    """The default encoder and its preprocessing, in this process."""

    def __init__(self, model_id: str = EncoderServerConfig().model_id) -> None:
        self.model_id = model_id
        self.encoder = load_encoder()
        self.config = PreprocessConfig.for_encoder(self.encoder)
        self.preprocessor = Preprocessor(self.config)

    def mm_hash(self, media: Media) -> str:
        """The item's name as the encoder computes it from the same bytes."""
        content = media_hash.content_hash(media.kind, media.frames, media.fps or None)
        return media_hash.mm_hash(self.model_id, self.config.fingerprint(), content)

    @torch.no_grad()
    def encode(self, media: Media) -> torch.Tensor:
        if media.kind == "image":
            item = self.preprocessor.image(media.frames[0])
        else:
            item = self.preprocessor.video(media.frames, fps=media.fps or None)
        out: torch.Tensor = self.encoder.embed(item.pixel_values, torch.tensor([item.grid_thw]))
        return out.float()

    def references(self, media: Mapping[str, Media]) -> References:
        return References({k: self.encode(m) for k, m in media.items()}, {k: self.mm_hash(m) for k, m in media.items()})


class ReferenceJob:
    """The reference encode of every media item, on a thread, so it overlaps the workload."""

    def __init__(self, media: Mapping[str, Media]) -> None:
        self._media = dict(media)
        self._out = References({}, {})
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="reference-encode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out = ReferenceEncoder().references(self._media)
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc

    def result(self, timeout_s: float) -> References:
        """The references; DemoFailure if the encode failed or missed the deadline."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise DemoFailure(f"reference encode not done within {timeout_s:.0f} s")
        if self._error is not None:
            raise DemoFailure(f"reference encode failed: {self._error!r}") from self._error
        return self._out


@dataclass(slots=True)
class Verification:
    """Totals over every worker."""

    verified: int = 0  # merged items that matched their reference
    prefix_items: int = 0  # items served from a prefix cache whose first merge was verified
    mismatches: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"verified_items": self.verified, "verified_prefix_items": self.prefix_items,
                "mismatches": len(self.mismatches), "mismatch_details": self.mismatches[:20]}


def read_records(dump_dir: Path) -> list[dict[str, Any]]:
    path = dump_dir / REQUESTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def verify_stream(
    v: Verification, worker: str, plan: Sequence[PlannedRequest], dump_dir: Path,
    references: References,
) -> None:
    """Check one worker's dumped requests against its plan; findings accumulate in ``v``."""
    records = read_records(dump_dir)
    if len(records) != len(plan):
        v.mismatches.append(f"{worker}: {len(records)} requests dumped, {len(plan)} sent")
    merged_here: set[str] = set()  # mm_hashes this worker merged and verified so far
    for planned, record in zip(plan, records, strict=False):  # a shortfall is reported above
        where = f"{worker} request {planned.index}"
        items = record.get("items", [])
        if record.get("index") != planned.index or len(items) != len(planned.media):
            v.mismatches.append(f"{where}: dumped {len(items)} items for request {record.get('index')}, "
                                f"sent {len(planned.media)}")
            continue
        dumps = {int(d["item"]): d for d in record.get("dumps", [])}
        for k, (key, item) in enumerate(zip(planned.media, items, strict=True)):
            at = f"{where} item {k} ({key}, {item['layer']})"
            if item["mm_hash"] != references.hashes[key]:
                v.mismatches.append(f"{at}: named {item['mm_hash']}, its bytes hash to {references.hashes[key]}")
                continue
            if item["layer"] == PREFIX_LAYER:
                if item["mm_hash"] in merged_here:
                    v.prefix_items += 1
                else:
                    v.mismatches.append(f"{at}: served from the prefix cache but never merged before")
                continue
            dump = dumps.get(k)
            if dump is None:
                v.mismatches.append(f"{at}: merged but no rows were dumped")
                continue
            saved = torch.load(dump_dir / dump["file"], weights_only=True)
            verdict = compare_rows(saved["rows"], int(saved["lo"]), key, references.rows)
            if saved["mm_hash"] != item["mm_hash"]:
                verdict = Verdict(False, verdict.error, f"dump names {saved['mm_hash']}")
            if verdict.ok:
                v.verified += 1
                merged_here.add(item["mm_hash"])
            else:
                v.mismatches.append(f"{at}: {verdict.detail}")
