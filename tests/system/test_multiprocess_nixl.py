"""Encoder and consumers in separate processes over real NIXL (UCX on this host), data verified.

An `epd encoder` process serves; two consumer processes pull at the same
time (overlapping items), a third finds the items by ``mm_hash`` only, and
a real `epd prefill` process serves a chat request from the same cache.
Every pulled embedding is compared with a local reference encode. Skipped,
with the reason, only where NIXL cannot be imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import metrics as m
from epd_harness.media import image_bytes, video_frames
from epd_harness.procs import start_encoder
from tests.support.json_lines import last_json_object
from tests.support.reference import Reference, matches
from tests.support.scrape import scrape
from tests.transport_params import NIXL_OK, NIXL_REASON

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL not importable: {NIXL_REASON}"),
    pytest.mark.timeout(240),
]

CLIENT_TIMEOUT_S = 90.0
REF = Reference()


def _client(tmp: Path, target: str, name: str, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.support.pull_client", "--encoder", target, "--transport", "nixl",
           "--consumer-id", name, "--out", str(tmp / f"{name}.pt"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen[bytes]) -> dict:  # type: ignore[type-arg]
    try:
        out, err = proc.communicate(timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err.decode(errors="replace")
    return last_json_object(out)  # type: ignore[no-any-return]


def _load(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp / f"{name}.pt")  # type: ignore[no-any-return]


def test_consumer_processes_pull_verified_embeddings_over_nixl(tmp_path: Path) -> None:
    sizes = [(64, 64), (200, 120), (300, 300)]  # 64, 64 and 81 merged tokens: one or two blocks
    images = [image_bytes(w, h, seed=s + 1) for s, (w, h) in enumerate(sizes)]
    frames = video_frames(64, 96, 4, seed=7)
    paths = []
    for i, data in enumerate(images):
        (tmp_path / f"img{i}.png").write_bytes(data)
        paths.append(str(tmp_path / f"img{i}.png"))
    frame_paths = []
    for i, data in enumerate(frames):
        (tmp_path / f"f{i}.png").write_bytes(data)
        frame_paths.append(str(tmp_path / f"f{i}.png"))
    refs = {paths[i]: REF.image(images[i]) for i in range(3)}
    video_ref = REF.video(frames)

    enc = start_encoder(tmp_path, "--transport", "nixl", "--cache-blocks", "32", "--block-size", "64")
    try:
        assert enc.transport == "nixl"
        # Two consumers at once, both asking for img0: it is encoded once (coalesced or a hit).
        a = _client(tmp_path, enc.target, "a", "--image", paths[0], "--image", paths[1],
                    "--video", ",".join(frame_paths))
        b = _client(tmp_path, enc.target, "b", "--image", paths[0], "--image", paths[2])
        out_a, out_b = _finish(a), _finish(b)
        got_a, got_b = _load(tmp_path, "a"), _load(tmp_path, "b")
        ha = [i["mm_hash"] for i in out_a["items"]]
        hb = [i["mm_hash"] for i in out_b["items"]]
        assert ha[0] == hb[0] and len({*ha, *hb}) == 4
        assert matches(got_a[ha[0]], refs[paths[0]]) and matches(got_a[ha[1]], refs[paths[1]])
        assert matches(got_a[ha[2]], video_ref)
        assert matches(got_b[hb[1]], refs[paths[2]])
        assert not matches(got_b[hb[1]], torch.zeros_like(refs[paths[2]]))
        assert torch.equal(got_a[ha[0]], got_b[hb[0]])  # the same cached rows, read twice
        tokens2 = refs[paths[2]].shape[0]
        assert [i["num_tokens"] for i in out_b["items"]] == [64, tokens2] and tokens2 > 64
        # Pull bytes are whole blocks of the layout (64 rows x fat_dim 192 x bf16).
        block_bytes = 64 * 192 * 2
        blocks2 = -(-tokens2 // 64)
        assert out_b["pull_bytes"] == (1 + blocks2) * block_bytes and out_b["pulls"] == 2
        s = scrape(enc.metrics_port)
        assert s.get(m.DEVICE_EC_QUERIES + "_total") == 5
        assert s.get(m.DEVICE_EC_MISSES + "_total") == 4

        # Then, at the same time: a third process that knows only the hashes (Lookup + pull, no
        # encoder run) and the real `epd prefill` process (img2 is on the encoder, not in it).
        req = {"messages": [{"role": "user", "content": [{"type": "image", "path": "img2.png"},
                                                         {"type": "text", "text": "What is this?"}]}]}
        (tmp_path / "req.jsonl").write_text(json.dumps(req) + "\n")
        c = _client(tmp_path, enc.target, "c", "--lookup", ha[1], "--lookup", hb[1])
        prefill = subprocess.Popen(
            [sys.executable, "-m", "common.cli", "prefill", "--encoder", enc.target, "--transport", "nixl",
             "--requests", str(tmp_path / "req.jsonl"), "--json", "--metrics-port", "-1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out_c, summary = _finish(c), _finish(prefill)
        got_c = _load(tmp_path, "c")
        assert [i["source"] for i in out_c["items"]] == ["hit", "hit"]
        assert torch.equal(got_c[ha[1]], got_a[ha[1]]) and torch.equal(got_c[hb[1]], got_b[hb[1]])
        item = summary["requests"][0]["items"][0]
        assert (item["mm_hash"], item["layer"], item["num_tokens"]) == (hb[1], "encoder-hit", tokens2)
        assert summary["metrics"]["epd_pull_bytes_total"] == blocks2 * block_bytes
        assert scrape(enc.metrics_port).get(m.DEVICE_EC_MISSES + "_total") == 4
    finally:
        code = enc.terminate()
    assert code == 0, enc.log()
