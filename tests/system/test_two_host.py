"""Two hosts on one machine: encoder and consumer in two network namespaces joined by a veth pair.

The test creates both namespaces itself (unique names), a veth pair with a
private /30 that exists only inside them, and starts the encoder in one and
the consumers in the other with ``ip netns exec``, both with
``UCX_TLS=tcp,self`` and ``UCX_NET_DEVICES`` set to their veth (set before
the process starts: otherwise UCX's cross-memory-attach would copy between
the two processes directly and bypass the link). The proof that a real NIXL
READ crossed the link: the consumer's veth received at least the pulled
bytes while a lookup-only consumer (whose gRPC traffic is a few hundred
bytes) pulled, and the pulled embeddings equal a local reference encode.
The namespaces are always deleted. Skipped, with the reason, where
namespaces or veth pairs cannot be created (not root, no iproute2) or NIXL
cannot be imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from epd_harness.media import image_bytes
from epd_harness.waits import wait_ready
from tests.support.json_lines import last_json_object
from tests.support.reference import Reference, matches
from tests.transport_params import NIXL_OK, NIXL_REASON

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not NIXL_OK, reason=f"NIXL not importable: {NIXL_REASON}"),
    pytest.mark.timeout(240),
]

IP_TIMEOUT_S = 10.0
READY_LIMIT_S = 200.0  # the whole start; a stalled one fails long before (epd_harness.waits)
CLIENT_TIMEOUT_S = 90.0
# Only inside the namespaces this test creates; nothing else is ever addressed.
ENCODER_ADDR, CONSUMER_ADDR, PREFIX_LEN = "10.213.0.1", "10.213.0.2", 30
BLOCK_SIZE = 64
REF = Reference()


@dataclass(frozen=True, slots=True)
class Hosts:
    encoder_ns: str
    consumer_ns: str
    encoder_dev: str
    consumer_dev: str

    def env(self, dev: str) -> dict[str, str]:
        return {**os.environ, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": dev}

    def rx_bytes(self) -> int:
        """Bytes the consumer's veth has received so far."""
        out = _ip("-n", self.consumer_ns, "-s", "-j", "link", "show", "dev", self.consumer_dev)
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if proc.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') not installed: cannot create network namespaces")
    tag = f"{os.getpid() % 100000}"
    h = Hosts(f"epd-test-{tag}-a", f"epd-test-{tag}-b", f"epda{tag}", f"epdb{tag}")
    try:
        _ip("netns", "add", h.encoder_ns)
    except OSError as exc:
        pytest.skip(f"cannot create a network namespace (needs root and iproute2): {exc}")
    created = [h.encoder_ns]
    try:
        _ip("netns", "add", h.consumer_ns)
        created.append(h.consumer_ns)
        try:
            _ip("link", "add", h.encoder_dev, "type", "veth", "peer", "name", h.consumer_dev)
        except OSError as exc:
            pytest.skip(f"cannot create a veth pair: {exc}")
        # Moving each end into its namespace removes it from this one; deleting a
        # namespace deletes its end and so the pair.
        ends = ((h.encoder_ns, h.encoder_dev, ENCODER_ADDR), (h.consumer_ns, h.consumer_dev, CONSUMER_ADDR))
        for ns, dev, addr in ends:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        yield h
    finally:
        for ns in created:
            try:
                _ip("netns", "del", ns)
            except OSError:
                pass


def _start_encoder(h: Hosts, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    ready, log_path = tmp / "encoder.ready.json", tmp / "encoder.log"
    cmd = ["ip", "netns", "exec", h.encoder_ns, sys.executable, "-m", "common.cli", "encoder",
           "--host", ENCODER_ADDR, "--port", "0", "--metrics-port", "-1", "--ready-file", str(ready),
           "--transport", "nixl", "--encoder-backend", "eager", "--cache-blocks", "40",
           "--block-size", str(BLOCK_SIZE)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=h.env(h.encoder_dev),
                                cwd=Path(__file__).resolve().parents[2])
    # `ip netns exec` execs the encoder: the pid is the encoder's.
    info = wait_ready(f"encoder in {h.encoder_ns}", proc, log_path,
                      lambda: json.loads(ready.read_text()) if ready.exists() else None, limit_s=READY_LIMIT_S)
    return proc, int(info["port"])


def _consumer(h: Hosts, tmp: Path, target: str, name: str, *args: str) -> dict:  # type: ignore[type-arg]
    cmd = ["ip", "netns", "exec", h.consumer_ns, sys.executable, "-m", "tests.support.pull_client",
           "--encoder", target, "--transport", "nixl", "--consumer-id", name,
           "--out", str(tmp / f"{name}.pt"), *args]
    proc = subprocess.run(cmd, capture_output=True, timeout=CLIENT_TIMEOUT_S, env=h.env(h.consumer_dev),
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return last_json_object(proc.stdout)  # type: ignore[no-any-return]


def test_nixl_read_crosses_the_veth_between_two_namespaces(hosts: Hosts, tmp_path: Path) -> None:
    images = [image_bytes(448, 448, seed=40 + i) for i in range(3)]  # 196 merged tokens: 4 blocks each
    paths = []
    for i, data in enumerate(images):
        (tmp_path / f"img{i}.png").write_bytes(data)
        paths.append(str(tmp_path / f"img{i}.png"))
    enc, port = _start_encoder(hosts, tmp_path)
    target = f"{ENCODER_ADDR}:{port}"
    try:
        first = _consumer(hosts, tmp_path, target, "encode", *[a for p in paths for a in ("--image", p)])
        assert [i["source"] for i in first["items"]] == ["miss"] * 3
        hashes = [i["mm_hash"] for i in first["items"]]

        # A second consumer knows only the hashes: its gRPC is a handshake and one small Lookup
        # per item, so what arrives on its veth is essentially the NIXL READs.
        rx_before = hosts.rx_bytes()
        second = _consumer(hosts, tmp_path, target, "lookup", *[a for h in hashes for a in ("--lookup", h)])
        rx_grew = hosts.rx_bytes() - rx_before
        assert [i["source"] for i in second["items"]] == ["hit"] * 3
        pulled = int(second["pull_bytes"])
        assert pulled == 3 * 4 * BLOCK_SIZE * 192 * 2
        assert rx_grew >= pulled, f"the veth received {rx_grew} bytes, the pull was {pulled}"

        got = torch.load(tmp_path / "lookup.pt")
        for h, data in zip(hashes, images, strict=True):
            ref = REF.image(data)
            assert ref.shape[0] == 196 and matches(got[h], ref), h
        assert not matches(got[hashes[0]], REF.image(images[1]))
    finally:
        enc.terminate()
        try:
            code = enc.wait(30)
        except subprocess.TimeoutExpired:
            enc.kill()
            code = enc.wait(10)
    assert code == 0, (tmp_path / "encoder.log").read_text()
