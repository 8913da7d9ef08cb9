"""``epd prefill``: request file parsing, output lines, JSON summary, /metrics, exit codes."""

from __future__ import annotations

import json
import urllib.request

import pytest

from common.errors import InvalidRequestError
from prefill_client.reference import cli
from prefill_client.reference.chat import MediaItem, load_requests
from prefill_client.reference.worker import PrefillWorker
from tests.support.prefill_fakes import LIMITS, MODEL_ID, FakeSource, make_lm, png


@pytest.fixture
def request_file(tmp_path):
    (tmp_path / "cat.png").write_bytes(png(128, 128, seed=5))
    for i in range(2):
        (tmp_path / f"f{i}.png").write_bytes(png(64, 64, seed=20 + i))
    turn1 = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look at this and describe it carefully:"},
        {"type": "image", "path": "cat.png"}]}]}
    turn2 = {"messages": turn1["messages"] + [
        {"role": "assistant", "content": "A noisy square."},
        {"role": "user", "content": [{"type": "text", "text": "And the clip?"},
                                     {"type": "video", "paths": ["f0.png", "f1.png"], "fps": 2}]}]}
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (turn1, turn2, turn2)) + "\n\n")
    return path


def test_load_requests_reads_media_relative_to_the_file(request_file):
    requests = load_requests(request_file)
    assert len(requests) == 3
    media = requests[1].media
    assert [m.kind for m in media] == ["image", "video"]
    assert media[0].frames == ((request_file.parent / "cat.png").read_bytes(),)
    assert media[1].fps == 2.0 and len(media[1].frames) == 2
    assert requests[1].messages[1].parts == ("A noisy square.",)


@pytest.mark.parametrize("line, match", [
    ("{not json", "requests.jsonl:1: not JSON"),
    ('{"messages": []}', "non-empty 'messages'"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "role must be"),
    ('{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}', "part type must be"),
    ('{"messages": [{"role": "user", "content": [{"type": "image", "path": "nope.png"}]}]}', "cannot read 'nope.png'"),
    ('{"messages": [{"role": "user", "content": [{"type": "video", "paths": ["a"], "fps": -1}]}]}', "'fps' must be"),
])
def test_bad_request_lines_name_the_line_and_the_field(tmp_path, line, match):
    path = tmp_path / "requests.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InvalidRequestError, match=match):
        load_requests(path)


def test_media_item_rejects_empty_bytes():
    with pytest.raises(InvalidRequestError, match="has no bytes"):
        MediaItem.image(b"", label="x")


def fake_factory(source):
    def make(cfg, metrics):
        worker = PrefillWorker(source, make_lm(), model_id=MODEL_ID, metrics=metrics, limits=LIMITS)
        return source, worker
    return make


class ClosingFakeSource(FakeSource):
    closed = False

    def close(self):
        self.closed = True


def test_main_prints_one_line_per_request_and_a_json_summary(request_file, capsys, tmp_path):
    source = ClosingFakeSource()
    ready = tmp_path / "ready.json"
    rc = cli.main(["--requests", str(request_file), "--json", "--metrics-port", "0",
                   "--ready-file", str(ready)], make_worker=fake_factory(source))
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and source.closed
    assert len(out) == 4
    assert out[0].startswith("request 0: first_token=") and "items=[image:encoder-miss]" in out[0]
    # turn 1 stored 3 blocks (61 tokens): the image at 42..57 sticks out of them
    assert "items=[image:local video:encoder-miss]" in out[1]
    assert "items=[image:prefix video:prefix]" in out[2]  # 99 tokens: the video ends at 96
    summary = json.loads(out[3])
    assert [r["items"][0]["layer"] for r in summary["requests"]] == ["encoder-miss", "local", "prefix"]
    assert summary["metrics"]["vllm:mm_cache_queries_total"] == 5.0
    assert summary["metrics"]["vllm:mm_cache_hits_total"] == 3.0
    assert summary["mode"] == "epd" and summary["graph"] == "eager"
    assert json.loads(ready.read_text())["metrics_port"] > 0


def test_metrics_endpoint_serves_the_worker_registry(request_file, capsys, tmp_path):
    seen = {}

    def make(cfg, metrics):
        source, worker = fake_factory(ClosingFakeSource())(cfg, metrics)
        port = json.loads((tmp_path / "ready.json").read_text())["metrics_port"]
        worker.prefill(load_requests(request_file)[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            seen["body"] = resp.read().decode()
        return source, worker

    rc = cli.main(["--requests", str(request_file), "--metrics-port", "0",
                   "--ready-file", str(tmp_path / "ready.json")], make_worker=make)
    assert rc == 0
    assert "vllm:mm_cache_queries_total 1.0" in seen["body"]
    assert "vllm_neuron:scheduler_encoder_cache_queries_total 1.0" in seen["body"]


def test_ec_load_failure_exits_1_and_says_which_request(request_file, capsys):
    source = ClosingFakeSource(token_skew=1)
    rc = cli.main(["--requests", str(request_file), "--metrics-port", "-1"], make_worker=fake_factory(source))
    err = capsys.readouterr().err
    assert rc == cli.EXIT_LOAD_FAILURE and source.closed
    assert "request 0: EC load failure (token_count)" in err


def test_unreadable_requests_file_exits_2(tmp_path, capsys):
    rc = cli.main(["--requests", str(tmp_path / "missing.jsonl"), "--metrics-port", "-1"])
    assert rc == cli.EXIT_ERROR
    assert "cannot read requests file" in capsys.readouterr().err


def test_bad_flag_value_is_a_usage_error(request_file):
    with pytest.raises(SystemExit) as info:
        cli.main(["--requests", str(request_file), "--prefix-block-size", "0"])
    assert info.value.code == 2
