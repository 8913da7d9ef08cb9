"""``epd proxy --workers N``: N proxy processes on one port, and the parent that runs them (proxy's parent process).

The parent binds the port first, with SO_REUSEPORT and without listening, and holds it while
the workers run: ``--port 0`` picks one port for all of them, printed once
(``{"proxy_port": N}``) when every worker listens. Each worker binds the same port with
SO_REUSEPORT and listens on it; the kernel spreads new connections over them. The workers
share nothing else: each has its own encoder clients, backends' state, ``--max-inflight``
count and readiness checks. Their metrics add up in prometheus_client's multiprocess mode:
the parent makes a ``PROMETHEUS_MULTIPROC_DIR`` for them (removed when they are gone), and
each worker's ``/metrics`` serves the sum over all of them.

The parent forwards SIGTERM and SIGINT to the workers and exits once they have exited. A
worker that exits on its own (a crash) stops the others and the parent exits 1: its
supervisor (Kubernetes) restarts the whole, rather than it serving on at a fraction. A worker
whose parent died (SIGKILL) stops by itself.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.queues
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
from types import FrameType

from common.config import ProxyConfig
from prefill_client.proxy.serve import serve

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when a worker imports it
WORKER_START_S = 300.0  # imports, the encoder client: the bound the test harness gives a whole proxy start
WORKER_STOP_MARGIN_S = 15.0  # a stopping worker's time past --drain-grace-s (its clean-up) before SIGKILL
POLL_S = 0.5  # how often the parent looks at its workers while it waits


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, not listening: it holds the port (one
    port for ``port`` 0) for workers that bind it beside it, and takes no connection itself."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _worker(cfg: ProxyConfig, port: int, metrics_dir: str, index: int, log_level: str,
            started: multiprocessing.queues.Queue[int], parent_pid: int) -> None:
    """One worker (a spawned process): the proxy's application on the shared port."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s worker-{index} %(name)s: %(message)s")

    def listening(bound: int) -> None:
        logger.info("epd proxy worker %d of %d listening on http://%s:%d", index + 1, cfg.workers, cfg.host, bound)
        started.put(index)

    serve(cfg, port, listening, reuse_port=True, multiprocess_dir=metrics_dir, parent_pid=parent_pid)


class Supervisor:
    """The parent of ``cfg.workers`` workers: starts them, forwards signals, waits for them."""

    def __init__(self, cfg: ProxyConfig, log_level: str) -> None:
        self.cfg = cfg
        self.log_level = log_level
        self.stopping = False
        self._ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the parent's state
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._terminated: set[int] = set()  # the pids sent SIGTERM

    def run(self) -> int:
        """Serve until a signal, or until a worker fails; the exit status."""
        metrics_dir = tempfile.mkdtemp(prefix="epd-proxy-metrics-")
        os.environ[MULTIPROC_ENV] = metrics_dir  # the workers inherit it
        reserved = reserve_port(self.cfg.host, self.cfg.port)
        port = int(reserved.getsockname()[1])
        started: multiprocessing.queues.Queue[int] = self._ctx.Queue()
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._workers = [
                self._ctx.Process(target=_worker, name=f"epd-proxy-worker-{index}",
                                  args=(self.cfg, port, metrics_dir, index, self.log_level, started, os.getpid()))
                for index in range(self.cfg.workers)]
            for worker in self._workers:
                worker.start()
            if not self._wait_started(started):
                return 0 if self.stopping else 1
            logger.info("epd proxy: %d workers listening on http://%s:%d", self.cfg.workers, self.cfg.host, port)
            print(json.dumps({"proxy_port": port}), flush=True)
            return self._wait_exited()
        finally:
            self._stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            reserved.close()
            os.environ.pop(MULTIPROC_ENV, None)
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        logger.info("epd proxy: %s, stopping %d workers", signal.Signals(signum).name, len(self._workers))
        self.stopping = True
        self._terminate()

    def _terminate(self) -> None:
        """SIGTERM to every worker started and running, once each: a second one would find a worker
        that no longer handles it (shutting down) and kill it."""
        for worker in self._workers:
            if worker.pid is not None and worker.exitcode is None and worker.pid not in self._terminated:
                self._terminated.add(worker.pid)
                try:
                    os.kill(worker.pid, signal.SIGTERM)
                except ProcessLookupError:  # exited meanwhile
                    pass

    def _wait_started(self, started: multiprocessing.queues.Queue[int]) -> bool:
        """Whether every worker listens within :data:`WORKER_START_S` (False: a worker exited, or a signal)."""
        deadline = time.monotonic() + WORKER_START_S
        waiting = len(self._workers)
        while waiting:
            if self.stopping:
                return False
            dead = [w for w in self._workers if w.exitcode is not None]
            if dead:
                logger.error("epd proxy: %s exited with %s before it listened", dead[0].name, dead[0].exitcode)
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("epd proxy: %d of %d workers did not listen within %.0f s", waiting,
                             len(self._workers), WORKER_START_S)
                return False
            try:
                started.get(timeout=min(POLL_S, left))
            except queue.Empty:
                continue
            waiting -= 1
        return True

    def _wait_exited(self) -> int:
        """Wait until every worker has exited: 0 when they were stopped and exited 0, else 1."""
        failed = False
        while any(w.exitcode is None for w in self._workers):
            multiprocessing.connection.wait([w.sentinel for w in self._workers if w.exitcode is None], POLL_S)
            if self.stopping:
                break
            crashed = [w for w in self._workers if w.exitcode is not None]
            if crashed:
                logger.error("epd proxy: %s exited with %s; stopping the others", crashed[0].name,
                             crashed[0].exitcode)
                failed = True
                break
        self._stop()
        # A worker our SIGTERM found before it handled signals (still starting) ended by it: no failure.
        for worker in self._workers:
            if worker.exitcode not in (0, -signal.SIGTERM) and not failed:
                logger.error("epd proxy: %s exited with %s", worker.name, worker.exitcode)
                failed = True
        return 1 if failed else 0

    def _stop(self) -> None:
        """SIGTERM to the workers still running, then wait for them: each drains its requests in flight
        for up to ``--drain-grace-s``; SIGKILL :data:`WORKER_STOP_MARGIN_S` past that."""
        self.stopping = True
        self._terminate()
        limit_s = self.cfg.drain_grace_s + WORKER_STOP_MARGIN_S
        deadline = time.monotonic() + limit_s
        for worker in self._workers:
            if worker.pid is None:
                continue
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.exitcode is None:
                logger.error("epd proxy: %s did not stop within %.0f s; killing it", worker.name, limit_s)
                worker.kill()
                worker.join(POLL_S * 10)
