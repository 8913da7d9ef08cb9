"""The reference's "when each metric fires" table, run on real processes and scraped from /metrics.

One `epd encoder` process and one `epd prefill` process (real NIXL where it
imports, the mock agent otherwise). The prefill worker runs one request per
step (``tests.support.gated_prefill``) so both ``/metrics`` endpoints are
scraped between steps and every counter's delta is asserted exactly:

* the five situations of the reference: cold turn, text follow-up, same
  image at a new position, identical replay, same image with different text;
* then an eviction scenario: three images in rotation through a cache with
  room for two, with the worker's own pulled-items cache at one block, so
  every request reaches the encoder: from the first full-cache step on,
  every step evicts one block and re-encodes one item (the two device
  counters move together);
* the occupancy invariant ``active + free + held == num_blocks - 1`` on every
  encoder scrape, and ``promtool check metrics`` on both outputs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common import metrics as m
from common.transport import nixl_available
from epd_harness.media import image_bytes
from epd_harness.procs import EncoderProcess, start_encoder
from tests.support.prefill_proc import StepResult, start_gated_prefill
from tests.support.scrape import Scrape, promtool_path, promtool_problems, scrape

pytestmark = pytest.mark.timeout(240)

CACHE_BLOCKS = 3  # two usable blocks + the scratch block
BLOCK_SIZE = 64  # a 64x64 image is 64 merged tokens: one block
HOLD_MS = 100
PREFIX_BLOCK = 16
QUIET_TIMEOUT_S = 10.0

TRANSPORT = "nixl" if nixl_available()[0] else "mock"

# Counters, by short name, and the process that exports them.
PREFILL = {
    "mm_q": m.MM_CACHE_QUERIES + "_total", "mm_h": m.MM_CACHE_HITS + "_total",
    "prefix_q": m.PREFIX_CACHE_QUERIES + "_total", "prefix_h": m.PREFIX_CACHE_HITS + "_total",
    "sched_q": m.SCHEDULER_EC_QUERIES + "_total", "sched_h": m.SCHEDULER_EC_HITS + "_total",
    "pulls": m.EPD_PULLS + "_total",
}
ENCODER = {
    "dev_q": m.DEVICE_EC_QUERIES + "_total", "dev_m": m.DEVICE_EC_MISSES + "_total",
    "evict": m.DEVICE_EC_EVICTIONS + "_total",
    "mm_q": m.MM_CACHE_QUERIES + "_total", "mm_h": m.MM_CACHE_HITS + "_total",
}
ENCODER_CALLS = ("Encode", "Lookup")

SITUATIONS = ("turn1-cold", "turn2-text-follow-up", "turn3-same-image-new-position", "replay", "fresh-text")
ROTATION = [(r, k) for r in (1, 2) for k in (1, 2, 3)]


def _image(path: str) -> dict[str, str]:
    return {"type": "image", "path": path}


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def requests() -> list[dict[str, object]]:
    """The reference's conversation (each turn re-sends the history), then the rotation."""
    turn1 = [{"role": "user", "content": [_image("a.png"), _text("Describe this picture in detail please.")]}]
    turn2 = turn1 + [{"role": "assistant", "content": "It is noise."},
                     {"role": "user", "content": "What colours are in it?"}]
    turn3 = turn2 + [{"role": "assistant", "content": "Many."},
                     {"role": "user", "content": [_image("a.png"), _text("And this one, what do you see here?")]}]
    fresh = [{"role": "user", "content": [_image("a.png"), _text("A different question entirely.")]}]
    out: list[dict[str, object]] = [{"messages": t} for t in (turn1, turn2, turn3, turn3, fresh)]
    for r, k in ROTATION:
        # Text first: the prompts diverge in their first block, so no prefix hit covers the image.
        out.append({"messages": [{"role": "user", "content": [_text(f"R{r}P{k}: what is in this picture?"),
                                                              _image(f"x{k}.png")]}]})
    return out


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    result: StepResult
    prefill: dict[str, float]  # counter deltas over the step
    encoder: dict[str, float]
    calls: dict[str, float]  # encoder RPCs (status OK) over the step


@dataclass(frozen=True, slots=True)
class Scenario:
    steps: list[Step]
    encoder_scrapes: list[Scrape]
    prefill_text: str
    encoder_text: str
    summary: dict[str, object]
    final_prefill: Scrape


def _quiet_encoder(enc: EncoderProcess) -> Scrape:
    """Scrape once every lease of the last step is released (the client releases them in a batch after the pull)."""
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    while True:
        s = scrape(enc.metrics_port)
        if s.get(m.EPD_LEASES_ACTIVE) == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"leases still active after {QUIET_TIMEOUT_S} s:\n{s.text}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp: Path = tmp_path_factory.mktemp("metrics")
    (tmp / "a.png").write_bytes(image_bytes(64, 64, seed=1))
    for k in (1, 2, 3):
        (tmp / f"x{k}.png").write_bytes(image_bytes(64, 64, seed=10 + k))
    (tmp / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests()))

    enc = start_encoder(tmp, "--transport", TRANSPORT, "--cache-blocks", str(CACHE_BLOCKS),
                        "--block-size", str(BLOCK_SIZE), "--min-hold-ms", str(HOLD_MS))
    worker = None
    try:
        worker = start_gated_prefill(
            tmp, "--encoder", enc.target, "--transport", TRANSPORT, "--requests", str(tmp / "requests.jsonl"),
            "--local-cache-blocks", "1", "--prefix-block-size", str(PREFIX_BLOCK), "--json", "--linger-s", "120")
        enc_before, pre_before = _quiet_encoder(enc), scrape(worker.metrics_port)
        encoder_scrapes = [enc_before]
        steps: list[Step] = []
        names = list(SITUATIONS) + [f"round{r}-x{k}" for r, k in ROTATION]
        for name in names:
            if name.startswith("round"):
                # The LRU item was handed out at least one step ago: let its hold pass, so the
                # eviction frees its block at once instead of asking the client to come back.
                time.sleep(HOLD_MS / 1000 + 0.05)
            result = worker.step()
            enc_after, pre_after = _quiet_encoder(enc), scrape(worker.metrics_port)
            encoder_scrapes.append(enc_after)
            steps.append(Step(
                name, result,
                {k: pre_after.delta(pre_before, n) for k, n in PREFILL.items()},
                {k: enc_after.delta(enc_before, n) for k, n in ENCODER.items()},
                {c: enc_after.delta(enc_before, m.EPD_ENCODE_REQUESTS + "_total", code="OK", method=c)
                 for c in ENCODER_CALLS}))
            enc_before, pre_before = enc_after, pre_after
        summary = worker.summary()
        yield Scenario(steps, encoder_scrapes, pre_before.text, enc_before.text, summary, pre_before)
    finally:
        worker_code = worker.stop() if worker is not None else 0
        code = enc.terminate()
    assert worker_code == 0, worker.log() if worker is not None else ""
    assert code == 0, enc.log()


def _step(scenario: Scenario, name: str) -> Step:
    return next(s for s in scenario.steps if s.name == name)


ZERO_ENCODER = {"dev_q": 0, "dev_m": 0, "evict": 0, "mm_q": 0, "mm_h": 0}
NO_CALLS = {"Encode": 0, "Lookup": 0}


def test_cold_turn_encodes_once(scenario: Scenario) -> None:
    s = _step(scenario, "turn1-cold")
    p = s.result.prompt_tokens
    assert s.result.layers == ("encoder-miss",) and s.result.prefix_hit_tokens == 0
    assert s.prefill == {"mm_q": 1, "mm_h": 0, "prefix_q": (p - 1) // PREFIX_BLOCK, "prefix_h": 0,
                         "sched_q": 1, "sched_h": 0, "pulls": 1}
    # Layer 2a asked the encoder first (Lookup: not there), then Encode ran it: one layer-3
    # query, one miss; the encoder's own layer 1 decoded the pixels once.
    assert s.encoder == {"dev_q": 1, "dev_m": 1, "evict": 0, "mm_q": 1, "mm_h": 0}
    assert s.calls == {"Encode": 1, "Lookup": 1}


def test_text_follow_up_is_served_by_the_prefix_cache(scenario: Scenario) -> None:
    turn1, s = _step(scenario, "turn1-cold"), _step(scenario, "turn2-text-follow-up")
    p = s.result.prompt_tokens
    stored = turn1.result.prompt_tokens // PREFIX_BLOCK
    assert s.result.layers == ("prefix",) and s.result.prefix_hit_tokens == stored * PREFIX_BLOCK
    assert s.prefill == {"mm_q": 1, "mm_h": 1, "prefix_q": (p - 1) // PREFIX_BLOCK, "prefix_h": stored,
                         "sched_q": 0, "sched_h": 0, "pulls": 0}
    assert s.encoder == ZERO_ENCODER and s.calls == NO_CALLS


def test_same_image_at_a_new_position_is_a_scheduler_hit(scenario: Scenario) -> None:
    turn2, s = _step(scenario, "turn2-text-follow-up"), _step(scenario, "turn3-same-image-new-position")
    p = s.result.prompt_tokens
    stored = turn2.result.prompt_tokens // PREFIX_BLOCK
    assert s.result.layers == ("prefix", "local")
    assert s.prefill == {"mm_q": 2, "mm_h": 2, "prefix_q": (p - 1) // PREFIX_BLOCK, "prefix_h": stored,
                         "sched_q": 1, "sched_h": 1, "pulls": 0}
    assert s.encoder == ZERO_ENCODER and s.calls == NO_CALLS


def test_identical_replay_hits_every_reusable_block(scenario: Scenario) -> None:
    turn3, s = _step(scenario, "turn3-same-image-new-position"), _step(scenario, "replay")
    reusable = (s.result.prompt_tokens - 1) // PREFIX_BLOCK
    assert s.result.layers == ("prefix", "prefix") and s.result.first_token == turn3.result.first_token
    assert s.prefill == {"mm_q": 2, "mm_h": 2, "prefix_q": reusable, "prefix_h": reusable,
                         "sched_q": 0, "sched_h": 0, "pulls": 0}
    assert s.encoder == ZERO_ENCODER and s.calls == NO_CALLS


def test_same_image_with_different_text_is_a_partial_prefix_hit(scenario: Scenario) -> None:
    s = _step(scenario, "fresh-text")
    reusable = (s.result.prompt_tokens - 1) // PREFIX_BLOCK
    image_blocks = (3 + 64) // PREFIX_BLOCK  # BOS, USER, VISION_START, then 64 placeholders
    assert 0 < image_blocks < reusable
    assert s.result.layers == ("local",) and s.result.prefix_hit_tokens == image_blocks * PREFIX_BLOCK
    assert s.prefill == {"mm_q": 1, "mm_h": 1, "prefix_q": reusable, "prefix_h": image_blocks,
                         "sched_q": 1, "sched_h": 1, "pulls": 0}
    assert s.encoder == ZERO_ENCODER and s.calls == NO_CALLS


def test_evictions_and_re_encode_misses_move_together(scenario: Scenario) -> None:
    rotation = [s for s in scenario.steps if s.name.startswith("round")]
    assert len(rotation) == len(ROTATION)
    for i, s in enumerate(rotation):
        second_round = i >= 3
        assert s.result.layers == ("encoder-miss",) and s.result.prefix_hit_tokens == 0, s.name
        reusable = (s.result.prompt_tokens - 1) // PREFIX_BLOCK
        assert s.prefill == {"mm_q": 1, "mm_h": int(second_round), "prefix_q": reusable, "prefix_h": 0,
                             "sched_q": 1, "sched_h": 0, "pulls": 1}, s.name
        # Step 0 still finds a free block (only the conversation's image is cached); from then on
        # the cache is full and each new item evicts the least recent one: one block out, one
        # item re-encoded. In the second round the encoder's own layer-1 has the pixels.
        assert s.encoder == {"dev_q": 1, "dev_m": 1, "evict": int(i > 0), "mm_q": 1,
                             "mm_h": int(second_round)}, s.name
        assert s.calls == {"Encode": 1, "Lookup": 1}, s.name
    evictions = sum(s.encoder["evict"] for s in rotation[1:])
    misses = sum(s.encoder["dev_m"] for s in rotation[1:])
    assert evictions == misses == len(rotation) - 1


def test_occupancy_invariant_on_every_encoder_scrape(scenario: Scenario) -> None:
    assert len(scenario.encoder_scrapes) == len(scenario.steps) + 1
    for i, s in enumerate(scenario.encoder_scrapes):
        assert s.occupancy_sum() == CACHE_BLOCKS - 1, (i, s.text)
        waste = s.get(m.DEVICE_EC_ACTIVE_BLOCKS) * BLOCK_SIZE - s.get(m.DEVICE_EC_ACTIVE_REAL_TOKENS)
        assert waste == 0, i  # every item is exactly one full block
    assert scenario.encoder_scrapes[0].get(m.DEVICE_EC_FREE_BLOCKS) == CACHE_BLOCKS - 1
    assert scenario.encoder_scrapes[-1].get(m.DEVICE_EC_ACTIVE_BLOCKS) == CACHE_BLOCKS - 1


def test_summary_agrees_with_the_scrapes(scenario: Scenario) -> None:
    """The worker's own --json totals are the sum of the scraped deltas (nothing counted off-scrape)."""
    totals = scenario.summary["metrics"]
    assert isinstance(totals, dict)
    for key, name in PREFILL.items():
        assert totals[name] == sum(s.prefill[key] for s in scenario.steps) == scenario.final_prefill.get(name)


def test_metrics_pass_promtool(scenario: Scenario) -> None:
    promtool = promtool_path()
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); /metrics lint not run")
    for who, text in (("prefill", scenario.prefill_text), ("encoder", scenario.encoder_text)):
        assert promtool_problems(text, promtool) == [], who
