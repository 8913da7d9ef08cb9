from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from common.config import CacheMode
from common.errors import ECLoadFailure, EncoderCacheReadError, LoadFailureReason
from prefill_client.reference.merge import (
    merge_deepstack_embeddings,
    merge_multimodal_embeddings,
    merge_multimodal_embeddings_padded,
    new_padded_hidden,
    split_deepstack,
)
from prefill_client.reference.positions import (
    ItemPlacement,
    PositionMap,
    build_encoder_positions,
    check_filled,
    check_num_tokens,
    global_to_local_positions,
    placeholder_rows,
    remap_to_range,
    shard_range,
)

# Inductor imports torch.utils.mkldnn, which uses the deprecated torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)


def naive_merge(hidden, blocks, positions, block_ids=None):
    """Per-token reference: one row at a time, sentinels skipped."""
    out = hidden.clone()
    if block_ids is not None:
        blocks = torch.stack([blocks[int(b)] for b in block_ids])
    num_tokens = hidden.shape[0]
    for k in range(positions.shape[0]):
        for r in range(positions.shape[1]):
            p = int(positions[k, r])
            if p != num_tokens:
                out[p] = blocks[k, r].to(hidden.dtype)
    return out


def random_map(gen, num_tokens, max_blocks, block_size, fill=0.6):
    """Distinct real positions at random slots, the rest sentinel."""
    slots = max_blocks * block_size
    real = min(int(slots * fill), num_tokens)
    positions = torch.full((slots,), num_tokens, dtype=torch.int64)
    where = torch.randperm(slots, generator=gen)[:real]
    positions[where] = torch.randperm(num_tokens, generator=gen)[:real]
    return positions.view(max_blocks, block_size)


@pytest.mark.parametrize("hidden_dtype, block_dtype", [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
])
@pytest.mark.parametrize("use_block_ids", [False, True])
def test_merge_equals_naive_reference(hidden_dtype, block_dtype, use_block_ids):
    gen = torch.Generator().manual_seed(1)
    num_tokens, max_blocks, block_size, dim, buffer_blocks = 37, 4, 8, 16, 9
    for _ in range(5):
        hidden = torch.randn(num_tokens, dim, generator=gen).to(hidden_dtype)
        buffer = torch.randn(buffer_blocks, block_size, dim, generator=gen).to(block_dtype)
        positions = random_map(gen, num_tokens, max_blocks, block_size)
        block_ids = torch.randint(0, buffer_blocks, (max_blocks,), generator=gen)
        before = hidden.clone()
        if use_block_ids:
            got = merge_multimodal_embeddings(hidden, buffer, positions, block_ids)
            want = naive_merge(hidden, buffer, positions, block_ids)
        else:
            got = merge_multimodal_embeddings(hidden, buffer[:max_blocks], positions)
            want = naive_merge(hidden, buffer[:max_blocks], positions)
        assert got.dtype == hidden_dtype and got.shape == hidden.shape
        assert torch.equal(got, want)
        assert torch.equal(hidden, before)  # the functional form leaves its input alone


def test_sentinels_never_touch_real_rows():
    num_tokens, block_size, dim = 10, 4, 3
    hidden = torch.arange(num_tokens * dim, dtype=torch.float32).view(num_tokens, dim)
    blocks = torch.full((3, block_size, dim), 1e9)  # poison: sentinel rows carry this
    positions = torch.full((3, block_size), num_tokens, dtype=torch.int64)
    positions[1, 2] = 7
    blocks[1, 2] = -5.0
    padded = torch.cat([hidden, torch.zeros(1, dim)])
    merged = merge_multimodal_embeddings_padded(padded, blocks, positions)
    expected = hidden.clone()
    expected[7] = -5.0
    assert torch.equal(merged, expected)
    assert merged.data_ptr() == padded.data_ptr()  # in place: a view of the buffer
    assert torch.equal(padded[-1], torch.full((dim,), 1e9))  # the dummy row took the sentinels
    # An all-sentinel map is a no-op on real rows.
    all_sentinel = torch.full((3, block_size), num_tokens, dtype=torch.int64)
    assert torch.equal(merge_multimodal_embeddings(hidden, blocks, all_sentinel), hidden)


def test_merge_rejects_bad_shapes():
    hidden = torch.zeros(5, 4)
    blocks = torch.zeros(2, 3, 4)
    ok = torch.full((2, 3), 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        merge_multimodal_embeddings(hidden, blocks, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        merge_multimodal_embeddings(hidden, blocks, ok.to(torch.int32))
    with pytest.raises(ValueError, match="width 6 differs from hidden width 4"):
        merge_multimodal_embeddings(hidden, torch.zeros(2, 3, 6), ok)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        merge_multimodal_embeddings(hidden, torch.zeros(2, 3), ok)
    with pytest.raises(ValueError, match="block_ids"):
        merge_multimodal_embeddings(hidden, blocks, ok, torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("padded_variant", [False, True])
def test_compiles_fullgraph_without_recompiling(padded_variant):
    gen = torch.Generator().manual_seed(2)
    num_tokens, max_blocks, block_size, dim, buffer_blocks = 50, 3, 16, 8, 6
    counter = CompileCounter()
    fn = merge_multimodal_embeddings_padded if padded_variant else merge_multimodal_embeddings
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    # bf16 cache rows into f32 hidden states: the cast is part of the graph.
    buffer = torch.randn(buffer_blocks, block_size, dim, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(num_tokens, dim, generator=gen)
    seen = set()
    for _ in range(50):
        fill = float(torch.rand(1, generator=gen))
        positions = random_map(gen, num_tokens, max_blocks, block_size, fill=fill)
        block_ids = torch.randint(0, buffer_blocks, (max_blocks,), generator=gen)
        seen.add(tuple(positions.flatten().tolist()))
        first = torch.cat([hidden, torch.zeros(1, dim)]) if padded_variant else hidden
        got = compiled(first, buffer, positions, block_ids)
        assert torch.equal(got, naive_merge(hidden, buffer, positions, block_ids))
    assert len(seen) == 50
    assert counter.frame_count == 1


@pytest.mark.parametrize("padded_variant", [False, True])
def test_inductor_compiled_merge_matches_reference(padded_variant):
    gen = torch.Generator().manual_seed(3)
    num_tokens, max_blocks, block_size, dim = 24, 2, 8, 32
    counter = CompileCounterWithBackend("inductor")
    fn = merge_multimodal_embeddings_padded if padded_variant else merge_multimodal_embeddings
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    buffer = torch.randn(5, block_size, dim, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(num_tokens, dim, generator=gen)
    padded = torch.cat([hidden, torch.zeros(1, dim)])
    for _ in range(4):
        positions = random_map(gen, num_tokens, max_blocks, block_size)
        block_ids = torch.randint(0, 5, (max_blocks,), generator=gen)
        want = naive_merge(hidden, buffer, positions, block_ids)
        if padded_variant:
            # The persistent buffer keeps earlier steps' rows: reset the text rows first.
            padded[:num_tokens] = hidden
            got = compiled(padded, buffer, positions, block_ids)
            assert torch.equal(padded[:num_tokens], want)  # written in place, not to a copy
        else:
            got = compiled(hidden, buffer, positions, block_ids)
        assert torch.equal(got, want)
    assert counter.frame_count == 1


# --- position maps -----------------------------------------------------------------


def test_build_positions_by_hand():
    items = [
        ItemPlacement("img", (5,), (3,), 3, offset=1),
        ItemPlacement("vid", (2, 7), (4, 2), 6, offset=6),  # block 2 full, block 7 two rows + pad
    ]
    pmap = build_encoder_positions(items, num_tokens=14, max_blocks=4, block_size=4)
    s = 14
    assert pmap.block_ids.tolist() == [5, 2, 7, 0]
    assert pmap.encoder_positions.tolist() == [
        [1, 2, 3, s],
        [6, 7, 8, 9],
        [10, 11, s, s],
        [s, s, s, s],
    ]
    assert pmap.owners == ("img", "vid", "vid")
    assert pmap.sentinel == 14
    assert not hasattr(items[0], "__dict__") and not hasattr(pmap, "__dict__")


def test_build_positions_window_clips_and_shifts():
    item = ItemPlacement.dense("vid", block_ids=(3, 4, 9), num_tokens=10, offset=2, block_size=4)
    assert item.tokens_per_block == (4, 4, 2)
    # Step schedules sequence positions [7, 12): tokens 5..9 of the item, rows 0..4 of hidden.
    pmap = build_encoder_positions([item], num_tokens=6, max_blocks=2, block_size=4, window=(7, 12))
    s = 6
    assert pmap.block_ids.tolist() == [4, 9]  # block 3 has nothing in the window: not gathered
    assert pmap.encoder_positions.tolist() == [[s, 0, 1, 2], [3, 4, s, s]]
    rows = placeholder_rows(2, 10, window=(7, 12))
    assert rows == range(0, 5)
    check_filled(pmap.encoder_positions, {"vid": rows}, num_tokens=6, mode=CacheMode.EPD,
                 owners=pmap.owners)
    assert placeholder_rows(20, 5, window=(7, 12)) == range(0)


def test_build_positions_end_to_end_with_merge():
    gen = torch.Generator().manual_seed(4)
    block_size, dim, num_tokens = 8, 6, 64
    buffer = torch.randn(12, block_size, dim, generator=gen)
    items = [
        ItemPlacement.dense("a", (3,), 5, offset=2, block_size=block_size),
        ItemPlacement("b", (7, 1, 10), (8, 6, 3), 17, offset=20),
        ItemPlacement.dense("c", (4, 5), 16, offset=40, block_size=block_size),
    ]
    pmap = build_encoder_positions(items, num_tokens=num_tokens, max_blocks=8, block_size=block_size)
    hidden = torch.randn(num_tokens, dim, generator=gen)
    got = merge_multimodal_embeddings(hidden, buffer, pmap.encoder_positions, pmap.block_ids)
    want = hidden.clone()
    for item in items:  # token t of the item is row t-cum of its block
        t = 0
        for block, rows in zip(item.block_ids, item.tokens_per_block):
            for r in range(rows):
                want[item.offset + t] = buffer[block, r]
                t += 1
    assert torch.equal(got, want)
    expected = {it.mm_hash: placeholder_rows(it.offset, it.num_tokens, window=(0, num_tokens)) for it in items}
    check_filled(pmap.encoder_positions, expected, num_tokens=num_tokens, mode=CacheMode.MONOLITHIC)


def test_build_positions_errors():
    item = ItemPlacement.dense("big", (0, 1, 2), 20, offset=0, block_size=8)
    with pytest.raises(ValueError, match="need 3 blocks but max_blocks is 2"):
        build_encoder_positions([item], num_tokens=32, max_blocks=2, block_size=8)
    with pytest.raises(ValueError, match="more than block_size 4"):
        build_encoder_positions([item], num_tokens=32, max_blocks=8, block_size=4)
    clash = ItemPlacement.dense("clash", (5,), 3, offset=19, block_size=8)
    with pytest.raises(ValueError, match="big .* and clash .* overlap"):
        build_encoder_positions([clash, item], num_tokens=32, max_blocks=8, block_size=8)
    with pytest.raises(ValueError, match=r"window \(0, 40\)"):
        build_encoder_positions([item], num_tokens=32, max_blocks=8, block_size=8, window=(0, 40))
    as_lists = ItemPlacement("x", [1, 2], [4, 3], 7, 0)
    assert as_lists.block_ids == (1, 2) and as_lists.tokens_per_block == (4, 3)
    with pytest.raises(ValueError, match="sums to 7, not num_tokens 8"):
        ItemPlacement("x", (1, 2), (4, 3), 8, 0)
    with pytest.raises(ValueError, match="2 block_ids but 1"):
        ItemPlacement("x", (1, 2), (4,), 4, 0)
    with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
        ItemPlacement("x", (1,), (4,), 4, -1)


# --- sequence parallel ---------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [40, 37])  # even and uneven splits
def test_sp_shards_merge_like_the_global_merge(world_size, num_tokens):
    gen = torch.Generator().manual_seed(5)
    max_blocks, block_size, dim = 3, 8, 5
    hidden = torch.randn(num_tokens, dim, generator=gen)
    buffer = torch.randn(7, block_size, dim, generator=gen)
    block_ids = torch.tensor([6, 0, 3])
    positions = random_map(gen, num_tokens, max_blocks, block_size, fill=0.8)
    whole = merge_multimodal_embeddings(hidden, buffer, positions, block_ids)
    ranges = [shard_range(r, world_size, num_tokens) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_tokens
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no gap
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    shards = []
    for rank, (start, end) in enumerate(ranges):
        local = global_to_local_positions(positions, rank, world_size, num_tokens)
        inside = (positions >= start) & (positions < end)
        assert torch.equal(local[inside], positions[inside] - start)
        assert bool((local[~inside] == end - start).all())  # out of shard -> local sentinel
        shards.append(merge_multimodal_embeddings(hidden[start:end], buffer, local, block_ids))
    assert torch.equal(torch.cat(shards), whole)


def test_sp_remap_errors_and_explicit_range():
    positions = torch.tensor([[0, 5, 9, 10]])
    assert remap_to_range(positions, 5, 10).tolist() == [[5, 0, 4, 5]]
    with pytest.raises(ValueError, match="rank 4 is not in a world of size 4"):
        shard_range(4, 4, 10)
    with pytest.raises(ValueError, match=r"\(6, 5\)"):
        remap_to_range(positions, 6, 5)


# --- fail-loud checks ----------------------------------------------------------------


def _two_item_map() -> PositionMap:
    items = [ItemPlacement.dense("A", (1,), 4, offset=0, block_size=4),
             ItemPlacement.dense("B", (2,), 3, offset=6, block_size=4)]
    return build_encoder_positions(items, num_tokens=10, max_blocks=3, block_size=4)


def test_check_filled_raises_ec_load_failure_naming_the_item():
    pmap = _two_item_map()
    positions = pmap.encoder_positions.clone()
    positions[1, 1] = 10  # one of B's rows lost
    expected = {"A": range(0, 4), "B": range(6, 9)}
    check_filled(pmap.encoder_positions, expected, num_tokens=10, mode=CacheMode.EPD)
    with pytest.raises(ECLoadFailure, match="mm_hash B") as info:
        check_filled(positions, expected, num_tokens=10, mode=CacheMode.EPD)
    assert info.value.reason is LoadFailureReason.TOKEN_COUNT and info.value.mm_hash == "B"
    assert info.value.expected == 3 and info.value.got == 2
    with pytest.raises(EncoderCacheReadError, match="mm_hash B.*1 placeholder rows unfilled"):
        check_filled(positions, expected, num_tokens=10, mode=CacheMode.MONOLITHIC)


def test_check_filled_catches_duplicates_and_stray_rows():
    pmap = _two_item_map()
    dup = pmap.encoder_positions.clone()
    dup[0, 3] = 1  # A's row 1 written twice, row 3 never
    with pytest.raises(ECLoadFailure, match="A.*1 placeholder rows unfilled, 1 filled more than once"):
        check_filled(dup, {"A": range(4), "B": range(6, 9)}, num_tokens=10, mode=CacheMode.EPD)
    # Every row filled, but the padding slot writes A's row 1 a second time.
    twice = pmap.encoder_positions.clone()
    twice[2, 0] = 1
    with pytest.raises(ECLoadFailure, match="A.*0 placeholder rows unfilled, 1 filled more than once"):
        check_filled(twice, {"A": range(4), "B": range(6, 9)}, num_tokens=10, mode=CacheMode.EPD)
    # The scheduler expects B on 3 rows but the map also writes a text row (9).
    stray = pmap.encoder_positions.clone()
    stray[1, 3] = 9
    with pytest.raises(ECLoadFailure, match="mm_hash B.*outside every placeholder") as info:
        check_filled(stray, {"A": range(4), "B": range(6, 9)}, num_tokens=10,
                     mode=CacheMode.EPD, owners=pmap.owners)
    assert info.value.got == "row 9"
    with pytest.raises(ValueError, match="encoder position 11 is outside"):
        bad = pmap.encoder_positions.clone()
        bad[2, 0] = 11
        check_filled(bad, {}, num_tokens=10, mode=CacheMode.EPD)
    with pytest.raises(ValueError, match="claimed twice"):
        check_filled(pmap.encoder_positions, [("A", range(4)), ("B", range(3, 6))],
                     num_tokens=10, mode=CacheMode.EPD)


def test_check_num_tokens():
    check_num_tokens("h", 256, 256, CacheMode.EPD)
    with pytest.raises(ECLoadFailure, match="expected 256, got 255") as info:
        check_num_tokens("h", 255, 256, CacheMode.EPD)
    assert info.value.reason is LoadFailureReason.TOKEN_COUNT and info.value.mm_hash == "h"
    with pytest.raises(EncoderCacheReadError, match="mm_hash h: expected 256, got 300"):
        check_num_tokens("h", 300, 256, CacheMode.MONOLITHIC)


# --- deepstack -----------------------------------------------------------------------


def test_split_deepstack_and_merge():
    gen = torch.Generator().manual_seed(6)
    num_tokens, hsize, levels, block_size = 12, 4, 3, 4
    buffer = torch.randn(3, block_size, hsize * (1 + levels), generator=gen).to(torch.bfloat16)
    hidden = torch.randn(num_tokens, hsize, generator=gen)
    positions = torch.tensor([[2, 3, 4, 12], [8, 12, 9, 12]])
    block_ids = torch.tensor([2, 0])
    main, stack = merge_deepstack_embeddings(hidden, buffer, positions, num_levels=levels,
                                             block_ids=block_ids)
    fat_ref = naive_merge(torch.cat([hidden, torch.zeros(num_tokens, hsize * levels)], dim=1),
                          buffer, positions, block_ids)
    assert torch.equal(main, fat_ref[:, :hsize])
    compiled = torch.compile(merge_deepstack_embeddings, backend=CompileCounter(), fullgraph=True)
    main_c, stack_c = compiled(hidden, buffer, positions, num_levels=levels, block_ids=block_ids)
    assert torch.equal(main_c, main) and all(torch.equal(a, b) for a, b in zip(stack_c, stack))
    assert len(stack) == levels
    for k, level in enumerate(stack, start=1):
        assert torch.equal(level, fat_ref[:, k * hsize:(k + 1) * hsize])
        assert bool((level[[0, 1, 5, 6, 7, 10, 11]] == 0).all())  # text rows carry no deepstack
    rows = torch.randn(5, hsize * (1 + levels), generator=gen)
    m, parts = split_deepstack(rows, hsize, levels)
    assert torch.equal(torch.cat([m, *parts], dim=1), rows)
    assert m.data_ptr() == rows.data_ptr()  # views, no copy
    with pytest.raises(ValueError, match="rows are 16 wide, expected .* = 12"):
        split_deepstack(rows, hsize, 2)


def test_new_padded_hidden():
    padded = new_padded_hidden(6, 3, dtype=torch.bfloat16)
    assert padded.shape == (7, 3) and padded.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="got 0 and 3"):
        new_padded_hidden(0, 3, dtype=torch.float32)
