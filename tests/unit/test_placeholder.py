"""Placeholder metadata: the fields an encoder answers per item, on the wire and in the proxy's rewrite."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from common.errors import HandshakeError
from common.placeholder import MAX_VALUES, PlaceholderField, as_json, from_proto, to_proto
from common.wire import pb2
from prefill_client.handoff import Placement
from prefill_client.consumer.connection import MediaSpec
from prefill_client.proxy.rewrite import Part


def test_fields_keep_name_shape_type_and_values_through_the_wire_and_json() -> None:
    fields = (PlaceholderField.of("image_grid_thw", torch.tensor([1, 14, 20])),
              PlaceholderField.of("image_sizes", [[336, 512]]),
              PlaceholderField.of("timestamps", torch.tensor([0.25, 1.75])),
              PlaceholderField.of("audio_num_tokens", 7))
    wire = pb2.ItemLocation(placeholder=to_proto(fields)).SerializeToString()
    back = from_proto(pb2.ItemLocation.FromString(wire).placeholder)
    assert back == fields
    assert as_json(back) == {"image_grid_thw": [1, 14, 20], "image_sizes": [[336, 512]],
                             "timestamps": [0.25, 1.75], "audio_num_tokens": 7}
    assert isinstance(as_json(back)["image_grid_thw"][0], int)


def test_a_field_whose_shape_does_not_hold_its_values_is_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        PlaceholderField("image_grid_thw", (2, 3), (1, 2, 3))
    msg = pb2.PlaceholderField(name="image_grid_thw", shape=[4], ints=pb2.IntValues(values=[1, 2, 3]))
    with pytest.raises(HandshakeError, match="bad placeholder field"):
        from_proto([msg])
    huge = pb2.PlaceholderField(name="x", shape=[MAX_VALUES + 1],
                                ints=pb2.IntValues(values=range(MAX_VALUES + 1)))
    with pytest.raises(HandshakeError, match="more than"):
        from_proto([huge])


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


def _placed(**location: object) -> Placement:
    return Placement("h1", "127.0.0.1:1", "inc", pb2.ItemLocation(mm_hash="h1", num_tokens=4, **location))


def test_the_proxy_sends_whatever_fields_the_encoder_answered_and_the_media_when_there_are_none() -> None:
    content = [{"type": "image_url", "image_url": {"url": "file:///somewhere/cat.png"}}]
    part = Part(content, 0, "messages[0].content[0]", MediaSpec.image(_png()))
    grid = _placed(placeholder=to_proto([PlaceholderField.of("image_grid_thw", [1, 4, 6])]), modality="image")
    assert part.rewritten(grid) == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]},
                                    "uuid": "h1"}
    sizes = _placed(placeholder=to_proto([PlaceholderField.of("image_sizes", [[8, 8]])]), modality="image")
    assert part.rewritten(sizes)["image_embeds"] == {"image_sizes": [[8, 8]]}
    # No fields (a model that counts placeholders from the media): the bytes the encoder encoded,
    # inline, never the URL the proxy was allowed to read.
    media = part.rewritten(_placed(modality="image"))
    assert media["type"] == "image_url" and media["uuid"] == "h1"
    url = media["image_url"]["url"]
    assert url.startswith("data:image/png;base64,") and base64.b64decode(url.split(",", 1)[1]) == _png()
    # An encoder of before the fields answers Qwen's grid alone.
    assert part.rewritten(_placed(grid_thw=[1, 2, 2]))["image_embeds"] == {"image_grid_thw": [1, 2, 2]}


def test_a_video_goes_as_metadata_from_our_tower_and_as_the_request_gave_it_from_vllms() -> None:
    video = {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AAAA,BBBB,CCCC,DDDD"}}
    part = Part([video], 0, "messages[0].content[0]", MediaSpec.video([b"f"] * 4, 0.0), fps=2.0)
    placed = _placed(placeholder=to_proto([PlaceholderField.of("video_grid_thw", [2, 4, 4])]), modality="video")
    ours = part.rewritten(placed, ours=True)
    assert ours["type"] == "video_embeds" and ours["uuid"] == "h1"
    assert ours["video_embeds"] == {"video_grid_thw": [2, 4, 4], "timestamps": [0.25, 1.25]}
    assert part.rewritten(placed) == {**video, "uuid": "h1"}
