"""Step 2, pulls: verified pulls into device landing blocks (device check step process; launched by the driver).

A consumer process: ``EncoderCacheClient(landing_device=...)`` encodes images and a video one
request at a time, then a fresh client pulls all of them in one batch by ``Lookup``; every
item's rows are compared with the same tower run here through the same serving path, and with
its plain forward. The driver starts it with ``UCX_PROTO_INFO=y`` and reads the protocols UCX
chose from its log.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

import torch

from bench.device.report import Partial, ucx_protocols
from bench.device.shapes import MODEL_ID, TOWER_DTYPE, Shapes, sync
from encoder_server.preprocess import PreprocessConfig, Preprocessor
from encoder_server.vision import EncoderRunner, default_tokens_per_block, load_encoder
from epd_harness.media import image_bytes, video_frames
from prefill_client.consumer import EncoderCacheClient, MediaSpec

if TYPE_CHECKING:
    from bench.device.driver import Run

# Rows that are not bit-equal to the local run but within this (relative to the largest value) differ
# by the cache dtype's rounding only (reported as ``within_rounding``; the step still fails).
ROWS_TOLERANCE = 1e-2


class LocalTower:
    """The encoder's tower run in this process on the same device: the rows each item must have."""

    def __init__(self, checkpoint: str, device: torch.device, block_size: int) -> None:
        self.encoder = load_encoder(checkpoint, device=device, dtype=TOWER_DTYPE)
        self.preprocessor = Preprocessor(PreprocessConfig.for_encoder(self.encoder, weights_dir=checkpoint))
        self.runner = EncoderRunner(self.encoder, block_size=block_size, backend="eager")
        self.block_size = block_size
        self.device = device

    def item(self, spec: MediaSpec) -> Any:
        if spec.kind == "image":
            return self.preprocessor.image(spec.frames[0])
        return self.preprocessor.video(spec.frames, fps=spec.fps or None)

    def serving_rows(self, item: Any) -> torch.Tensor:
        """The serving path, one item alone (as the encoder ran it), into a cache buffer of the cache dtype."""
        counts = default_tokens_per_block(item.num_tokens, self.block_size)
        blocks = list(range(len(counts)))
        buffer = torch.zeros(len(counts) + 1, self.block_size, self.encoder.fat_dim, dtype=torch.bfloat16,
                             device=self.device)
        self.runner.write([item], [blocks], [counts], buffer, len(counts))
        return torch.cat([buffer[b, :n] for b, n in zip(blocks, counts)])

    @torch.no_grad()
    def embed_rows(self, item: Any) -> torch.Tensor:
        return self.encoder.embed(item.pixel_values.to(self.device), [item.grid_thw])


def compare(pulled: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    if tuple(pulled.shape) != tuple(reference.shape):
        return {"bitwise_equal": False, "shape": list(pulled.shape), "reference_shape": list(reference.shape)}
    ref = reference.to(pulled.device)
    scale = float(ref.float().abs().max().clamp_min(1e-12))
    return {"bitwise_equal": bool(torch.equal(pulled, ref.to(pulled.dtype))),
            "max_rel_diff": float((pulled.float() - ref.float()).abs().max()) / scale,
            "all_zero": not bool(pulled.any())}


def role_pulls(p: Partial, shapes: Shapes, args: argparse.Namespace) -> None:
    device = torch.device(shapes.device)
    specs = [(f"image {w}x{h}", MediaSpec.image(image_bytes(w, h, seed=i))) for i, (w, h) in enumerate(shapes.images)]
    w, h, n = shapes.video
    specs.append((f"video {w}x{h}x{n}", MediaSpec.video(video_frames(w, h, n, seed=7))))
    local = LocalTower(args.checkpoint, device, args.block_size)
    items = [local.item(spec) for _, spec in specs]
    serving = [local.serving_rows(item) for item in items]
    plain = [local.embed_rows(item) for item in items]
    sync(device)
    p.data.update(landing_device=str(device), transport=args.transport, block_size=args.block_size, items=[])
    p.save()

    def check(name: str, pulled: Any, i: int, seconds: float | None) -> dict[str, Any]:
        row: dict[str, Any] = {"item": name, "tokens": pulled.num_tokens, "source": pulled.source,
                               "rows_device": str(pulled.embeddings.device), **compare(pulled.embeddings, serving[i])}
        embed = compare(pulled.embeddings, plain[i])
        row["max_rel_diff_vs_embed"] = embed.get("max_rel_diff")
        if seconds is not None:
            row["ms"] = round(seconds * 1e3, 2)
        return row

    client_args: dict[str, Any] = dict(transport_kind=args.transport, landing_device=device,
                                       landing_blocks=shapes.landing_blocks, pull_timeout_s=10.0, rpc_timeout_s=60.0)
    hashes: list[str] = []
    # One request an item: the encoder runs each alone, as the local serving path did.
    with EncoderCacheClient(args.target, MODEL_ID, **client_args) as client:
        for i, (name, spec) in enumerate(specs):
            started = time.perf_counter()
            pulled = client.encode([spec])[0]
            sync(device)
            p.data["items"].append(check(name, pulled, i, time.perf_counter() - started))
            hashes.append(pulled.mm_hash)
            p.save()
    # A fresh client (empty local cache): one Lookup, one block READ and one stamp READ for all items.
    with EncoderCacheClient(args.target, MODEL_ID, **client_args) as fresh:
        started = time.perf_counter()
        found = fresh.lookup(hashes, require=True)
        sync(device)
        seconds = time.perf_counter() - started
        p.data["batched"] = {"ms": round(seconds * 1e3, 2), "items": [
            check(name, pulled, i, None) for i, ((name, _), pulled) in enumerate(zip(specs, found))
            if pulled is not None]}
    rows = p.data["items"] + p.data["batched"]["items"]
    equal = sum(1 for r in rows if r.get("bitwise_equal"))
    p.data["rows_equal"] = f"{equal}/{len(rows)}"
    worst = max((r.get("max_rel_diff", 1.0) for r in rows), default=1.0)
    p.data["worst_max_rel_diff"] = worst
    if any(not r.get("bitwise_equal") for r in p.data["items"]) and all(
            r.get("bitwise_equal") for r in p.data["batched"]["items"]):
        p.data["diagnosis"] = ("rows pulled right after Encode answered differ from the reference, the same blocks "
                               "pulled later equal it: the encoder answered before its device write had finished")
    on_device = all(r["rows_device"].split(":")[0] == device.type for r in rows)
    sources = [r["source"] for r in p.data["items"]] == ["miss"] * len(specs) and \
        [r["source"] for r in p.data["batched"]["items"]] == ["hit"] * len(specs)
    # Equal means bit for bit: the reference ran the same kernels on the same device in the same dtype.
    p.data["within_rounding"] = worst <= ROWS_TOLERANCE
    p.data["ok"] = bool(len(rows) == 2 * len(specs) and equal == len(rows) and on_device and sources)


def run_pulls(run: Run, budget: float) -> dict[str, Any]:
    """The step: the consumer process against the encoder step's encoder, then UCX's protocols from its log."""
    if run.encoder is None or run.encoder.proc.poll() is not None or run.handshake is None:
        return {"ok": False, "skipped": "no encoder to pull from (step encoder failed)"}
    env = {**run.env, "UCX_PROTO_INFO": "y"}
    target = run.report["steps"]["encoder"]["target"]
    data = run.child("pulls", budget, "--target", target, "--checkpoint", str(run.checkpoint),
                     "--block-size", str(run.handshake.layout.block_size), "--transport", run.handshake.transport,
                     env=env)
    data["ucx_protocols"] = ucx_protocols(run.out / "pulls.log")
    return data
