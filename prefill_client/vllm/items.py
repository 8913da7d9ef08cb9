"""What both halves of the connector share (vLLM scheduler and worker processes): a request's
items, the checks their rows must pass, the failure ladder, and the step's orders.

The failure ladder (:func:`failure_of`) is the one place that says what an exception of a pull
(or of a lookup) means: the load-failure reason it is counted under, the message that fails the
request, and whether the client that raised it already counted it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.errors import ECLoadFailure, EpdError, LoadFailureReason

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Threads that pull (or look up and give leases back) beside vLLM's own, per process.
PULL_THREADS = 2


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the connector's halves need to know about the vLLM engine they serve, read once from its config."""

    width: int | None  # of one encoder row, as the model expects it (None: not known, not checked)
    dtype: torch.dtype  # the model's: rows go into ``encoder_cache`` in it
    channel: str  # the side channel's address (:func:`prefill_client.vllm.channel.address`)
    ranks: int  # tensor-parallel ranks: workers that each gather every item


@dataclass
class StepOrders:
    """What one step's connector metadata tells the workers, in step order.

    Worker path: the ids of the items to put into ``encoder_cache`` from the rows each rank
    holds (``place``) and of rows nobody needs any more (``drop``: identifier and the pull that
    landed them). Scheduler path: the verified rows themselves (``rows``).
    """

    place: list[str] = field(default_factory=list)
    drop: list[tuple[str, str]] = field(default_factory=list)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Wanted:
    """One item a request needs: its identifier and the number of rows the prompt has for it."""

    identifier: str
    num_embeds: int


def wanted_items(request: Request, num_computed_tokens: int) -> list[Wanted]:
    """The request's items (each once) whose placeholders are not all covered by its prefix-cache hit."""
    out: list[Wanted] = []
    seen: set[str] = set()
    for index, feature in enumerate(request.mm_features):
        pos = feature.mm_position
        if pos.offset + pos.length <= num_computed_tokens or feature.identifier in seen:
            continue
        seen.add(feature.identifier)
        out.append(Wanted(feature.identifier, int(request.get_num_encoder_embeds(index))))
    return out


def shape_problem(identifier: str, rows: torch.Tensor, num_embeds: int, width: int | None) -> str | None:
    """Why ``rows`` cannot be the item's encoder output in this model, or None."""
    if rows.dim() != 2 or rows.shape[0] != num_embeds:
        return (f"item {identifier}: the encoder has {tuple(rows.shape)} rows, the prompt expects "
                f"{num_embeds} (the request's placeholder metadata does not match the item)")
    if width is not None and rows.shape[1] != width:
        return (f"item {identifier}: rows of width {rows.shape[1]}, the model expects {width} "
                f"(its input-embedding size x (1 + deepstack levels)); encoder and model disagree")
    return None


class ShapeProblem(Exception):
    """Rows that cannot be an item's encoder output in this model, or an item not delivered."""


def check_rows(expect: Mapping[str, int], rows: Mapping[str, torch.Tensor], width: int | None) -> None:
    """Every expected item (identifier -> rows the prompt has for it) is in ``rows``, of the right
    shape; else :class:`ShapeProblem` naming the first that is not."""
    for identifier, num_embeds in expect.items():
        got = rows.get(identifier)
        problem = (f"item {identifier} was not delivered" if got is None
                   else shape_problem(identifier, got, num_embeds, width))
        if problem is not None:
            raise ShapeProblem(problem)


@dataclass(frozen=True, slots=True)
class Failure:
    """A pull that failed: the reason it counts under in ``load_failures``, the message that
    fails the request, and whether the client that raised it counted it already."""

    reason: LoadFailureReason
    why: str
    counted: bool = False


def failure_of(exc: BaseException, what: str) -> Failure:
    """The failure ``exc``, raised by ``what`` (a pull or a lookup, for the log), is.

    - ``ECLoadFailure`` (evicted, tag or generation mismatch, timeout, disconnect, handshake):
      its own reason; the client counted it when it raised it.
    - :class:`ShapeProblem` (rows the model cannot take, an item not delivered): ``token_count``.
    - any other ``EpdError`` (a config or transport problem of this request): ``handshake``.
    - anything else (a bug, never the engine's problem: the request fails, the log says what
      happened): ``handshake`` too, so that every failed request shows in ``load_failures``;
      no reason names "unexpected", and the closest is the one for "could not talk to the
      encoder properly".
    """
    if isinstance(exc, ECLoadFailure):
        return Failure(exc.reason, str(exc), counted=True)
    if isinstance(exc, ShapeProblem):
        return Failure(LoadFailureReason.TOKEN_COUNT, str(exc))
    if not isinstance(exc, EpdError):  # ConfigError is one too
        logger.error("EpdCacheConnector: %s failed unexpectedly", what, exc_info=exc)
    return Failure(LoadFailureReason.HANDSHAKE, f"{type(exc).__name__}: {exc}")


def worker_device() -> torch.device:
    """The device of this vLLM worker (its GPU on CUDA, the host elsewhere)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)
