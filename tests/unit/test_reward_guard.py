"""The train flow's stop for a reward that fails on every row (flows.train._RewardGuard): counts
iterations in a row from the reward node's RewardResult (failed_rows, last_error), resets on an
iteration with any scored row, names the function and error; the reward/* metric names decide nothing."""

from __future__ import annotations

import logging

import pytest

import flows.train as T
from flows.iteration import IterationResult
from hybridflow.batch import Batch, BatchRef
from tasks.reward import reward_result
from tasks.types import NodeResult, RewardResult
from tests.unit._worker_helpers import tiny_cfg


def _out(failed: int, rows: int = 4, last_error: str | None = None) -> IterationResult:
    ref = BatchRef("r", 1, "reward", "/nowhere/reward", rows, ("uid",), "0" * 64)
    result = RewardResult(node="reward", ref=ref, failed_rows=failed, last_error=last_error)
    return IterationResult(results={"reward": result}, metrics={"reward/errors": 0.0})


def test_stops_after_max_failure_iterations_in_a_row(monkeypatch):
    monkeypatch.setattr(T, "get_run_logger", lambda: logging.getLogger("test"))
    guard = T._RewardGuard(tiny_cfg("reward.function=r.py:f", "reward.max_failure_iterations=2"))
    guard.check(_out(4), 1)  # every row failed: 1 in a row
    guard.check(_out(3), 2)  # one row scored: the count starts again
    assert guard.in_a_row == 0
    guard.check(_out(4), 3)
    with pytest.raises(T.TrainingStopped) as e:
        guard.check(_out(4, last_error="error: raised ValueError: boom at r.py:4"), 4)
    assert str(e.value) == (
        "reward.function=r.py:f failed on every row for 2 iterations in a row (reward.max_failure_iterations=2); "
        "stopping at iteration 4. Last error: error: raised ValueError: boom at r.py:4"
    )


def test_rule_rewards_are_named_too(monkeypatch):
    monkeypatch.setattr(T, "get_run_logger", lambda: logging.getLogger("test"))
    guard = T._RewardGuard(tiny_cfg("reward.max_failure_iterations=1"))
    with pytest.raises(T.TrainingStopped, match=r"^the rule rewards failed on every row for 1 iterations.*Last error: x$"):
        guard.check(_out(4, last_error="x"), 1)


def test_failure_metrics_alone_decide_nothing():
    """Metric names are for people: a plain NodeResult with every reward/* failure metric set is not a stop."""
    guard = T._RewardGuard(tiny_cfg("reward.max_failure_iterations=1"))
    ref = BatchRef("r", 1, "reward", "/nowhere/reward", 4, ("uid",), "0" * 64)
    metrics = {"reward/errors": 4.0, "reward/nan": 0.0, "reward/timeouts": 0.0, "reward/crashes": 0.0}
    guard.check(IterationResult(results={"reward": NodeResult(node="reward", ref=ref)}, metrics=metrics), 1)
    assert guard.in_a_row == 0


def test_reward_result_counts_failed_rows_and_keeps_the_last_error():
    failures = [None, "error", None, "timeout"]
    errors = [None, "error: raised KeyError: 'x' at r.py:2", None, "timeout: 5 s"]
    result = reward_result(Batch.from_dict({}, {"reward_failure": failures, "reward_error": errors}))
    assert (result.failed_rows, result.last_error) == (2, "timeout: 5 s")
    assert reward_result(Batch.from_dict({}, {"reward_failure": [None, None], "reward_error": [None, None]})) \
        == RewardResult(node="reward", failed_rows=0, last_error=None)


def test_reward_result_round_trips_through_json():
    result = RewardResult(node="reward", failed_rows=3, last_error="nan: score is NaN", metrics={"reward/nan": 3.0})
    assert NodeResult.of(result.to_json()) == result


def test_prefect_logs_a_stop_without_its_traceback():
    T._quiet_stops()
    try:
        raise T.TrainingStopped("stop")
    except T.TrainingStopped:
        import sys

        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, "f", 1, "failed", None, sys.exc_info())
    assert logging.getLogger("prefect.flow_runs").filter(record)
    assert record.exc_info is None
