"""Graph backends for the aliased encoder write: eager, torch.compile, Neuron (encoder process).

The graph takes the pixel inputs, the packing metadata, the cache buffer and
the destination row of every output row, runs the tower, ``index_copy_``s the
rows into the buffer and returns the buffer. The buffer is an input-output
alias: the graph writes its storage in place (Inductor emits the
``index_copy`` as a store into the argument; no copy of the buffer, no
device-to-host transfer).

* ``eager``: PyTorch eager, any device. Frames back to back with no padding
  (:func:`frames_write`): a launch costs exactly its rows.
* ``compile``: ``torch.compile(fullgraph=True)`` of :func:`frames_write`
  (CPU and CUDA), one graph per bucket whose row count is dynamic within the
  bucket's range (above the next smaller bucket, up to its own): the frames
  of a launch lie back to back, padded only to a multiple of
  :data:`ROW_MULTIPLE` merged tokens; attention by frame is one opaque custom
  op, so which frames a launch holds never changes the graph. Padding every
  launch to its bucket instead cost up to half the work: 640 merged tokens
  padded to 1,024 ran Qwen3-VL-2B's tower at 0.76x transformers against 1.09x
  eager (``BENCHMARKS.md``). Exact-size launches (an oversize frame) run
  eagerly, so they never trigger a recompile.
* ``neuron``: ``torch_neuronx.trace`` per bucket shape with the buffer declared
  as an aliased state tensor; frames packed into ``[n, L]`` attention blocks
  with a mask per frame (:attr:`Layout.BLOCKS`), as a traced graph needs every
  shape and op static. Imported lazily; without ``torch-neuronx`` it fails at
  construction with a message saying what to install.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from common.errors import ConfigError
from encoder_server.vision.model import VisionEncoder
from encoder_server.vision.packing import BucketShape

logger = logging.getLogger(__name__)

BACKENDS = ("eager", "compile", "neuron", "auto")

# What "auto" picks on a CPU. Measured with bench/encoder.py on the development
# host (2 cores): the compiled graph was faster in every bucket.
CPU_AUTO_BACKEND = "compile"
# Launches of the compiled graph are padded to a multiple of this many merged tokens: a row
# count of 1 would be specialized by the compiler (a recompile), and a few shapes fewer cost
# at most 7 tokens of work a launch.
ROW_MULTIPLE = 8


def padded_tokens(tokens: int, multiple: int, bucket: int) -> int:
    """The merged tokens a launch of ``tokens`` runs at: up to a multiple of ``multiple``, never past ``bucket``."""
    return min(-(-tokens // multiple) * multiple, bucket)


class Layout(enum.Enum):
    """How a launch's frames lie in its inputs."""

    FRAMES = "frames"  # back to back from row 0; tail padding; attention by frame
    BLOCKS = "blocks"  # in [n, L] attention blocks; padding at each block's end; attention masked


@dataclass(frozen=True, slots=True)
class LaunchInputs:
    """The inputs of one launch (all on the encoder's device but ``frames``), flat over ``rows`` patches.

    In the blocks layout, ``rows = n * L`` and block ``b`` is rows ``[b*L, (b+1)*L)``.
    """

    patches: torch.Tensor  # frames layout: [rows, hidden_size] patch embeddings; blocks: [rows, patch_dim] pixels
    interp_index: torch.Tensor  # [rows, 4] int64
    interp_weight: torch.Tensor  # [rows, 4] float32
    positions: torch.Tensor  # [rows, 2] int64 (row, col)
    frames: torch.Tensor  # frames layout: patches per frame, int64 on the host, zero-padded; blocks: empty
    segments: torch.Tensor  # blocks layout: [rows] int32, one id per frame, -1 on padding; frames: empty
    dest: torch.Tensor  # [rows / merge**2] int64 flat buffer rows; padding -> scratch block


def frames_write(
    encoder: VisionEncoder,
    patches: torch.Tensor,
    interp_index: torch.Tensor,
    interp_weight: torch.Tensor,
    positions: torch.Tensor,
    frames: torch.Tensor,
    dest: torch.Tensor,
    buffer: torch.Tensor,
) -> torch.Tensor:
    """Encode one launch (frames layout) and scatter its rows into ``buffer`` in place; returns ``buffer``."""
    rows = encoder.forward_frames(patches, interp_index, interp_weight, positions, frames)
    buffer.view(-1, buffer.shape[-1]).index_copy_(0, dest, rows.to(buffer.dtype))
    return buffer


def _frames_write_by_token(
    encoder: VisionEncoder,
    patches: torch.Tensor,
    interp_index: torch.Tensor,
    interp_weight: torch.Tensor,
    positions: torch.Tensor,
    frames: torch.Tensor,
    dest: torch.Tensor,
    buffer: torch.Tensor,
) -> torch.Tensor:
    """:func:`frames_write` of inputs grouped by merged token: ``[tokens, merge**2, ...]``."""
    return frames_write(encoder, patches.flatten(0, 1), interp_index.flatten(0, 1), interp_weight.flatten(0, 1),
                        positions.flatten(0, 1), frames, dest, buffer)


class GraphBackend(Protocol):
    name: str
    layout: Layout
    static_shapes: bool  # False: launches are not padded to their bucket
    row_multiple: int  # launches that are not padded to their bucket: padded to a multiple of this
    frame_slots: int | None  # frames layout: the frames tensor's fixed length (None: one entry a frame)

    def run(self, shape: BucketShape, exact: bool, inputs: LaunchInputs, buffer: torch.Tensor) -> torch.Tensor:
        ...


def _call(fn: Any, encoder: VisionEncoder, inputs: LaunchInputs, buffer: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = fn(encoder, inputs.patches, inputs.interp_index, inputs.interp_weight,
                           inputs.positions, inputs.frames, inputs.dest, buffer)
    return out


class EagerBackend:
    name = "eager"
    layout = Layout.FRAMES
    static_shapes = False
    row_multiple = 1
    frame_slots: int | None = None

    def __init__(self, encoder: VisionEncoder) -> None:
        self._encoder = encoder

    def run(self, shape: BucketShape, exact: bool, inputs: LaunchInputs, buffer: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _call(frames_write, self._encoder, inputs, buffer)


class CompileBackend:
    name = "compile"
    layout = Layout.FRAMES
    static_shapes = False
    row_multiple = ROW_MULTIPLE
    frame_slots: int | None

    def __init__(self, encoder: VisionEncoder, buckets: tuple[int, ...]) -> None:
        """``buckets``: the bucket sizes in merged tokens; bucket ``b``'s graph takes launches of
        more tokens than the next smaller bucket and at most ``b``."""
        self._encoder = encoder
        ordered = sorted(set(buckets))
        # Bucket b's launches: more tokens than the next smaller bucket, at most b, as the runner pads them.
        self._ranges = {b: (padded_tokens(smaller + 1, self.row_multiple, b), b)
                        for smaller, b in zip([0, *ordered], ordered)}
        self.frame_slots = ordered[-1]  # a frame holds at least one merged token
        # One compiled graph per bucket; make room for all of them so the
        # last buckets are not silently demoted to eager by the recompile limit.
        dynamo_config: Any = torch._dynamo.config
        limit_name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        if getattr(dynamo_config, limit_name) < len(ordered) + 1:
            setattr(dynamo_config, limit_name, len(ordered) + 1)
        self._compiled = torch.compile(_frames_write_by_token, fullgraph=True)

    def run(self, shape: BucketShape, exact: bool, inputs: LaunchInputs, buffer: torch.Tensor) -> torch.Tensor:
        if exact:
            with torch.no_grad():
                return _call(frames_write, self._encoder, inputs, buffer)
        lo, hi = self._ranges[shape.tokens]
        tokens = inputs.dest.shape[0]
        if not lo <= tokens <= hi:
            raise ValueError(f"launch of {tokens} merged tokens does not fit bucket {shape.tokens}'s graph "
                             f"({lo} to {hi} tokens)")
        # The row count varies within the bucket's range, nothing else: one graph per bucket.
        unit = self._encoder.config.merge_unit
        # Rows go in grouped by merged token ([tokens, merge**2, ...]), so every input's first
        # dimension is the same token count and no guard on its divisibility is needed.
        patches, index, weight, positions = (t.view(tokens, unit, *t.shape[1:]) for t in (
            inputs.patches, inputs.interp_index, inputs.interp_weight, inputs.positions))
        if lo < hi:
            for tensor in (patches, index, weight, positions, inputs.dest):
                torch._dynamo.mark_dynamic(tensor, 0, min=lo, max=hi)
        with torch.no_grad():
            out: torch.Tensor = self._compiled(self._encoder, patches, index, weight, positions, inputs.frames,
                                               inputs.dest, buffer)
            return out


class _NeuronWrite(nn.Module):
    """The tower plus the cache as a state tensor, the form ``torch_neuronx.trace`` aliases."""

    def __init__(self, encoder: VisionEncoder, shape: BucketShape, buffer: torch.Tensor) -> None:
        super().__init__()
        self.encoder = encoder
        self.blocks = shape.num_blocks
        # Shares the buffer's storage; traced with input_output_aliases so the
        # compiled graph updates it in device memory instead of returning a copy.
        self.cache = nn.Parameter(buffer, requires_grad=False)

    def forward(self, pixels: torch.Tensor, interp_index: torch.Tensor, interp_weight: torch.Tensor,
                positions: torch.Tensor, segments: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        n = self.blocks
        # A patch attends to the patches of its own frame only. Padding rows share id -1:
        # they attend to each other (never an empty softmax row) and never to real rows.
        segments = segments.view(n, -1)
        mask = (segments.unsqueeze(-1) == segments.unsqueeze(-2)).unsqueeze(1)
        rows = self.encoder.forward_blocks(pixels.view(n, -1, pixels.shape[-1]), interp_index.view(n, -1, 4),
                                           interp_weight.view(n, -1, 4), positions.view(n, -1, 2), mask)
        flat = self.cache.view(-1, self.cache.shape[-1])
        return flat.index_copy(0, dest, rows.to(flat.dtype)).view_as(self.cache)


class NeuronBackend:
    """AWS Neuron: one traced graph per (bucket shape, buffer), buffer aliased in and out.

    Needs a Neuron host with ``torch-neuronx``; the traced graph owns the cache as
    device-resident state, so the buffer must already live on the Neuron device.
    """

    name = "neuron"
    layout = Layout.BLOCKS
    static_shapes = True
    row_multiple = 1
    frame_slots: int | None = None

    def __init__(self, encoder: VisionEncoder) -> None:
        try:
            import torch_neuronx  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ConfigError(
                "encoder backend 'neuron' needs the torch-neuronx package, which is not installed: "
                "install torch-neuronx from the AWS Neuron package repository on a Trainium/Inferentia "
                "host, or choose backend 'eager' or 'compile'"
            ) from exc
        self._neuronx: Any = torch_neuronx
        self._encoder = encoder
        self._graphs: dict[tuple[BucketShape, int], Any] = {}

    def run(self, shape: BucketShape, exact: bool, inputs: LaunchInputs, buffer: torch.Tensor) -> torch.Tensor:
        key = (shape, buffer.data_ptr())
        graph = self._graphs.get(key)
        example = (inputs.patches, inputs.interp_index, inputs.interp_weight, inputs.positions,
                   inputs.segments, inputs.dest)
        if graph is None:
            module = _NeuronWrite(self._encoder, shape, buffer)
            logger.info("tracing the encoder for Neuron at bucket %s", shape)
            graph = self._neuronx.trace(module, example, input_output_aliases={module.cache: 0})
            self._graphs[key] = graph
        graph(*example)
        return buffer


def resolve_backend(name: str, device: torch.device) -> str:
    """The concrete backend for ``name`` on ``device`` (``auto`` decides here)."""
    if name not in BACKENDS:
        raise ConfigError(f"encoder backend {name!r} is not one of {BACKENDS}")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "compile"
    if device.type in ("xla", "neuron"):
        return "neuron"
    return CPU_AUTO_BACKEND


def make_backend(name: str, encoder: VisionEncoder, buckets: tuple[int, ...]) -> GraphBackend:
    resolved = resolve_backend(name, encoder.device)
    if resolved == "eager":
        return EagerBackend(encoder)
    if resolved == "compile":
        return CompileBackend(encoder, buckets)
    return NeuronBackend(encoder)
