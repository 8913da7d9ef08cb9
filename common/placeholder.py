"""An item's placeholder metadata: the processed fields that size its prompt range in the engine.

A serving engine that takes embeddings out of band still has to build the prompt: how many
placeholder tokens an item gets, and where. vLLM models declare which processed fields
decide that (``placeholder_metadata_fields``: ``image_grid_thw`` for the Qwen-VL family,
``video_grid_thw`` and ``timestamps`` for Qwen3-VL videos, none for a fixed-size tower).
The encoder computes them with the rows and answers them with the item's location; the
proxy puts them into the request in place of the media, without knowing the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import HandshakeError
from common.wire import pb2

# An answer carries at most this many values per field: a grid is 3, timestamps one per
# temporal patch. Bigger means a bug or a hostile peer, not metadata.
MAX_VALUES = 4096


@dataclass(frozen=True, slots=True)
class PlaceholderField:
    """One named tensor of metadata, row-major, of integers or floats."""

    name: str
    shape: tuple[int, ...]
    values: tuple[int, ...] | tuple[float, ...]
    floating: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a placeholder field needs a name")
        if math.prod(self.shape) != len(self.values):
            raise ValueError(f"placeholder field {self.name!r}: shape {self.shape} does not hold "
                             f"{len(self.values)} values")

    @classmethod
    def of(cls, name: str, value: Any) -> PlaceholderField:
        """From a tensor, an array, a list (nested) or a number."""
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        floating = tensor.is_floating_point()
        flat = tensor.detach().reshape(-1).cpu()
        values = tuple(float(v) for v in flat.tolist()) if floating else tuple(int(v) for v in flat.tolist())
        return cls(name, tuple(int(d) for d in tensor.shape), values, floating)

    def to_json(self) -> Any:
        """Nested lists (or a number) in the shape, as a JSON request carries a tensor."""
        if not self.shape:
            return self.values[0]
        out: Any = list(self.values)
        for dim in reversed(self.shape[1:]):
            out = [out[i:i + dim] for i in range(0, len(out), dim)]
        return out

    def to_proto(self) -> pb2.PlaceholderField:
        msg = pb2.PlaceholderField(name=self.name, shape=self.shape)
        if self.floating:
            msg.floats.values.extend(float(v) for v in self.values)
        else:
            msg.ints.values.extend(int(v) for v in self.values)
        return msg

    @classmethod
    def from_proto(cls, msg: pb2.PlaceholderField) -> PlaceholderField:
        kind = msg.WhichOneof("values")
        values: Sequence[int] | Sequence[float] = (
            msg.floats.values if kind == "floats" else msg.ints.values if kind == "ints" else ())
        if len(values) > MAX_VALUES:
            raise HandshakeError(f"placeholder field {msg.name!r} has {len(values)} values, "
                                f"more than {MAX_VALUES}")
        try:
            if kind == "floats":
                return cls(msg.name, tuple(msg.shape), tuple(float(v) for v in values), True)
            return cls(msg.name, tuple(msg.shape), tuple(int(v) for v in values))
        except ValueError as exc:
            raise HandshakeError(f"bad placeholder field from the encoder: {exc}") from None


def to_proto(fields: Iterable[PlaceholderField]) -> list[pb2.PlaceholderField]:
    return [f.to_proto() for f in fields]


def from_proto(msgs: Iterable[pb2.PlaceholderField]) -> tuple[PlaceholderField, ...]:
    return tuple(PlaceholderField.from_proto(m) for m in msgs)


def as_json(fields: Iterable[PlaceholderField]) -> dict[str, Any]:
    """``{name: value}`` as a chat request's ``image_embeds`` / ``video_embeds`` object carries them."""
    return {f.name: f.to_json() for f in fields}


@dataclass(frozen=True, slots=True)
class ItemMeta:
    """What an encoder answers about an item besides its rows: its modality and placeholder fields.

    ``grid_thw`` is the Qwen-VL towers' patch grid (the wire's ``grid_thw``, kept for the
    consumers that count tokens from it); empty for other towers.
    """

    modality: str = ""
    placeholder: tuple[PlaceholderField, ...] = ()
    grid_thw: tuple[int, ...] = ()
