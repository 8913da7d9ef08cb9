"""What every tower gives the encoder server, and the helpers the towers share (encoder process)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import EncoderServerConfig, TowerChoice, TowerDtype, read_json_object
from common.media import PreprocessParams


@dataclass(frozen=True, slots=True)
class LoadedTower:
    """What computes the rows, as the server wires it: its preprocessor, runner maker and identity."""

    name: TowerChoice  # its value goes on the wire (HandshakeResponse.tower)
    out_hidden_size: int
    deepstack_levels: int
    preprocessor: Any  # the engine's Preprocessor
    make_runner: Callable[[int], Any]  # block size -> the engine's runner (may build graphs: slow)
    params: PreprocessParams
    fingerprint: str
    weights_digest: str


@dataclass(frozen=True, slots=True)
class TowerSpec:
    """One kind of tower in the registry: its name, the checkpoints it takes, how it loads."""

    name: TowerChoice
    # Whether ``--tower auto`` gives it this checkpoint (None: no --weights, the random tiny tower).
    accepts: Callable[[str | None], bool]
    load: Callable[[EncoderServerConfig], LoadedTower]


def checkpoint_model_type(weights: str | Path) -> tuple[str | None, str]:
    """``(model_type, architectures)`` of a checkpoint's ``config.json``."""
    raw = read_json_object(Path(weights) / "config.json")
    archs = raw.get("architectures")
    named = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "?"
    model_type = raw.get("model_type")
    return (str(model_type) if model_type is not None else None), named


def tower_dtype(cfg: EncoderServerConfig, auto: str) -> str:
    """The name of the dtype ``--tower-dtype`` sets, ``auto`` standing for the tower's own default."""
    return auto if cfg.tower_dtype is TowerDtype.AUTO else cfg.tower_dtype.value


def computed_fingerprint(preprocess_fingerprint: str, dtype: str) -> str:
    """The fingerprint in ``mm_hash``: the preprocessing's, and the tower's dtype unless float32.

    Rows of a tower computed in bfloat16 differ from float32's beyond the cache's rounding, so
    they must not answer for the same hash; float32 keeps the preprocessing's own fingerprint
    (the hashes of every earlier release).
    """
    if dtype == "float32":
        return preprocess_fingerprint
    return hashlib.sha256(f"{preprocess_fingerprint}|tower dtype {dtype}".encode()).hexdigest()[:32]
