"""The tower registry: which tower computes an encoder's rows, by name or by checkpoint (encoder process).

A tower (:class:`~encoder_server.towers.base.TowerSpec`) knows its name, the checkpoints
``--tower auto`` gives it, and how it loads into what the server wires up (its
preprocessor, runner, preprocessing parameters and fingerprint). ``auto`` takes the
first registered tower that accepts the checkpoint: epd-cache's own Qwen3-VL tower
(:mod:`.qwen3vl`) before the vLLM tower (:mod:`.vllm`), which takes any other.
"""

from __future__ import annotations

from common.config import EncoderServerConfig, TowerChoice
from common.errors import ConfigError
from encoder_server.towers import qwen3vl, vllm
from encoder_server.towers.base import LoadedTower, TowerSpec

_TOWERS: dict[TowerChoice, TowerSpec] = {}  # in the order ``auto`` tries them


def register(spec: TowerSpec) -> None:
    if spec.name is TowerChoice.AUTO or spec.name in _TOWERS:
        raise ValueError(f"tower name {spec.name.value!r} is reserved or taken")
    _TOWERS[spec.name] = spec


register(qwen3vl.SPEC)
register(vllm.SPEC)


def resolve(choice: TowerChoice, weights: str | None) -> TowerSpec:
    """The tower ``choice`` names; for ``auto`` the first that accepts the checkpoint ``weights``."""
    if choice is not TowerChoice.AUTO:
        return _TOWERS[choice]
    for spec in _TOWERS.values():
        if spec.accepts(weights):
            return spec
    raise ConfigError(f"no tower takes the checkpoint {weights}")


def load(cfg: EncoderServerConfig) -> LoadedTower:
    """Load the tower ``cfg.tower`` names (``auto``: by the checkpoint's architecture)."""
    return resolve(cfg.tower, cfg.weights).load(cfg)


__all__ = ["LoadedTower", "TowerSpec", "load", "register", "resolve"]
