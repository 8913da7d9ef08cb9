"""The connector's worker path with its real side channel and fake clients: an item is available
only once every tensor-parallel rank holds it verified; a failure on any rank fails that request
alone and gives its leases back once; the step's metadata holds ids, never rows."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.errors import ECLoadFailure, LoadFailureReason
from common.metrics import PrefillMetrics
from common.wire import pb2
from prefill_client.consumer.client import PulledItem
from prefill_client.handoff import Placement, prefetch_hint, to_params

pytest.importorskip("vllm", reason="the connector module imports vLLM")
zmq = pytest.importorskip("zmq", reason="the connector's channel is ZeroMQ")

from prefill_client.vllm.channel import SchedulerChannel, prefetch_address  # noqa: E402
from prefill_client.vllm.connector import EpdCacheConnectorMetadata  # noqa: E402
from prefill_client.vllm.scheduler import WorkerPulls  # noqa: E402
from prefill_client.vllm.worker import WorkerLoader  # noqa: E402

WIDTH = 48


def _placement(mm_hash: str, rows: int = 4, blocks: int = 2, lease_id: int = 11) -> Placement:
    loc = pb2.ItemLocation(mm_hash=mm_hash, block_ids=list(range(3, 3 + blocks)),
                           tokens_per_block=[rows] + [0] * (blocks - 1), num_tokens=rows,
                           fingerprint=7, generation=9, lease_id=lease_id, grid_thw=[1, 4, 4])
    return Placement(mm_hash, "127.0.0.1:50051", "inc-1", loc, "digest", "proxy-7")


@dataclass
class RankClient:
    """A worker's client: rows for the hashes it knows; ``gate`` holds pulls; ``fail`` raises."""

    rows: dict[str, int]
    gate: threading.Event = field(default_factory=threading.Event)
    fail: Exception | None = None
    width: int = WIDTH
    pulls: list[list[str]] = field(default_factory=list)
    kept: list[bool] = field(default_factory=list)
    pull_timeout_s: float = 2.0

    def pull_placed(self, placements: Sequence[Placement], *, keep_leases: bool = False) -> list[PulledItem]:
        self.pulls.append([p.mm_hash for p in placements])
        self.kept.append(keep_leases)
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return [PulledItem(p.mm_hash, torch.full((self.rows[p.mm_hash], self.width), 1.0), (1, 2, 2), "enc", "hit")
                for p in placements]

    def close(self) -> None:
        pass


@dataclass
class TrackerClient:
    """The scheduler's client: lookups of known hashes; records every lease given back."""

    known: set[str] = field(default_factory=set)
    fail: Exception | None = None  # raised by every lookup instead
    rpc_timeout_s: float = 3.0
    pull_timeout_s: float = 2.0
    metrics: PrefillMetrics = field(default_factory=PrefillMetrics)
    released: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def locate(self, hashes: Sequence[str]) -> list[Placement]:
        if self.fail is not None:
            raise self.fail
        gone = [h for h in hashes if h not in self.known]
        if gone:
            raise ECLoadFailure(LoadFailureReason.EVICTED, gone[0], detail="not on the encoder")
        return [_placement(h) for h in hashes]

    def release_placed(self, placements: Sequence[Placement], *, handshake: bool = False) -> None:
        with self.lock:
            self.released += [p.mm_hash for p in placements]

    def close(self) -> None:
        pass


@dataclass
class Engine:
    side: WorkerPulls
    tracker: TrackerClient
    ranks: list[RankClient]
    loaders: list[WorkerLoader]

    def open_all(self) -> None:
        for r in self.ranks:
            r.gate.set()


def _engine(tmp_path: Path, rows: dict[str, int], ranks: int = 2, landing_blocks: int = 256,
            job_deadline_s: float | None = None, idle_wait_s: float = 0.0, prefetch_blocks: int = 0) -> Engine:
    addr = f"ipc://{tmp_path}/ch"
    tracker = TrackerClient(set(rows))
    side = WorkerPulls(tracker, SchedulerChannel(addr, ranks), landing_blocks,  # type: ignore[arg-type]
                       job_deadline_s, idle_wait_s)
    clients = [RankClient(dict(rows)) for _ in range(ranks)]
    loaders = [WorkerLoader(c, WIDTH, torch.float32, addr, rank, torch.device("cpu"),  # type: ignore[arg-type]
                            prefetch_blocks=prefetch_blocks)
               for rank, c in enumerate(clients)]
    assert _until(lambda: (side.progress(), side.channel.ready)[1]), "workers never joined"
    return Engine(side, tracker, clients, loaders)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.open_all()
        for loader in e.loaders:
            loader.close()
        e.side.close()


def _request(rid: str, items: Sequence[tuple[str, int]], params: dict[str, Any] | None = None) -> Any:
    features, offset = [], 5
    for ident, n in items:
        features.append(SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset, length=n + 2)))
        offset += n + 3
    return SimpleNamespace(request_id=rid, mm_features=features, ec_transfer_params=params,
                           get_num_encoder_embeds=lambda i: items[i][1])


def _until(check: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.005)
    return False


def test_available_only_once_every_rank_holds_the_rows(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4, "b": 6})
    engines.append(e)
    req = _request("r1", [("a", 4), ("b", 6)], to_params([_placement("a", 4), _placement("b", 6)]))
    assert not e.side.ensure(req, 0)
    assert _until(lambda: all(r.pulls for r in e.ranks)), "the order never reached both ranks"
    assert all(r.kept == [True] for r in e.ranks)  # the scheduler gives the leases back, once
    e.ranks[0].gate.set()
    assert _until(lambda: e.loaders[0].landed == 2)
    time.sleep(0.2)
    assert not e.side.ensure(req, 0) and not e.side.has("a"), "available with one rank of two"
    e.ranks[1].gate.set()
    assert _until(lambda: e.side.ensure(req, 0))
    assert e.side.has("a") and e.side.has("b")
    assert _until(lambda: sorted(e.tracker.released) == ["a", "b"])
    for ident in ("a", "b"):
        e.side.allocated(ident)
    orders = e.side.take_step()
    assert orders.place == ["a", "b"]
    for loader in e.loaders:  # each rank puts its own rows into its own encoder cache
        cache: dict[str, torch.Tensor] = {}
        loader.place(orders.place, cache)
        assert cache["a"].shape == (4, WIDTH) and cache["b"].shape == (6, WIDTH)
    e.side.finished(req)
    drops = e.side.take_step().drop
    assert sorted(i for i, _ in drops) == ["a", "b"]
    for loader in e.loaders:
        loader.drop(drops)
        assert loader.landed == 0
    assert e.side.take_unavailable() == set()


def test_an_idle_engine_waits_for_the_pull_and_a_busy_one_does_not(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4, "b": 4, "c": 4}, idle_wait_s=30.0)
    engines.append(e)
    e.open_all()
    # Another request ran in the last step: "not yet" at once, whatever the bound.
    e.side.take_step(["text-1"])
    busy = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    assert not e.side.ensure(busy, 0)
    # It finished: the engine has nothing else to run, so the next ask waits for every rank's rows
    # (the pull above is under way: the wait takes its report).
    e.side.finished(SimpleNamespace(request_id="text-1", mm_features=[], ec_transfer_params=None))
    assert e.side.ensure(busy, 0) and e.side.has("a")
    # A request alone in the last step (its own earlier chunk) does not make the engine busy.
    e.side.take_step(["r2"])
    own = _request("r2", [("b", 4)], to_params([_placement("b", 4, lease_id=12)]))
    assert e.side.ensure(own, 0), "a new pull was not awaited while its own request was the only one running"
    # The wait ends with a failure as soon as a rank reports it.
    e.side.take_step([])  # an empty step: nothing else runs
    e.ranks[1].fail = ECLoadFailure(LoadFailureReason.TAG_MISMATCH, "c", detail="on rank 1 only")
    failing = _request("r3", [("c", 4)], to_params([_placement("c", 4, lease_id=13)]))
    started = time.monotonic()
    assert not e.side.ensure(failing, 0)
    assert time.monotonic() - started < 25.0, "the wait went on after the failure"
    assert e.side.take_unavailable() == {"r3"}


def test_the_idle_wait_ends_at_its_bound(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4}, idle_wait_s=0.05)
    engines.append(e)  # gates closed: the pull cannot end while ensure waits
    req = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    assert not e.side.ensure(req, 0)
    e.side.take_step([])
    assert not e.side.ensure(req, 0)  # the next step waits again, still bounded
    e.open_all()
    assert _until(lambda: e.side.ensure(req, 0))


def test_one_request_a_step_waits_and_none_once_the_step_runs_one(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4, "b": 4}, ranks=1, idle_wait_s=30.0)
    engines.append(e)
    e.open_all()
    first = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    second = _request("r2", [("b", 4)], to_params([_placement("b", 4, lease_id=12)]))
    assert e.side.ensure(first, 0)  # waited: this step runs it
    assert not e.side.ensure(second, 0), "a second request held up a step that runs the first"
    assert _until(lambda: e.loaders[0].landed == 2), "the second request's pull was not ordered"
    e.side.take_step(["r1"])
    assert e.side.ensure(second, 0)  # in hand by now: no wait needed


@pytest.mark.parametrize("reason", [LoadFailureReason.EVICTED, LoadFailureReason.TAG_MISMATCH,
                                    LoadFailureReason.TIMEOUT])
def test_a_failure_on_one_rank_fails_that_request_once(tmp_path: Path, engines: list[Engine],
                                                      reason: LoadFailureReason) -> None:
    e = _engine(tmp_path, {"a": 4, "c": 4})
    engines.append(e)
    e.ranks[1].fail = ECLoadFailure(reason, "a", detail="on rank 1 only")
    req = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    assert not e.side.ensure(req, 0)
    e.open_all()
    assert _until(lambda: "r1" in e.side.take_unavailable())
    assert e.side.take_unavailable() == set()  # reported once
    assert not e.side.ensure(req, 0) and not e.side.has("a")
    assert e.tracker.metrics.load_failures.labels(reason=reason.value)._value.get() == 1
    assert _until(lambda: e.tracker.released == ["a"])
    assert _until(lambda: e.loaders[0].landed == 0), "rank 0 kept rows of a failed pull"
    e.side.finished(req)
    # The next request is served: the engine goes on.
    e.ranks[1].fail = None
    ok = _request("r2", [("c", 4)], to_params([_placement("c", 4)]))
    assert _until(lambda: e.side.ensure(ok, 0))


def test_rows_of_the_wrong_shape_fail_the_request(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 5}, ranks=1)
    engines.append(e)
    req = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    e.open_all()
    assert not e.side.ensure(req, 0)
    assert _until(lambda: "r1" in e.side.take_unavailable())
    assert e.tracker.metrics.load_failures.labels(reason="token_count")._value.get() == 1
    assert e.loaders[0].landed == 0


def test_items_without_a_location_are_looked_up_then_pulled(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4})
    engines.append(e)
    e.open_all()
    req = _request("r1", [("a", 4)])
    assert _until(lambda: e.side.ensure(req, 0))
    gone = _request("r2", [("zz", 4)])
    assert not e.side.ensure(gone, 0)
    assert _until(lambda: "r2" in e.side.take_unavailable())
    assert all(r.pulls == [["a"]] for r in e.ranks)


def test_a_request_that_ends_mid_pull_gives_its_leases_back_and_leaves_no_rows(
        tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4})
    engines.append(e)
    req = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    assert not e.side.ensure(req, 0)
    assert _until(lambda: all(r.pulls for r in e.ranks))
    e.side.finished(req)  # the client went away
    assert _until(lambda: e.tracker.released == ["a"])
    e.open_all()
    time.sleep(0.3)
    assert all(loader.landed == 0 for loader in e.loaders)
    assert not e.side.has("a") and e.tracker.released == ["a"]


def test_an_item_another_request_pulls_is_not_pulled_twice(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4})
    engines.append(e)
    params = to_params([_placement("a", 4)])
    r1, r2 = _request("r1", [("a", 4)], params), _request("r2", [("a", 4)], params)
    assert not e.side.ensure(r1, 0) and not e.side.ensure(r2, 0)
    e.open_all()
    assert _until(lambda: e.side.ensure(r1, 0) and e.side.ensure(r2, 0))
    assert all(r.pulls == [["a"]] for r in e.ranks)
    e.side.finished(r1)
    assert e.side.has("a") and e.side.take_step().drop == []  # r2 still needs the rows
    e.side.finished(r2)
    assert [i for i, _ in e.side.take_step().drop] == ["a"]


def test_a_full_landing_pool_defers_the_next_pull(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4, "b": 4}, landing_blocks=3)
    engines.append(e)
    r1 = _request("r1", [("a", 4)], to_params([_placement("a", 4, blocks=2)]))
    r2 = _request("r2", [("b", 4)], to_params([_placement("b", 4, blocks=2)]))
    assert not e.side.ensure(r1, 0) and not e.side.ensure(r2, 0)
    assert _until(lambda: all(r.pulls == [["a"]] for r in e.ranks))
    time.sleep(0.2)
    assert all(r.pulls == [["a"]] for r in e.ranks), "ordered past the landing pool"
    e.open_all()
    assert _until(lambda: e.side.ensure(r1, 0))
    assert _until(lambda: e.side.ensure(r2, 0))  # deferred, not failed
    assert e.side.take_unavailable() == set()


def test_an_old_drop_never_removes_newer_rows(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4}, ranks=1)
    engines.append(e)
    e.open_all()
    params = to_params([_placement("a", 4)])
    r1 = _request("r1", [("a", 4)], params)
    assert _until(lambda: e.side.ensure(r1, 0))
    e.side.finished(r1)
    stale = e.side.take_step().drop  # not yet delivered: no step ran
    r2 = _request("r2", [("a", 4)], params)
    assert _until(lambda: e.side.ensure(r2, 0))  # pulled again, by a new job
    e.side.allocated("a")
    e.loaders[0].drop(stale)
    cache: dict[str, torch.Tensor] = {}
    e.loaders[0].place(e.side.take_step().place, cache)
    assert "a" in cache


def test_a_rank_that_never_reports_fails_the_request_at_the_deadline(tmp_path: Path,
                                                                     engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4}, job_deadline_s=0.5)
    engines.append(e)
    e.ranks[0].gate.set()  # rank 1 hangs in its pull
    req = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    assert not e.side.ensure(req, 0)
    time.sleep(0.2)
    assert e.side.take_unavailable() == set()
    assert _until(lambda: "r1" in e.side.take_unavailable())
    assert e.tracker.metrics.load_failures.labels(reason="timeout")._value.get() == 1
    assert _until(lambda: e.tracker.released == ["a"])
    assert _until(lambda: e.loaders[0].landed == 0)


def test_workers_that_never_join_fail_requests_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import prefill_client.vllm.scheduler as wp

    monkeypatch.setattr(wp, "WORKER_JOIN_TIMEOUT_S", 0.2)
    side = WorkerPulls(TrackerClient({"a"}), SchedulerChannel(f"ipc://{tmp_path}/ch", 2), 256)  # type: ignore[arg-type]
    try:
        req = _request("r1", [("a", 4)])
        assert not side.ensure(req, 0)
        time.sleep(0.3)
        assert not side.ensure(req, 0)
        assert side.take_unavailable() == {"r1"}
    finally:
        side.close()


def test_the_metadata_of_a_step_that_loads_30_images_is_small(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {f"{i:064x}": 256 for i in range(30)}, landing_blocks=30 * 4)
    engines.append(e)
    e.open_all()
    items = [(f"{i:064x}", 256) for i in range(30)]
    req = _request("r1", items, to_params([_placement(h, n) for h, n in items]))
    assert _until(lambda: e.side.ensure(req, 0))
    for h, _ in items:
        e.side.allocated(h)
    orders = e.side.take_step()
    meta = EpdCacheConnectorMetadata(place=orders.place, drop=orders.drop)
    size = len(pickle.dumps(meta))
    assert len(meta.place) == 30 and not meta.rows
    assert size < 64 * 1024, f"{size} bytes"
    # The scheduler path's metadata for the same step carries every row (here 30 x 256 x WIDTH floats).
    rows = EpdCacheConnectorMetadata(rows={h: torch.zeros(n, WIDTH) for h, n in items})
    assert len(pickle.dumps(rows)) > 30 * 256 * WIDTH * 4
    print(f"metadata of a step placing 30 images: {size} bytes (rows path: {len(pickle.dumps(rows))})")


def test_an_unexpected_error_on_a_rank_fails_the_request_and_is_counted_as_handshake(
        tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4})
    engines.append(e)
    e.ranks[1].fail = RuntimeError("a bug on rank 1")
    req = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    assert not e.side.ensure(req, 0)
    e.open_all()
    assert _until(lambda: "r1" in e.side.take_unavailable())
    assert e.tracker.metrics.load_failures.labels(reason="handshake")._value.get() == 1
    assert _until(lambda: e.tracker.released == ["a"])
    assert _until(lambda: e.loaders[0].landed == 0), "rank 0 kept rows of a failed pull"


def test_an_unexpected_error_of_a_lookup_is_counted_as_handshake(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4})
    engines.append(e)
    e.tracker.fail = RuntimeError("a bug in the lookup")
    assert not e.side.ensure(_request("r1", [("a", 4)]), 0)
    assert _until(lambda: "r1" in e.side.take_unavailable())
    assert e.tracker.metrics.load_failures.labels(reason="handshake")._value.get() == 1
    assert all(r.pulls == [] for r in e.ranks)


def test_a_step_s_orders_place_then_drop_on_each_rank(tmp_path: Path, engines: list[Engine]) -> None:
    from prefill_client.vllm.items import StepOrders

    e = _engine(tmp_path, {"a": 4, "b": 4}, ranks=1)
    engines.append(e)
    e.open_all()
    r1 = _request("r1", [("a", 4)], to_params([_placement("a", 4)]))
    r2 = _request("r2", [("b", 4)], to_params([_placement("b", 4)]))
    assert _until(lambda: e.side.ensure(r1, 0) and e.side.ensure(r2, 0))
    e.side.allocated("a")
    e.side.finished(r2)
    step = e.side.take_step()
    assert step.place == ["a"] and [i for i, _ in step.drop] == ["b"] and step.rows == {}
    cache: dict[str, torch.Tensor] = {}
    e.loaders[0].load(step, cache)
    assert list(cache) == ["a"] and torch.equal(cache["a"], torch.ones(4, WIDTH))
    assert e.loaders[0].landed == 1  # a stays until dropped; b is gone
    e.loaders[0].load(StepOrders(), cache)
    assert e.loaders[0].landed == 1


def test_placements_no_pull_took_go_back_when_their_request_finishes(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4, "b": 4}, ranks=1)
    engines.append(e)
    e.open_all()
    r1 = _request("r1", [("a", 4)], to_params([_placement("a", 4, lease_id=1)]))
    assert _until(lambda: e.side.ensure(r1, 0))
    assert _until(lambda: e.tracker.released == ["a"])  # the pull's lease, given back by its job
    # r2 brings a placement of "a" (in hand for r1 already) and of "b": only b is pulled.
    r2 = _request("r2", [("a", 4), ("b", 4)], to_params([_placement("a", 4, lease_id=2), _placement("b", 4, lease_id=3)]))
    assert _until(lambda: e.side.ensure(r2, 0))
    assert _until(lambda: sorted(e.tracker.released) == ["a", "b"])
    assert [p[0] for r in e.ranks for p in r.pulls] == ["a", "b"]
    e.side.finished(r1)
    time.sleep(0.2)
    assert sorted(e.tracker.released) == ["a", "b"], "a lease its pull gave back went back twice"
    e.side.finished(r2)  # its unused lease of "a" goes back now, not at the encoder's lease ttl
    assert _until(lambda: sorted(e.tracker.released) == ["a", "a", "b"])
    # A later turn whose image vLLM's own caches cover (no placeholder left to compute): nothing is
    # pulled, and its lease goes back when it finishes.
    r3 = _request("r3", [("a", 4)], to_params([_placement("a", 4, lease_id=4)]))
    assert e.side.ensure(r3, 10**6)
    e.side.finished(r3)
    assert _until(lambda: sorted(e.tracker.released) == ["a", "a", "a", "b"])
    assert [p[0] for r in e.ranks for p in r.pulls] == ["a", "b"]


@pytest.mark.parametrize("device, prefault_bytes, maps", [("cpu", 64 << 20, True), ("cpu", 0, False),
                                                         ("meta", 64 << 20, False)])
def test_each_pull_thread_maps_its_share_of_memory_for_rows_on_a_host_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, prefault_bytes: int, maps: bool) -> None:
    import prefill_client.vllm.worker as worker
    from prefill_client.vllm.items import PULL_THREADS

    shares = PULL_THREADS if maps else 0
    mapped: list[tuple[int, int]] = []

    def prefault(nbytes: int) -> bool:
        mapped.append((threading.get_ident(), nbytes))
        return True

    monkeypatch.setattr(worker, "prefault", prefault)
    side = WorkerPulls(TrackerClient(set()), SchedulerChannel(f"ipc://{tmp_path}/ch", 1), 256)  # type: ignore[arg-type]
    loader = WorkerLoader(RankClient({}), WIDTH, torch.float32, f"ipc://{tmp_path}/ch", 0,  # type: ignore[arg-type]
                          torch.device(device), prefault_bytes)
    try:
        assert len(mapped) == shares
        assert len({thread for thread, _ in mapped}) == shares  # one share in each pull thread
        assert all(n == prefault_bytes // PULL_THREADS for _, n in mapped)
    finally:
        loader.close()
        side.close()


def _send_hint(tmp_path: Path, ranks: int, placements: Sequence[Placement]) -> None:
    """What vLLM's API server does with a request's X-Epd-Prefetch: its bytes to every rank."""
    hint = prefetch_hint(placements)
    assert hint is not None
    ctx = zmq.Context()
    try:
        for rank in range(ranks):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(prefetch_address(f"ipc://{tmp_path}/ch", rank))
            sock.send(hint.encode())
            sock.close()
    finally:
        ctx.term()


def test_an_order_takes_the_rows_a_hint_pulled_on_every_rank(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4, "b": 6}, prefetch_blocks=64)
    engines.append(e)
    placed = [_placement("a", 4), _placement("b", 6, lease_id=12)]
    e.open_all()
    _send_hint(tmp_path, 2, placed)
    assert _until(lambda: all(r.pulls == [["a", "b"]] for r in e.ranks)), "a rank never took the hint"
    assert all(r.kept == [True] for r in e.ranks)  # a prefetch never gives a lease back
    req = _request("r1", [("a", 4), ("b", 6)], to_params(placed))
    assert _until(lambda: e.side.ensure(req, 0))
    assert all(r.pulls == [["a", "b"]] for r in e.ranks)  # the order pulled nothing more
    assert e.side.metrics.pulls_prefetched._value.get() == 2
    assert e.side.metrics.pulls._value.get() == 2  # still counted as pulls (over the wire, ahead of time)
    assert _until(lambda: sorted(e.tracker.released) == ["a", "b"])  # the scheduler's job gives them back, once
    for ident in ("a", "b"):
        e.side.allocated(ident)
    for loader in e.loaders:
        cache: dict[str, torch.Tensor] = {}
        loader.place(e.side.take_step().place or ["a", "b"], cache)
        assert cache["a"].shape == (4, WIDTH) and cache["b"].shape == (6, WIDTH)
        assert loader.prefetches is not None and len(loader.prefetches) == 0


def test_a_hint_for_another_lease_or_of_the_wrong_shape_changes_nothing(tmp_path: Path,
                                                                        engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4, "b": 5}, prefetch_blocks=64)
    engines.append(e)
    e.open_all()
    _send_hint(tmp_path, 2, [_placement("a", 4, lease_id=99), _placement("b", 5)])
    assert _until(lambda: all(len(r.pulls) == 1 for r in e.ranks))
    # "a" under the lease the proxy handed on: pulled by the order; "b" prefetched, but the prompt has 6 rows for it
    req = _request("r1", [("a", 4), ("b", 6)], to_params([_placement("a", 4), _placement("b", 5)]))
    assert not e.side.ensure(req, 0)
    assert _until(lambda: req.request_id in e.side.take_unavailable())
    assert all(r.pulls[1:] == [["a"]] for r in e.ranks)
    assert e.side.metrics.load_failures.labels(reason="token_count")._value.get() == 1
    assert not e.side.has("a") and not e.side.has("b")


def test_workers_without_prefetch_take_no_hints(tmp_path: Path, engines: list[Engine]) -> None:
    e = _engine(tmp_path, {"a": 4})
    engines.append(e)
    e.open_all()
    assert all(loader.prefetches is None for loader in e.loaders)
    assert not Path(prefetch_address(f"ipc://{tmp_path}/ch", 0).removeprefix("ipc://")).exists()
