from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest

from common.fingerprint import EMPTY_TAG, mm_hash_fingerprint

SAMPLES = ["a", "img:0f3c", "ünïcödé", "x" * 1000]


def test_definition_is_blake2b_64_little_endian_signed() -> None:
    digest = hashlib.blake2b(b"img:0f3c", digest_size=8).digest()
    assert mm_hash_fingerprint("img:0f3c") == int.from_bytes(digest, "little", signed=True)


def test_in_int64_range_and_nonzero_on_100k_random_hashes() -> None:
    rng = random.Random(1234)
    seen = set()
    for _ in range(100_000):
        value = mm_hash_fingerprint(rng.getrandbits(256).to_bytes(32, "big").hex())
        assert value != EMPTY_TAG
        assert -(2**63) <= value < 2**63
        seen.add(value)
    assert len(seen) == 100_000  # no collisions among 100k (expected ~3e-10)


def test_stable_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from common.fingerprint import mm_hash_fingerprint as f;"
        f"print([f(s) for s in {SAMPLES!r}])"
    )
    outputs = set()
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        outputs.add(out)
    assert outputs == {str([mm_hash_fingerprint(s) for s in SAMPLES])}


@pytest.mark.parametrize("bad", ["", None, b"bytes", 5])
def test_rejects_non_strings(bad: object) -> None:
    with pytest.raises(ValueError, match="mm_hash"):
        mm_hash_fingerprint(bad)  # type: ignore[arg-type]
