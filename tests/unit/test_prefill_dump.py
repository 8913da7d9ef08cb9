"""``epd prefill --dump-dir``: the rows a worker merged, per request and item; SIGTERM while lingering."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from prefill_client.reference import cli
from prefill_client.consumer.client import PulledItem
from prefill_client.reference.dump import REQUESTS_FILE, MergeRecorder
from prefill_client.reference.rows import ScheduledItem, StagingRows
from prefill_client.reference.worker import PrefillWorker
from tests.support.prefill_fakes import FAT_DIM, LIMITS, MODEL_ID, FakeSource, make_lm, png, rows_for


class ClosingFakeSource(FakeSource):
    closed = False

    def close(self) -> None:
        self.closed = True


def fake_factory(source):
    def make(cfg, metrics):
        return source, PrefillWorker(source, make_lm(), model_id=MODEL_ID, metrics=metrics, limits=LIMITS)
    return make


@pytest.fixture
def request_file(tmp_path):
    (tmp_path / "a.png").write_bytes(png(256, 256, seed=5))
    (tmp_path / "b.png").write_bytes(png(128, 192, seed=6))
    turn1 = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look at this and describe it carefully:"}, {"type": "image", "path": "a.png"}]}]}
    turn2 = {"messages": turn1["messages"] + [
        {"role": "assistant", "content": "Noise."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image", "path": "b.png"},
                                     {"type": "image", "path": "a.png"}]}]}
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (turn1, turn2, turn2)) + "\n")
    return path


def test_dump_holds_exactly_the_merged_rows_of_each_item(request_file, tmp_path, capsys):
    source = ClosingFakeSource()
    dump = tmp_path / "dump"
    rc = cli.main(["--requests", str(request_file), "--metrics-port", "-1", "--dump-dir", str(dump)],
                  make_worker=fake_factory(source))
    assert rc == 0 and source.closed
    lines = [json.loads(x) for x in (dump / REQUESTS_FILE).read_text().splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert len(capsys.readouterr().out.splitlines()) == 3
    merged_rows = 0
    for line in lines:
        dumped = {d["item"]: d for d in line["dumps"]}
        for k, item in enumerate(line["items"]):
            if item["layer"] == "prefix":
                assert k not in dumped  # KV reused: nothing merged
                continue
            saved = torch.load(dump / dumped[k]["file"], weights_only=True)
            assert saved["mm_hash"] == item["mm_hash"] == dumped[k]["mm_hash"]
            want = rows_for(item["mm_hash"], item["num_tokens"])[saved["lo"]:]
            assert saved["rows"].shape == (item["num_tokens"] - saved["lo"], FAT_DIM)
            assert torch.equal(saved["rows"], want.to(saved["rows"].dtype))
            merged_rows += saved["rows"].shape[0]
    # request 1 re-sends image a at a new position (merged again, from the local cache)
    assert [i["layer"] for i in lines[1]["items"]] == ["local", "encoder-miss", "local"]
    # the replay: the first two items lie inside the prefix hit, the last one ends past it
    assert [i["layer"] for i in lines[2]["items"]] == ["prefix", "prefix", "local"]
    assert [d["item"] for d in lines[2]["dumps"]] == [2] and lines[2]["dumps"][0]["lo"] > 0
    assert merged_rows > 0


def test_recorder_keeps_only_the_window_part_of_an_item():
    rows = StagingRows(FAT_DIM, num_blocks=8, block_size=16)
    recorder = MergeRecorder(rows)
    emb = rows_for("ab" * 16, 40)
    pulled = PulledItem("ab" * 16, emb, (1, 8, 20), "fake", "hit")
    # item at positions 10..49, the step computes 30..59: rows 20..39 of the item are merged
    recorder.place([ScheduledItem("ab" * 16, 10, 40, pulled)], (30, 60))
    (merged,) = recorder.take()
    assert (merged.offset, merged.lo) == (10, 20)
    assert torch.equal(merged.rows, emb[20:].to(merged.rows.dtype))
    assert recorder.take() == []


def test_sigterm_while_lingering_is_a_clean_exit(request_file, capsys):
    source = ClosingFakeSource()
    before = signal.getsignal(signal.SIGTERM)
    timers: list[threading.Timer] = []

    def make(cfg, metrics):
        _, worker = fake_factory(source)(cfg, metrics)
        prefill = worker.prefill
        done = []

        def counting(request):
            result = prefill(request)
            done.append(result)
            if len(done) == 3:  # the last request: SIGTERM arrives while lingering
                timers.append(threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)))
                timers[-1].start()
            return result

        worker.prefill = counting
        return source, worker

    started = time.monotonic()
    try:
        rc = cli.main(["--requests", str(request_file), "--metrics-port", "0", "--linger-s", "60"],
                      make_worker=make)
    finally:
        for t in timers:
            t.cancel()
    assert rc == 0 and source.closed
    assert time.monotonic() - started < 30
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert signal.getsignal(signal.SIGTERM) is before
