"""The aliased, bucketed write path: packing invariance, scratch-only padding, one storage."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import pytest
import torch

from common.errors import ConfigError
from encoder_server.preprocess import ProcessedItem
from encoder_server.vision import EncoderRunner, default_tokens_per_block, load_encoder
from encoder_server.vision import runner as runner_module
from encoder_server.vision.backends import LaunchInputs, Layout, _NeuronWrite
from encoder_server.vision.model import VisionEncoder
from encoder_server.vision.packing import BucketShape, FrameRef, bucket_shapes, first_fit, plan_launches

BLOCK = 16
NUM_BLOCKS = 24
SCRATCH = NUM_BLOCKS - 1
ATOL = 1e-5


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    return load_encoder(seed=7)


def item(encoder: VisionEncoder, grid: tuple[int, int, int], seed: int) -> ProcessedItem:
    t, h, w = grid
    values = torch.randn(t * h * w, encoder.config.patch_dim, generator=torch.Generator().manual_seed(seed))
    return ProcessedItem(values, grid, t * h * w // 4, "video" if t > 1 else "image")


def nan_buffer(encoder: VisionEncoder, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((NUM_BLOCKS, BLOCK, encoder.fat_dim), float("nan"), dtype=dtype)


def allocate(items: Sequence[ProcessedItem], tpbs: Sequence[list[int]], first: int = 0) -> list[list[int]]:
    blocks, next_block = [], first
    for counts in tpbs:
        blocks.append(list(range(next_block, next_block + len(counts))))
        next_block += len(counts)
    return blocks


def rows_of(buffer: torch.Tensor, blocks: list[int], counts: list[int]) -> torch.Tensor:
    return torch.cat([buffer[b, :n] for b, n in zip(blocks, counts)])


def mixed_batch(encoder: VisionEncoder) -> list[ProcessedItem]:
    # two images (12 and 4 tokens) and a video of 3 temporal patches of 9 tokens
    return [item(encoder, (1, 6, 8), 1), item(encoder, (1, 4, 4), 2), item(encoder, (3, 6, 6), 3)]


def test_mixed_batch_equals_each_item_alone(encoder: VisionEncoder) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(16, 32, 64), attention_block=32, backend="eager")
    items = mixed_batch(encoder)
    # the video keeps one temporal patch per block (pad rows at the end of each block)
    tpbs = [default_tokens_per_block(items[0].num_tokens, BLOCK), [4], [9, 9, 9]]
    blocks = allocate(items, tpbs, first=2)
    buffer = nan_buffer(encoder)
    storage = buffer.untyped_storage().data_ptr()
    out = runner.write(items, blocks, tpbs, buffer, SCRATCH)
    assert out is buffer and out.untyped_storage().data_ptr() == storage
    for it, b, counts in zip(items, blocks, tpbs):
        alone = encoder.embed(it.pixel_values, [it.grid_thw])
        torch.testing.assert_close(rows_of(buffer, b, counts), alone, atol=ATOL, rtol=ATOL)
    assert runner.real_tokens == runner.computed_tokens == 12 + 4 + 27  # eager launches are never padded


class MaskedBlocksOnCpu:
    """The Neuron backend's traced module run eagerly: the blocks layout and its masks, checked on a CPU."""

    name = "neuron-on-cpu"
    layout = Layout.BLOCKS
    static_shapes = True
    row_multiple = 1
    frame_slots = None

    def __init__(self, encoder: VisionEncoder) -> None:
        self._encoder = encoder

    def run(self, shape: BucketShape, exact: bool, inputs: LaunchInputs, buffer: torch.Tensor) -> torch.Tensor:
        module = _NeuronWrite(self._encoder, shape, buffer)
        with torch.no_grad():
            buffer.copy_(module(inputs.patches, inputs.interp_index, inputs.interp_weight, inputs.positions,
                                inputs.segments, inputs.dest))
        return buffer


@pytest.fixture(params=["frames", "blocks"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "blocks":
        monkeypatch.setattr(runner_module, "make_backend", lambda name, encoder, shapes: MaskedBlocksOnCpu(encoder))
    return str(request.param)


def test_rows_do_not_depend_on_batch_or_bucket(encoder: VisionEncoder, layout: str) -> None:
    items = mixed_batch(encoder)
    tpbs = [default_tokens_per_block(i.num_tokens, BLOCK) for i in items]
    blocks = allocate(items, tpbs)
    results = []
    for buckets, attention_block, order in [((64,), 64, [0, 1, 2]), ((16, 32, 64), 16, [2, 0, 1]),
                                           ((64, 128), 32, [1, 2, 0])]:
        runner = EncoderRunner(encoder, block_size=BLOCK, buckets=buckets, attention_block=attention_block,
                               backend="eager", pad_to_bucket=True)
        buffer = nan_buffer(encoder)
        runner.write([items[i] for i in order], [blocks[i] for i in order], [tpbs[i] for i in order],
                      buffer, SCRATCH)
        results.append(buffer[: sum(len(b) for b in blocks)].clone())
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=ATOL, rtol=ATOL, equal_nan=True)
    for it, b, counts in zip(items, blocks, tpbs):
        torch.testing.assert_close(rows_of(results[0], b, counts), encoder.embed(it.pixel_values, [it.grid_thw]),
                                   atol=ATOL, rtol=ATOL)


def still(encoder: VisionEncoder, grid: tuple[int, int, int], seed: int) -> ProcessedItem:
    """An image as the preprocessing makes it: each patch's frame once (repeat 2), half the width."""
    _, h, w = grid
    values = torch.randn(h * w, encoder.config.patch_dim // 2, generator=torch.Generator().manual_seed(seed))
    return ProcessedItem(values, grid, h * w // 4, "image", repeat=2)


def test_stills_rows_of_one_frame_equal_their_hugging_face_rows(encoder: VisionEncoder, layout: str) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(64, 128), backend="eager", pad_to_bucket=True)
    items = [still(encoder, (1, 4, 6), 11), item(encoder, (2, 4, 4), 12), still(encoder, (1, 8, 8), 13)]
    tpbs = [default_tokens_per_block(i.num_tokens, BLOCK) for i in items]
    blocks = allocate(items, tpbs)
    buffer = nan_buffer(encoder)
    runner.write(items, blocks, tpbs, buffer, SCRATCH)
    for it, b, counts in zip(items, blocks, tpbs):
        full = ProcessedItem(it.hf_pixel_values(), it.grid_thw, it.num_tokens, it.kind)
        assert full.pixel_values.shape == (it.num_tokens * 4, encoder.config.patch_dim)
        torch.testing.assert_close(rows_of(buffer, b, counts), encoder.embed(full.pixel_values, [it.grid_thw]),
                                   atol=ATOL, rtol=ATOL)
    a = items[0]
    cases = [
        (ProcessedItem(a.pixel_values, a.grid_thw, a.num_tokens, "image", repeat=3), "repeat 3"),
        (ProcessedItem(a.pixel_values, (2, 2, 6), a.num_tokens // 2, "video", repeat=2), "repeat 2 with grid"),
        (ProcessedItem(a.hf_pixel_values(), a.grid_thw, a.num_tokens, "image", repeat=2), "patch_dim 768"),
    ]
    for bad, message in cases:
        buffer = nan_buffer(encoder)
        with pytest.raises(ValueError, match=message):
            runner.write([bad], [[0]], [[bad.num_tokens]], buffer, SCRATCH)
        assert torch.isnan(buffer).all(), message


def test_padding_lands_only_in_the_scratch_block(encoder: VisionEncoder, layout: str) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(64, 128), backend="eager", pad_to_bucket=True)
    items = mixed_batch(encoder)
    tpbs = [[12], [4], [5, 11, 11]]  # irregular splits: block rows past the count stay untouched
    blocks = [[3], [9], [5, 6, 12]]
    buffer = nan_buffer(encoder)
    runner.write(items, blocks, tpbs, buffer, SCRATCH)
    written = torch.zeros(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    for b, counts in zip(blocks, tpbs):
        for block, count in zip(b, counts):
            written[block, :count] = True
    finite = torch.isfinite(buffer).all(dim=-1)
    scratch_rows = finite[SCRATCH].clone()
    finite[SCRATCH] = False
    assert torch.equal(finite, written), "a row outside the allocated (block, row) set was written"
    assert torch.isnan(buffer[~written & (torch.arange(NUM_BLOCKS) != SCRATCH)[:, None]]).all()
    assert scratch_rows.any(), "the bucket padding went somewhere other than the scratch block"
    video = items[2]
    torch.testing.assert_close(rows_of(buffer, blocks[2], tpbs[2]), encoder.embed(video.pixel_values, [video.grid_thw]),
                               atol=ATOL, rtol=ATOL)


def test_bf16_buffer_keeps_its_storage(encoder: VisionEncoder) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(32,), attention_block=32, backend="eager")
    buffer = torch.zeros(NUM_BLOCKS, BLOCK, encoder.fat_dim, dtype=torch.bfloat16)
    view_before, ptr = buffer[0], buffer.data_ptr()
    single = [item(encoder, (1, 4, 4), 9)]
    for _ in range(3):
        assert runner.write(single, [[0]], [[4]], buffer, SCRATCH) is buffer
    assert buffer.data_ptr() == ptr and view_before.data_ptr() == ptr
    expected = encoder.embed(single[0].pixel_values, [(1, 4, 4)]).to(torch.bfloat16)
    assert torch.equal(view_before[:4], expected)  # a view taken before the write sees the rows


def test_oversize_frame_and_item_use_exact_and_split_launches(encoder: VisionEncoder) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(8, 16), attention_block=16, backend="eager")
    big_image = item(encoder, (1, 8, 10), 4)  # 20 tokens > any block: exact-size launch
    long_video = item(encoder, (5, 4, 6), 5)  # 30 tokens > max_batch_tokens: spread over launches
    for it in (big_image, long_video):
        tpb = default_tokens_per_block(it.num_tokens, BLOCK)
        buffer = nan_buffer(encoder)
        runner.write([it], [list(range(len(tpb)))], [tpb], buffer, SCRATCH)
        torch.testing.assert_close(rows_of(buffer, list(range(len(tpb))), tpb),
                                   encoder.embed(it.pixel_values, [it.grid_thw]), atol=ATOL, rtol=ATOL)
        assert torch.isnan(buffer[len(tpb):SCRATCH]).all()


def test_inconsistent_requests_raise_and_write_nothing(encoder: VisionEncoder) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(16, 32), attention_block=16, backend="eager")
    a, b = item(encoder, (1, 4, 4), 1), item(encoder, (1, 8, 8), 2)  # 4 and 16 tokens
    b2 = item(encoder, (1, 8, 8), 3)
    cases = [
        (([a, b, b2], [[0], [1], [2]], [[4], [16], [16]], SCRATCH), "36 tokens, more than the largest bucket"),
        (([a, b], [[0], [0]], [[4], [16]], SCRATCH), "given to item 0 and item 1"),
        (([a], [[NUM_BLOCKS]], [[4]], SCRATCH), "outside"),
        (([a], [[0]], [[3]], SCRATCH), "sum to 3"),
        (([a], [[0, 1]], [[4]], SCRATCH), "block ids but"),
        (([b], [[0, 1]], [[0, 16]], SCRATCH), "would hold 0 rows"),
        (([a], [[0]], [[4]], NUM_BLOCKS), "scratch_block_id"),
        (([ProcessedItem(a.pixel_values[:8], (1, 4, 4), 4, "image")], [[0]], [[4]], SCRATCH), "pixel_values shape"),
        (([ProcessedItem(a.pixel_values, (1, 4, 4), 5, "image")], [[0]], [[4]], SCRATCH), "num_tokens 5"),
    ]
    for (items, blocks, tpbs, scratch), message in cases:
        buffer = nan_buffer(encoder)
        with pytest.raises(ValueError, match=message):
            runner.write(items, blocks, tpbs, buffer, scratch)
        assert torch.isnan(buffer).all(), message
    with pytest.raises(ValueError, match="is not \\[num_blocks, 16, 192\\]"):
        runner.write([a], [[0]], [[4]], torch.zeros(4, 8, encoder.fat_dim), 3)
    with pytest.raises(ValueError, match="contiguous"):
        runner.write([a], [[0]], [[4]], nan_buffer(encoder).transpose(0, 1).contiguous().transpose(0, 1), 3)


def test_scratch_block_may_take_a_warm_up_item(encoder: VisionEncoder) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(16,), attention_block=16, backend="eager")
    buffer = nan_buffer(encoder)
    warm = item(encoder, (1, 4, 4), 1)
    runner.write([warm, warm], [[SCRATCH], [SCRATCH]], [[4], [4]], buffer, SCRATCH)
    assert torch.isnan(buffer[:SCRATCH]).all() and torch.isfinite(buffer[SCRATCH, :4]).all()
    runner.warmup(buffer, SCRATCH)  # every bucket, rows into the scratch block only
    assert torch.isnan(buffer[:SCRATCH]).all()


def test_plan_batches_respects_max_batch_tokens(encoder: VisionEncoder) -> None:
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(16, 32), attention_block=16, backend="eager")
    assert runner.max_batch_tokens == 32 and runner.buckets == (16, 32)
    sizes = [(1, 4, 4), (1, 8, 8), (1, 6, 8), (4, 8, 8), (1, 4, 4)]  # 4, 16, 12, 64, 4 tokens
    items = [item(encoder, g, i) for i, g in enumerate(sizes)]
    assert runner.plan_batches(items) == [[0, 1, 2], [3], [4]]
    assert runner.plan_batches([]) == []


def test_packing_picks_smallest_fitting_bucket() -> None:
    shapes = bucket_shapes((8, 32, 64, 128), attention_block=32)
    assert shapes == (BucketShape(1, 8), BucketShape(1, 32), BucketShape(2, 32), BucketShape(4, 32))
    frames = [FrameRef(0, 0, 20), FrameRef(1, 0, 20), FrameRef(2, 0, 6)]
    (launch,) = plan_launches(frames, shapes)
    assert launch.shape == BucketShape(2, 32) and not launch.exact and launch.real_tokens == 46
    (small,) = plan_launches([FrameRef(0, 0, 5)], shapes)
    assert small.shape == BucketShape(1, 8)
    # fragmentation: five 20-token frames do not fit 4 blocks of 32 -> a second launch
    many = plan_launches([FrameRef(i, 0, 20) for i in range(5)], shapes)
    assert [launch.shape for launch in many] == [BucketShape(4, 32), BucketShape(1, 32)]
    oversize = plan_launches([FrameRef(0, f, 40) for f in range(4)], shapes)
    assert all(launch.exact for launch in oversize) and sum(len(l.blocks) for l in oversize) == 4
    assert first_fit([FrameRef(0, 0, 9)], 1, 8) is None
    with pytest.raises(ConfigError, match="not a multiple"):
        bucket_shapes((48,), attention_block=32)


def test_backend_selection(encoder: VisionEncoder) -> None:
    with pytest.raises(ConfigError, match="not one of"):
        EncoderRunner(encoder, block_size=BLOCK, backend="tpu")
    if importlib.util.find_spec("torch_neuronx") is None:
        with pytest.raises(ConfigError, match="torch-neuronx"):
            EncoderRunner(encoder, block_size=BLOCK, backend="neuron")
    runner = EncoderRunner(encoder, block_size=BLOCK, backend="eager")
    assert runner.backend == "eager" and runner.max_batch_tokens == 2048


@pytest.mark.slow
def test_compiled_graph_writes_in_place_and_never_recompiles(encoder: VisionEncoder) -> None:
    from torch._dynamo.utils import counters

    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(16,), backend="compile")
    buffer = nan_buffer(encoder)
    runner.warmup(buffer, SCRATCH)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1
    ptr = buffer.data_ptr()
    # two batches of different frames in the same bucket: the same graph serves both
    for grids, first in ((((1, 4, 4), (1, 6, 4)), 0), (((1, 2, 2), (1, 2, 2), (2, 4, 2)), 2)):
        items = [item(encoder, grid, seed) for seed, grid in enumerate(grids)]
        tpbs = [[it.num_tokens] for it in items]
        blocks = [[first + i] for i in range(len(items))]
        assert runner.write(items, blocks, tpbs, buffer, SCRATCH) is buffer
        for it, b, counts in zip(items, blocks, tpbs):
            torch.testing.assert_close(rows_of(buffer, b, counts), encoder.embed(it.pixel_values, [it.grid_thw]),
                                       atol=ATOL, rtol=ATOL)
    assert buffer.data_ptr() == ptr
    assert counters["stats"]["unique_graphs"] == compiled, "a new mix of frames recompiled the bucket's graph"
    # 10 and 6 tokens: padded to multiples of 8 (16 and 8), not both to the bucket (32)
    assert (runner.real_tokens, runner.computed_tokens) == (16, 24)
    assert torch.isnan(buffer[5:SCRATCH]).all()


def test_preprocessed_images_and_video_end_to_end(encoder: VisionEncoder) -> None:
    import io

    import numpy as np
    from PIL import Image

    from encoder_server.preprocess import PreprocessConfig, Preprocessor

    def png(width: int, height: int, seed: int) -> bytes:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        return out.getvalue()

    pre = Preprocessor(PreprocessConfig.for_encoder(encoder.config, min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 12))
    items = [pre.image(png(70, 50, 1)), pre.image(png(40, 130, 2)), pre.video([png(64, 40, s) for s in range(3)])]
    runner = EncoderRunner(encoder, block_size=BLOCK, buckets=(32, 64), attention_block=32, backend="eager")
    tpbs = [default_tokens_per_block(i.num_tokens, BLOCK) for i in items]
    blocks = allocate(items, tpbs)
    buffer = nan_buffer(encoder)
    assert runner.plan_batches(items) == [[0, 1, 2]]
    runner.write(items, blocks, tpbs, buffer, SCRATCH)
    for it, b, counts in zip(items, blocks, tpbs):
        torch.testing.assert_close(rows_of(buffer, b, counts), encoder.embed(it.pixel_values, [it.grid_thw]),
                                   atol=ATOL, rtol=ATOL)


def test_per_item_records_are_slotted(encoder: VisionEncoder) -> None:
    record = item(encoder, (1, 4, 4), 0)
    assert not hasattr(record, "__dict__")
    assert not hasattr(FrameRef(0, 0, 1), "__dict__") and not hasattr(BucketShape(1, 1), "__dict__")
