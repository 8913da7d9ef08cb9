"""``epd demo`` pieces: the verifier (it must be able to fail), the workload script, the report math."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

import common.transport
from common.metrics import EncoderMetrics, PrefillMetrics
from encoder_server.demo.cli import resolve_transport
from encoder_server.demo.procs import DemoFailure
from encoder_server.demo.report import Samples, build_report, percentile, ttft_split
from encoder_server.demo.verify import (
    REQUESTS_FILE,
    ReferenceEncoder,
    References,
    Verification,
    compare_rows,
    verify_stream,
)
from encoder_server.demo.workload import ACTIONS, Media, PlannedRequest, generate
from prefill_client.reference.chat import load_requests

WIDTH = 192


def _refs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, WIDTH, generator=g), "b": torch.randn(64, WIDTH, generator=g),
            "c": torch.randn(80, WIDTH, generator=g)}


def test_own_rows_in_the_cache_dtype_pass():
    refs = _refs()
    verdict = compare_rows(refs["a"].to(torch.bfloat16), 0, "a", refs)
    assert verdict.ok and verdict.error < 1e-2
    tail = compare_rows(refs["c"][30:].to(torch.bfloat16), 30, "c", refs)
    assert tail.ok


@pytest.mark.parametrize("corrupt, detail", [
    (lambda r: r + torch.where(torch.arange(64)[:, None] == 7, 0.5, 0.0), "differs from its reference"),
    (lambda r: r.flip(0), "differs from its reference"),
    (lambda r: r[1:], "do not end the item"),
    (lambda r: r[:, :WIDTH // 2], "expected [*, 192]"),
])
def test_corrupted_rows_are_a_mismatch(corrupt, detail):
    refs = _refs()
    verdict = compare_rows(corrupt(refs["a"].to(torch.bfloat16)), 0, "a", refs)
    assert not verdict.ok and detail in verdict.detail


def test_rows_closer_to_another_item_are_a_mismatch_even_within_tolerance():
    refs = _refs()
    # two near-identical items: b's rows are inside a's tolerance, but they are b's
    refs["b"] = refs["a"] + 1e-3
    verdict = compare_rows(refs["b"].clone(), 0, "a", refs)
    assert not verdict.ok and "matches b" in verdict.detail
    assert compare_rows(refs["a"].clone(), 0, "a", refs).ok


def _references() -> References:
    return References(_refs(), {"a": "ha", "b": "hb", "c": "hc"})


def _plan(keys_per_request: list[list[str]]) -> list[PlannedRequest]:
    return [PlannedRequest(0, i, 0, "new", tuple(keys), {}) for i, keys in enumerate(keys_per_request)]


def _dump(tmp_path, records: list[dict], files: dict[str, dict]) -> None:
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
    (tmp_path / REQUESTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


def _record(index: int, items: list[tuple[str, str]], dumps: list[tuple[int, str, str, int]]) -> dict:
    return {"index": index, "ttft_ms": 1.0,
            "items": [{"mm_hash": h, "layer": layer, "offset": 10 * k, "num_tokens": 64}
                      for k, (h, layer) in enumerate(items)],
            "dumps": [{"item": k, "mm_hash": h, "lo": lo, "file": f} for k, h, f, lo in dumps]}


def test_verify_stream_counts_merged_and_prefix_items(tmp_path):
    refs = _refs()
    references = References(refs, {"a": "ha", "b": "hb", "c": "hc"})
    _dump(tmp_path, [
        _record(0, [("ha", "encoder-miss")], [(0, "ha", "r0.pt", 0)]),
        _record(1, [("ha", "prefix"), ("hb", "encoder-hit")], [(1, "hb", "r1.pt", 0)]),
    ], {"r0.pt": {"mm_hash": "ha", "lo": 0, "rows": refs["a"].to(torch.bfloat16)},
        "r1.pt": {"mm_hash": "hb", "lo": 0, "rows": refs["b"].to(torch.bfloat16)}})
    v = Verification()
    verify_stream(v, "w0", _plan([["a"], ["a", "b"]]), tmp_path, references)
    assert (v.verified, v.prefix_items, v.mismatches) == (2, 1, [])


def test_verify_stream_catches_a_corrupted_dump_and_what_depended_on_it(tmp_path):
    references = _references()
    refs = references.rows
    bad = refs["a"].to(torch.bfloat16).clone()
    bad[5, 3] += 1.0  # one value of one row
    _dump(tmp_path, [
        _record(0, [("ha", "encoder-miss")], [(0, "ha", "r0.pt", 0)]),
        _record(1, [("ha", "prefix"), ("hb", "local")], []),  # b merged but not dumped
    ], {"r0.pt": {"mm_hash": "ha", "lo": 0, "rows": bad}})
    v = Verification()
    verify_stream(v, "w0", _plan([["a"], ["a", "b"], ["b"]]), tmp_path, references)
    assert v.verified == 0 and v.prefix_items == 0
    text = "\n".join(v.mismatches)
    assert "w0 request 0 item 0 (a, encoder-miss): differs from its reference" in text
    assert "served from the prefix cache but never merged before" in text
    assert "merged but no rows were dumped" in text
    assert "2 requests dumped, 3 sent" in text
    assert v.as_dict()["mismatches"] == 4


def test_verify_stream_catches_an_item_named_by_the_wrong_hash(tmp_path):
    references = _references()
    refs = references.rows
    rows = {"mm_hash": "ha", "lo": 0, "rows": refs["a"].to(torch.bfloat16)}
    rows2 = {"mm_hash": "hx", "lo": 0, "rows": refs["a"].to(torch.bfloat16)}
    _dump(tmp_path, [_record(0, [("ha", "encoder-miss")], [(0, "ha", "r0.pt", 0)]),
                     _record(1, [("hx", "encoder-miss")], [(0, "hx", "r1.pt", 0)])],
          {"r0.pt": rows, "r1.pt": rows2})
    v = Verification()
    verify_stream(v, "w0", _plan([["a"], ["a"]]), tmp_path, references)
    assert v.verified == 1 and v.mismatches == ["w0 request 1 item 0 (a, encoder-miss): named hx, its bytes hash to ha"]


def test_reference_encoder_output_fails_against_a_perturbed_copy(tmp_path):
    work = generate(tmp_path, workers=1, users=1, requests_per_user=1)
    ref = ReferenceEncoder()
    refs = {k: ref.encode(work.media[k]) for k in ("img00", "img01")}
    assert len({ref.mm_hash(m) for m in work.media.values()}) == len(work.media)
    assert refs["img00"].shape == (64, WIDTH)  # 256x256 -> 64 merged tokens
    cached = refs["img00"].to(torch.bfloat16)
    assert compare_rows(cached, 0, "img00", refs).ok
    noisy = cached.float() + 0.05 * torch.randn(cached.shape, generator=torch.Generator().manual_seed(0))
    assert not compare_rows(noisy, 0, "img00", refs).ok


def test_workload_plays_the_script_with_interleaved_users(tmp_path):
    work = generate(tmp_path, workers=2, users=2, requests_per_user=7, seed=3)
    assert [len(s) for s in work.streams] == [14, 14] and work.num_requests == 28
    images = [m for m in work.media.values() if m.kind == "image"]
    assert len({(m.width, m.height) for m in images}) == len(images)
    assert len({round(m.width / m.height, 2) for m in images}) >= 6
    assert {m.fmt for m in images} == {"PNG", "JPEG"}
    assert len({m.frames[0] for m in images}) == len(images)
    for m in images:
        with Image.open(tmp_path / m.paths[0]) as img:
            assert img.size == (m.width, m.height) and img.format == m.fmt
    video = work.media["video"]
    assert video.kind == "video" and 4 <= len(video.frames) <= 8 and video.fps > 0

    s0 = work.streams[0]
    assert [r.user for r in s0[:4]] == [0, 1, 0, 1]  # users interleave
    assert [r.action for r in s0[::2]] == [*ACTIONS, ACTIONS[0]]
    by_action = {r.action: r for r in s0[:12] if r.user == 0}  # the first pass of the script
    assert by_action["follow-up"].media[0] == by_action["new"].media[0]  # history re-sent
    assert by_action["same-image"].media[-1] == by_action["same-image"].media[0]
    assert by_action["replay"].body == by_action["video"].body
    fresh = by_action["fresh-text"]
    other_worker = {k for r in work.streams[1] for k in r.media}
    assert fresh.media[0] in other_worker and fresh.media[1] == by_action["new"].media[0]
    assert by_action["video"].media[-1] == "video"
    # the second pass starts a new chat with the user's next images
    assert s0[12].action == "new" and s0[12].media[0] not in by_action["follow-up"].media

    parsed = load_requests(work.request_file(0))
    assert len(parsed) == 14
    assert [len(r.media) for r in parsed] == [len(r.media) for r in s0]
    assert parsed[0].media[0].frames == work.media[s0[0].media[0]].frames


@pytest.mark.parametrize("bad", [{"users": 0}, {"requests_per_user": 0}, {"workers": 0}])
def test_workload_rejects_empty_sizes(tmp_path, bad):
    with pytest.raises(ValueError, match="must be"):
        generate(tmp_path, **bad)


def test_percentile_and_ttft_split():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    with pytest.raises(ValueError, match="101"):
        percentile([1.0], 101)
    records = [{"ttft_ms": 10.0, "items": [{"layer": "prefix"}, {"layer": "local"}]},
               {"ttft_ms": 30.0, "items": [{"layer": "encoder-miss"}, {"layer": "local"}]},
               {"ttft_ms": 20.0, "items": [{"layer": "encoder-hit"}]},
               {"ttft_ms": 99.0, "items": []}]
    split = ttft_split(records)
    assert split["hit"] == {"requests": 2, "p50_ms": 15.0, "p99_ms": 19.9}
    assert split["miss"] == {"requests": 1, "p50_ms": 30.0, "p99_ms": 30.0}


def test_report_combines_the_processes_metrics():
    enc = EncoderMetrics()
    enc.device_queries.inc(10)
    enc.device_misses.inc(4)
    enc.device_evictions.inc(3)
    enc.mm_cache_queries.inc(4)
    enc.set_occupancy(active=5, free=2, held=0, active_real_tokens=200)
    workers = [PrefillMetrics(), PrefillMetrics()]
    for i, w in enumerate(workers):
        w.pull_bytes.inc(1e6 * (i + 1))
        w.pulls.inc(2)
        w.pull_latency.observe(0.001)
        w.prefix_cache_queries.inc(10)
        w.prefix_cache_hits.inc(4)
    workers[1].load_failures.labels(reason="timeout").inc()
    report = build_report(
        transport="mock", transport_detail="test", encoder_metrics=Samples.parse(enc.exposition().decode()),
        worker_metrics=Samples.parse(*(w.exposition().decode() for w in workers)),
        records=[[{"ttft_ms": 5.0, "items": [{"layer": "encoder-miss"}]}], []],
        verification={"verified_items": 1, "verified_prefix_items": 0, "mismatches": 0},
        block_size=64, cache_blocks=8, workload={}, elapsed_s=1.0)
    assert report["layers"]["device_cache"] == {"queries": 10, "hits": 6, "hit_rate": 0.6, "misses": 4}
    assert report["layers"]["prefix"]["queries"] == 20 and report["layers"]["prefix"]["hits"] == 8
    assert report["evictions"] == 3
    assert report["pulls"] == {"items": 4, "bytes": 3_000_000, "seconds": 0.002, "gb_per_s": 1.5}
    assert report["padding"]["waste_tokens"] == 5 * 64 - 200
    assert report["padding"]["waste_pct"] == pytest.approx(100 * 120 / 320, abs=0.01)
    assert report["load_failures"] == {"timeout": 1}
    assert report["requests"] == 1 and report["requests_per_worker"] == [1, 0]
    assert report["items"]["encoder-miss"] == 1


def test_media_is_a_slotted_record():
    assert not hasattr(Media("k", "image", ("p",), (b"x",), 0.0, 1, 1, "PNG"), "__dict__")


def test_transport_choice_says_why(monkeypatch):
    monkeypatch.setattr(common.transport, "nixl_available", lambda: (False, "no module named nixl"))
    kind, why = resolve_transport("auto")
    assert kind == "mock" and "NIXL does not import (no module named nixl)" in why
    with pytest.raises(DemoFailure, match="--transport nixl, but NIXL does not import: no module named nixl"):
        resolve_transport("nixl")
    assert resolve_transport("mock")[0] == "mock"
    monkeypatch.setattr(common.transport, "nixl_available", lambda: (True, "nixl_cu12._api"))
    assert resolve_transport("auto") == ("nixl", "nixl_cu12._api, UCX on loopback")
