"""``epd demo``: run the main job on one machine and prove every merged embedding (demo orchestrator).

Steps: pick the transport (real NIXL when it imports, the mock agent
otherwise; the first output line says which and why); start ``epd encoder``
(eager graphs: compiling every bucket takes minutes on a small CPU box) and,
while it starts, generate the workload and begin the reference encode on a
thread; wait for the encoder's health to report SERVING; start two
``epd prefill`` workers that dump what they merge; follow their output with a
progress bar; scrape every ``/metrics``; stop the processes; verify each
merged item against the reference encode; print the report (``--json``: one
JSON object as the last line).

Exit status: 0 clean, 1 on any mismatch or EC load failure, 2 when a process
failed or timed out, 130 when interrupted. Every process started here is
stopped on every path, Ctrl-C included, and the work directory is removed
unless ``--keep-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from encoder_server.demo import procs
from encoder_server.demo.procs import Child, DemoFailure
from encoder_server.demo.report import Samples, build_report, format_report
from encoder_server.demo.workload import Workload, generate

logger = logging.getLogger(__name__)

EXIT_MISMATCH = 1
EXIT_FAILURE = 2
EXIT_INTERRUPTED = 130
NUM_WORKERS = 2
BLOCK_SIZE = 64
READY_TIMEOUT_S = 120.0
LINGER_S = 900.0  # workers keep /metrics up until scraped and stopped; this only bounds an orphan
_REQUEST_LINE = re.compile(r"^request (\d+): .* items=\[(.*)\]$")


class _Interrupted(BaseException):
    """SIGTERM or SIGHUP: unwind through the cleanup like Ctrl-C does."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epd demo",
        description="Start one encoder and two prefill workers on loopback (real NIXL when installed), run a "
                    "generated multi-turn image/video workload, verify every merged embedding against a local "
                    "reference encode, and print a report.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    p.add_argument("--transport", choices=("auto", "nixl", "mock"), default="auto",
                   help="auto: NIXL when it imports, else the shared-memory mock (default auto)")
    p.add_argument("--users", type=int, default=3, help="users per worker, interleaved (default 3)")
    p.add_argument("--requests-per-user", type=int, default=6,
                   help="requests each user sends; 6 plays the whole script once (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated media (default 0)")
    p.add_argument("--cache-blocks", type=int, default=24,
                   help=f"encoder cache blocks of {BLOCK_SIZE} rows, scratch included; small, so the "
                        "workload evicts (default 24)")
    p.add_argument("--local-cache-blocks", type=int, default=16,
                   help="each worker's cache of pulled items, in blocks (default 16)")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="deadline for the whole workload (default 300)")
    p.add_argument("--keep-dir", action="store_true",
                   help="keep the work directory (media, requests, dumps, logs) and print its path")
    return p


def resolve_transport(choice: str) -> tuple[str, str]:
    """(kind, why) for ``auto`` / ``nixl`` / ``mock``; DemoFailure when ``nixl`` is asked for but absent."""
    from common.transport import nixl_available

    if choice == "mock":
        return "mock", "asked for with --transport mock: POSIX shared memory, one host"
    ok, what = nixl_available()
    if ok:
        return "nixl", f"{what}, UCX on loopback"
    if choice == "nixl":
        raise DemoFailure(f"--transport nixl, but NIXL does not import: {what}")
    return "mock", f"NIXL does not import ({what}); POSIX shared memory instead"


class Progress:
    """A one-line text bar on a stream; on a non-terminal, a line every tenth of the way."""

    def __init__(self, total: int, stream: TextIO, width: int = 30) -> None:
        self.total = max(1, total)
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._last_tenth = -1

    def update(self, done: int, misses: int, hits: int) -> None:
        filled = self.width * done // self.total
        text = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} requests"
                f"  items: {misses} encoded, {hits} reused")
        if self.tty:
            self.stream.write("\r" + text)
        else:
            tenth = 10 * done // self.total
            if tenth == self._last_tenth:
                return
            self._last_tenth = tenth
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _say(started: float, text: str) -> None:
    print(f"epd demo: [{time.monotonic() - started:5.1f} s] {text}", file=sys.stderr, flush=True)


def _spawn_encoder(args: argparse.Namespace, kind: str, root: Path, children: list[Child]) -> Path:
    """Start ``epd encoder``; returns the ready file it will write."""
    ready = root / "encoder.ready.json"
    procs.spawn("encoder", [
        "encoder", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--ready-file", str(ready),
        "--encoder-backend", "eager", "--transport", kind, "--block-size", str(BLOCK_SIZE),
        "--cache-blocks", str(args.cache_blocks), "--drain-grace-s", "3", "--log-level", "INFO",
    ], root / "encoder.log", children)
    return ready


def _wait_encoder(child: Child, ready: Path, kind: str) -> tuple[str, int]:
    """Wait for the ready file, then for health SERVING; (gRPC target, metrics port)."""
    info = procs.wait_ready_file(child, ready, READY_TIMEOUT_S)
    target = f"127.0.0.1:{info['port']}"
    procs.wait_serving(target, READY_TIMEOUT_S)
    if info.get("transport") != kind:
        raise DemoFailure(f"encoder runs transport {info.get('transport')!r}, the demo asked for {kind!r}")
    return target, int(info["metrics_port"])


def _start_workers(
    args: argparse.Namespace, kind: str, target: str, work: Workload, children: list[Child],
    events: queue.Queue[tuple[str, str]],
) -> list[tuple[Child, Path, Path]]:
    """Start every worker; returns (child, ready file, dump dir) each."""
    started = []
    for w in range(NUM_WORKERS):
        ready, dump = work.root / f"worker{w}.ready.json", work.root / f"dump{w}"
        child = procs.spawn(f"worker{w}", [
            "prefill", "--encoder", target, "--transport", kind, "--metrics-port", "0",
            "--requests", str(work.request_file(w)), "--ready-file", str(ready), "--linger-s", str(LINGER_S),
            "--dump-dir", str(dump), "--consumer-id", f"demo-worker-{w}",
            "--local-cache-blocks", str(args.local_cache_blocks),
        ], work.root / f"worker{w}.log", children, capture_stdout=True)
        procs.follow_lines(child, events)
        started.append((child, ready, dump))
    return started


def _follow(
    workers: list[tuple[Child, Path, Path]], work: Workload, events: queue.Queue[tuple[str, str]],
    timeout_s: float, progress: Progress,
) -> None:
    """Consume request lines until every worker has answered every request."""
    expected = {child.name: len(work.streams[w]) for w, (child, _, _) in enumerate(workers)}
    done = {name: 0 for name in expected}
    counts = {"miss": 0, "hit": 0}
    deadline = time.monotonic() + timeout_s
    progress.update(0, 0, 0)
    while any(done[n] < expected[n] for n in expected):
        if time.monotonic() > deadline:
            raise DemoFailure(f"workload not done within {timeout_s:.0f} s: {done} of {expected} requests")
        try:
            name, line = events.get(timeout=0.2)
        except queue.Empty:
            for child, _, _ in workers:
                if not child.running() and done[child.name] < expected[child.name]:
                    # The reader thread may still hold lines it read before the exit.
                    if child.reader is not None and child.reader.is_alive():
                        continue
                    if events.empty():
                        raise DemoFailure(
                            f"{child.name} exited with status {child.proc.returncode} after "
                            f"{done[child.name]} of {expected[child.name]} requests:\n{child.log_tail()}") from None
            continue
        match = _REQUEST_LINE.match(line)
        if match is None:
            continue
        done[name] += 1
        for item in match.group(2).split():
            counts["miss" if item.endswith(":encoder-miss") else "hit"] += 1
        progress.update(sum(done.values()), counts["miss"], counts["hit"])
    progress.close()


def _run(args: argparse.Namespace, kind: str, why: str, root: Path, children: list[Child],
         started: float) -> int:
    from encoder_server.demo.verify import ReferenceJob, Verification, read_records, verify_stream

    # The encoder starts first: its imports and warm-up overlap generating the
    # workload and the reference encode, which run here meanwhile.
    encoder_ready = _spawn_encoder(args, kind, root, children)
    work = generate(root, workers=NUM_WORKERS, users=args.users, requests_per_user=args.requests_per_user,
                    seed=args.seed)
    num_images = sum(1 for m in work.media.values() if m.kind == "image")
    _say(started, f"workload: {num_images} images and {len(work.media) - num_images} video in {root}; "
         f"{NUM_WORKERS} workers x {args.users} users x {args.requests_per_user} requests")

    references = ReferenceJob(work.media)
    references.start()

    target, encoder_metrics_port = _wait_encoder(children[0], encoder_ready, kind)
    _say(started, f"encoder {target} SERVING (transport {kind}, eager graphs, "
                  f"{args.cache_blocks} blocks of {BLOCK_SIZE} rows)")
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    workers = _start_workers(args, kind, target, work, children, events)
    worker_ports = [int(procs.wait_ready_file(c, ready, READY_TIMEOUT_S)["metrics_port"]) for c, ready, _ in workers]
    _say(started, f"{NUM_WORKERS} prefill workers started; {work.num_requests} requests")
    _follow(workers, work, events, args.timeout_s, Progress(work.num_requests, sys.stderr))

    encoder_text = procs.scrape(encoder_metrics_port)
    worker_texts = [procs.scrape(port) for port in worker_ports]
    exit_codes = procs.stop_all(children)
    bad = {name: code for name, code in exit_codes.items() if code != 0}
    if bad:
        raise DemoFailure(f"processes did not exit cleanly: {bad}")

    refs = references.result(READY_TIMEOUT_S)
    verification = Verification()
    records = []
    for w, (child, _, dump) in enumerate(workers):
        verify_stream(verification, child.name, work.streams[w], dump, refs)
        records.append(read_records(dump))

    report = build_report(
        transport=kind, transport_detail=why, encoder_metrics=Samples.parse(encoder_text),
        worker_metrics=Samples.parse(*worker_texts), records=records, verification=verification.as_dict(),
        block_size=BLOCK_SIZE, cache_blocks=args.cache_blocks,
        workload={"workers": NUM_WORKERS, "users_per_worker": args.users,
                  "requests_per_user": args.requests_per_user, "images": num_images,
                  "videos": len(work.media) - num_images, "seed": args.seed, "encoder_backend": "eager"},
        elapsed_s=time.monotonic() - started)
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return EXIT_MISMATCH if report["mismatches"] or report["load_failures"] else 0


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("users", "requests_per_user", "cache_blocks", "local_cache_blocks"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.timeout_s > 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    # The children log to files; here only the report and the progress bar speak.
    logging.getLogger().setLevel(logging.WARNING)
    started = time.monotonic()
    try:
        kind, why = resolve_transport(args.transport)
    except DemoFailure as exc:
        print(f"epd demo: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"epd demo: transport {kind} ({why})", flush=True)

    def interrupted(signum: int, frame: object) -> None:
        raise _Interrupted(signum)

    # Handlers can only be set from the main thread (the command always runs there).
    main_thread = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)} if main_thread else {}
    root = Path(tempfile.mkdtemp(prefix="epd-demo-"))
    children: list[Child] = []
    try:
        return _run(args, kind, why, root, children, started)
    except (KeyboardInterrupt, _Interrupted):
        print(f"\nepd demo: interrupted; stopping {sum(c.running() for c in children)} processes",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except (DemoFailure, OSError, ValueError) as exc:
        print(f"\nepd demo: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            procs.stop_all(children)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            if main_thread:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            if args.keep_dir:
                print(f"epd demo: work directory kept: {root}", file=sys.stderr, flush=True)
            else:
                shutil.rmtree(root, ignore_errors=True)
