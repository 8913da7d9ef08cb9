"""Rewriting a request for the backend: each media part by its placement, and ``ec_transfer_params`` (proxy process).

A part the encoder answered placeholder metadata for becomes vLLM's embeddings form without a
tensor; a part without (a model that sizes its placeholders from the media itself) goes as the
media the encoder encoded, as a data URL. Either is named by ``uuid = mm_hash``, and the
placements go in the request's ``ec_transfer_params`` (:mod:`prefill_client.handoff`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import pybase64
from PIL import Image

from common.placeholder import as_json
from prefill_client.consumer.client import EncoderCacheClient
from prefill_client.consumer.connection import MediaSpec
from prefill_client.handoff import Placement, with_placements


class Part:
    """A media part of a request, where it sits (``message``: the index of its message), and its
    bytes (a video: its frames and their rate)."""

    def __init__(self, content: list[Any], index: int, label: str, spec: MediaSpec, fps: float = 0.0,
                 message: int = 0) -> None:
        self.content, self.index, self.label, self.spec, self.fps = content, index, label, spec, fps
        self.message = message

    def rewritten(self, placed: Placement, *, ours: bool = False) -> dict[str, Any]:
        """The part as the backend gets it, named by ``uuid = mm_hash`` (the connector's identifier).

        With placeholder metadata from the encoder: vLLM's embeddings form without the tensor
        (``{"type": "image_embeds", "image_embeds": {FIELD: VALUE, ...}}``), whatever the
        fields. Without (a model that sizes its placeholders from the media itself), and for a
        video the vLLM tower encoded: the media the encoder encoded (an image as a data URL, a
        video as the request gave it), for vLLM's processor to lay out the prompt. ``ours``:
        the encoder preprocessed the item with parameters it announced (epd-cache's own
        Qwen3-VL tower), not with the model's own processor.
        """
        kind = self.spec.kind
        # An encoder of before placeholder fields answers the Qwen grid alone.
        fields = as_json(placed.placeholder) or (
            {f"{kind}_grid_thw": list(placed.grid_thw)} if placed.grid_thw else {})
        # A video from vLLM's tower goes as it came: a model's placeholder metadata sizes the range
        # but may leave out the timing its positions take (Qwen2.5-VL's second_per_grid_ts).
        if not fields or (kind == "video" and not ours):
            if kind == "image":
                return {"type": "image_url", "image_url": {"url": _data_url(self.spec.frames[0])},
                        "uuid": placed.mm_hash}
            return {**self.content[self.index], "uuid": placed.mm_hash}
        if ours and kind == "video" and "timestamps" not in fields:
            # epd-cache's Qwen3-VL tower (``ours``) encodes the frames without the request's frame
            # rate: the "<t seconds>" Qwen3-VL writes for each temporal patch come from it here.
            fields["timestamps"] = video_timestamps(len(self.spec.frames), self.fps, fields["video_grid_thw"][0])
        return {"type": f"{kind}_embeds", f"{kind}_embeds": fields, "uuid": placed.mm_hash}


def rewrite(body: dict[str, Any], parts: Sequence[Part], placements: Sequence[Placement],
            client: EncoderCacheClient) -> None:
    """Rewrite ``body`` in place for the backend: each part by its placement (``client`` placed
    them), and the placements in its ``ec_transfer_params``, next to whatever it had there."""
    for part, placed in zip(parts, placements):
        conn = client.connection(placed.encoder)
        ours = conn is not None and conn.processor_is_ours
        part.content[part.index] = part.rewritten(placed, ours=ours)
    body["ec_transfer_params"] = with_placements(body.get("ec_transfer_params"), placements)


def this_turns(messages: Sequence[Any], parts: Sequence[Part], placements: Sequence[Placement]) -> list[Placement]:
    """The placements of the parts after the conversation's last assistant message: what this turn
    adds, and what gets a prefetch hint. An earlier turn's media sit in the prompt's part that the
    backend's prefix cache most likely holds (``--routing affinity`` keeps a conversation on one
    backend), so vLLM would not ask for them: a prefetch of them would be a pull nobody uses."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
               default=-1)
    return [placed for part, placed in zip(parts, placements) if part.message > last]


def _data_url(data: bytes) -> str:
    """``data:image/FORMAT;base64,...`` of encoded image bytes (the format from their header)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = (image.format or "png").lower()
    except (OSError, ValueError):
        fmt = "png"  # the encoder decoded it; the backend's decoder reads the bytes, not the name
    return f"data:image/{fmt};base64,{pybase64.b64encode(data).decode()}"


def video_timestamps(num_frames: int, fps: float, grid_t: int) -> list[float]:
    """Seconds of each temporal patch of a video of ``num_frames`` frames at ``fps``, all kept (the
    "<t seconds>" Qwen3-VL writes before each): the mean time of its frames, the last frame
    repeated to fill the last patch, as vLLM computes them for a frame sequence."""
    per_patch = -(-num_frames // grid_t)
    indices = list(range(num_frames)) + [num_frames - 1] * (grid_t * per_patch - num_frames)
    return [(indices[i] + indices[i + per_patch - 1]) / 2 / fps for i in range(0, len(indices), per_patch)]

