"""A producer in its own process for the transport contract tests, and the data it holds.

:class:`ProducerProcess` starts ``python -m tests.transport.producer_helper``
and talks to it over stdin/stdout lines prefixed ``EPD``: the helper prints
its handshake (a serialized ``HandshakeResponse``) and then fills blocks,
stamps tags and drains notifications on command. Block contents are a pure
function of ``(seed, block)`` (:func:`reference_block`), so the test process
checks what it read without the producer's memory.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.transport import ProducerTransport
from common.wire import pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
# Far from the heap (just above the executable) and from the mmap area (below
# the stack) on x86-64 and aarch64 Linux: free in a fresh Python process.
FIXED_ADDRESS = 0x3F00_0000_0000
PREFIX = "EPD "


@dataclass(frozen=True, slots=True)
class HelperLayout:
    num_blocks: int = 33
    block_size: int = 16
    fat_dim: int = 128

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.fat_dim * 2  # bf16

    def to_proto(self) -> pb2.CacheLayout:
        return pb2.CacheLayout(
            num_blocks=self.num_blocks, block_size=self.block_size, fat_dim=self.fat_dim,
            dtype=pb2.D_TYPE_BFLOAT16, scratch_block_id=self.num_blocks - 1,
            bytes_per_block=self.bytes_per_block, out_hidden_size=self.fat_dim, num_deepstack_levels=0,
        )


def reference_block(seed: int, block: int, layout: HelperLayout) -> torch.Tensor:
    """Contents of ``block`` after ``fill(seed)``: the same in every process."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + block)
    return torch.randn((layout.block_size, layout.fat_dim), generator=generator).to(torch.bfloat16)


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class ProducerProcess:
    """A producer helper process; every wait on it has a deadline."""

    def __init__(
        self,
        kind: str,
        *,
        seed: int = 1,
        layout: HelperLayout = HelperLayout(),
        address: int | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.kind = kind
        self.seed = seed
        self.layout = layout
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the process
        cmd = [sys.executable, "-m", "tests.transport.producer_helper", "--kind", kind, "--seed", str(seed),
               "--num-blocks", str(layout.num_blocks), "--block-size", str(layout.block_size),
               "--fat-dim", str(layout.fat_dim)]
        if address is not None:
            cmd += ["--address", hex(address)]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str] = queue.Queue()
        self._start_timeout_s = start_timeout_s
        self._handshake: pb2.HandshakeResponse | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def handshake(self) -> pb2.HandshakeResponse:
        """The helper's handshake, waiting for it to start (the process starts in the background)."""
        if self._handshake is None:
            ready = self._reply(self._start_timeout_s)
            if not ready.startswith("READY "):
                raise RuntimeError(f"producer helper said {ready!r}; log:\n{self.log()}")
            self._handshake = pb2.HandshakeResponse.FromString(bytes.fromhex(ready.split()[1]))
        return self._handshake

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line[len(PREFIX):].strip())

    def _reply(self, timeout_s: float) -> str:
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"producer helper {self.pid} silent for {timeout_s} s; log:\n{self.log()}") from None

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-4000:]

    def command(self, line: str, timeout_s: float = 10.0) -> str:
        assert self.proc.stdin is not None
        self.handshake  # noqa: B018 - replies come only after READY
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout_s)
        if reply.startswith("ERROR"):
            raise RuntimeError(f"producer helper: {reply}")
        return reply

    def fill(self, seed: int) -> None:
        self.command(f"fill {seed}")
        self.seed = seed

    def stamp(self, block: int, tag: int, generation: int) -> None:
        self.command(f"stamp {block} {tag} {generation}")

    def drain(self, expect: int, timeout_s: float = 5.0) -> list[bytes]:
        """Notifications received so far, waiting up to ``timeout_s`` for ``expect`` of them."""
        reply = self.command(f"drain {expect} {int(timeout_s * 1000)}", timeout_s=timeout_s + 10)
        payload = reply.split(maxsplit=1)[1] if " " in reply else ""
        return [bytes.fromhex(h) for h in payload.split(",") if h]

    def reference(self, block: int) -> torch.Tensor:
        return reference_block(self.seed, block, self.layout)

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP, and wait until the kernel shows the process stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while process_state(self.pid) not in ("T", "t"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"producer {self.pid} did not stop")
            time.sleep(0.005)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdin is not None:
            self.proc.stdin.close()


@dataclass(slots=True)
class LocalProducer:
    """A producer in the test process itself (for checks that need no second process)."""

    transport: ProducerTransport
    buffer: torch.Tensor
    tags: torch.Tensor
    generations: torch.Tensor
    layout: HelperLayout
    handshake: pb2.HandshakeResponse

    def close(self) -> None:
        self.transport.close()


def local_producer(kind: str, seed: int, layout: HelperLayout = HelperLayout(num_blocks=9), **options: object
                   ) -> LocalProducer:
    transport = ProducerTransport(kind, name_prefix="local-producer", agent_options=options)
    alloc = transport.allocator or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    n = layout.num_blocks
    buffer = alloc((n, layout.block_size, layout.fat_dim), torch.bfloat16)
    stamps = alloc((n, 2), torch.int64)
    tags, gens = stamps[:, 0], stamps[:, 1]
    for block in range(n):
        buffer[block].copy_(reference_block(seed, block, layout))
        tags[block] = seed * 1000 + block
        gens[block] = seed
    transport.register(buffer, stamps)
    hs = pb2.HandshakeResponse(incarnation_id=transport.incarnation_id, layout=layout.to_proto())
    transport.fill_handshake(hs)
    return LocalProducer(transport, buffer, tags, gens, layout, hs)
