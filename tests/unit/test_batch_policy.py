"""When the encoder batches concurrent misses (``encoder_server.batcher``): the run-cost line it
fits to its own runs, and which queued jobs join the next run under it."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import pytest

from common import metrics as m
from encoder_server.batcher import BATCH_DELAY_FLOOR_S, RunCosts, next_batch


def _costs(fixed: float, per_token: float, sizes: tuple[int, ...] = (64, 128, 192, 64, 256)) -> RunCosts:
    costs = RunCosts()
    for n in sizes:
        costs.add(n, fixed + per_token * n)
    return costs


def _jobs(*tokens: int) -> collections.deque[Any]:
    return collections.deque(SimpleNamespace(item=SimpleNamespace(num_tokens=n), name=i) for i, n in enumerate(tokens))


def _next(pending: collections.deque[Any], batch_tokens: int, costs: RunCosts) -> list[int]:
    """The names of the next run's jobs, ``pending``'s tokens counted as the batcher counts them."""
    batch, tokens = next_batch(pending, sum(job.item.num_tokens for job in pending), batch_tokens, costs)
    assert tokens == sum(job.item.num_tokens for job in batch)
    return [job.name for job in batch]


def test_the_fitted_line_is_the_runs_own_and_unknown_with_one_size() -> None:
    fit = _costs(0.012, 0.0003).fit()
    assert fit is not None and fit[0] == pytest.approx(0.012) and fit[1] == pytest.approx(0.0003)
    assert _costs(0.012, 0.0003, sizes=(64, 64, 64)).fit() is None
    assert RunCosts().fit() is None
    learning = _costs(0.012, 0.0003, sizes=(64, 64))
    assert learning.fit() is None
    learning.add(128, 0.012 + 0.0003 * 128)  # a run of another size: the fit follows it
    got_now = learning.fit()
    assert got_now is not None and got_now[1] == pytest.approx(0.0003)
    window = RunCosts(history=3)
    for n, t in ((64, 9.0), (128, 9.0), (64, 1.0), (128, 2.0), (192, 3.0)):  # the first two forgotten
        window.add(n, t)
    got = window.fit()
    assert got is not None and got[0] == pytest.approx(0.0) and got[1] == pytest.approx(1 / 64)


def test_the_fitted_line_is_on_metrics_once_known() -> None:
    metrics = m.EncoderMetrics()
    costs = RunCosts()

    def shown() -> tuple[float | None, float | None]:
        return (metrics.registry.get_sample_value(m.EPD_RUN_FIXED),
                metrics.registry.get_sample_value(m.EPD_RUN_PER_TOKEN))

    costs.add(64, 1.5)
    costs.publish(metrics)
    assert shown() == (0.0, 0.0)  # one size: unknown
    costs.add(128, 2.9)
    costs.publish(metrics)
    fixed, per_token = shown()
    assert fixed == pytest.approx(0.1) and per_token == pytest.approx(1.4 / 64)


def test_an_item_joins_a_run_only_when_its_cost_is_below_what_a_run_of_its_own_costs() -> None:
    # A CPU tower of real size: 22 ms a token, 20 ms a run (the 2B-width tower: 1.4 s a 64-token image).
    assert not _costs(0.020, 0.022).worth_joining(64)
    # A GPU: the launch dominates.
    assert _costs(0.008, 0.00001).worth_joining(64)
    # Runs too short to weigh (the floor), and runs not measured yet: join.
    assert _costs(0.0, BATCH_DELAY_FLOOR_S / 128).worth_joining(64)
    assert RunCosts().worth_joining(64)
    # Either side of the boundary: an item costing just under a run's fixed cost joins, just over does not.
    assert _costs(0.64, 0.01).worth_joining(63) and not _costs(0.64, 0.01).worth_joining(65)


def test_a_queue_within_one_run_goes_one_item_a_run_where_batching_does_not_pay() -> None:
    cpu = _costs(0.020, 0.022)
    pending = _jobs(64, 64, 64)
    runs = [_next(pending, 256, cpu) for _ in range(3)]
    assert runs == [[0], [1], [2]] and not pending


def test_a_queue_past_one_run_fills_runs_whatever_the_costs() -> None:
    cpu = _costs(0.020, 0.022)
    pending = _jobs(64, 64, 64, 64, 64)  # 320 tokens wait, a run holds 256
    assert _next(pending, 256, cpu) == [0, 1, 2, 3]
    assert _next(pending, 256, cpu) == [4]


def test_where_batching_pays_runs_fill_up_to_the_budget_in_order() -> None:
    gpu = _costs(0.008, 0.00001)
    pending = _jobs(100, 100, 40, 100)
    assert _next(pending, 256, gpu) == [0, 1, 2]  # the fourth would overflow
    pending = _jobs(300, 10)  # an item above the budget runs alone
    assert _next(pending, 256, gpu) == [0]
