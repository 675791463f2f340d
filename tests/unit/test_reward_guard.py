"""The train flow's stop for a reward that fails on every row (flows.train._RewardGuard): counts
iterations in a row, resets on an iteration with any scored row, names the function and error."""

from __future__ import annotations

import logging

import pytest

import flows.train as T
from flows.iteration import IterationResult
from hybridflow.batch import Batch, BatchRef
from tasks.types import NodeResult
from tests.unit._worker_helpers import tiny_cfg


def _out(failed: float, rows: int = 4) -> IterationResult:
    metrics = {"reward/errors": failed, "reward/nan": 0.0, "reward/timeouts": 0.0, "reward/crashes": 0.0}
    ref = BatchRef("r", 1, "reward", "/nowhere/reward", rows, ("uid",), "0" * 64)
    return IterationResult(results={"reward": NodeResult(node="reward", ref=ref)}, metrics=metrics)


def test_stops_after_max_failure_iterations_in_a_row(monkeypatch):
    monkeypatch.setattr(T, "get_run_logger", lambda: logging.getLogger("test"))
    errors = [None, "error: raised KeyError: 'x' at r.py:2", None, "error: raised ValueError: boom at r.py:4"]
    batch = Batch.from_dict({}, {"reward_error": errors})
    monkeypatch.setattr("tasks.common.load_node_output", lambda result: batch)
    guard = T._RewardGuard(tiny_cfg("reward.function=r.py:f", "reward.max_failure_iterations=2"))
    guard.check(_out(4.0), 1)  # every row failed: 1 in a row
    guard.check(_out(3.0), 2)  # one row scored: the count starts again
    assert guard.in_a_row == 0
    guard.check(_out(4.0), 3)
    with pytest.raises(T.TrainingStopped) as e:
        guard.check(_out(4.0), 4)
    assert str(e.value) == (
        "reward.function=r.py:f failed on every row for 2 iterations in a row (reward.max_failure_iterations=2); "
        "stopping at iteration 4. Last error: error: raised ValueError: boom at r.py:4"
    )


def test_rule_rewards_are_named_too(monkeypatch):
    monkeypatch.setattr(T, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr("tasks.common.load_node_output", lambda result: Batch.from_dict({}, {"reward_error": ["x"]}))
    guard = T._RewardGuard(tiny_cfg("reward.max_failure_iterations=1"))
    with pytest.raises(T.TrainingStopped, match=r"^the rule rewards failed on every row for 1 iterations"):
        guard.check(_out(4.0), 1)


def test_prefect_logs_a_stop_without_its_traceback():
    T._quiet_stops()
    try:
        raise T.TrainingStopped("stop")
    except T.TrainingStopped:
        import sys

        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, "f", 1, "failed", None, sys.exc_info())
    assert logging.getLogger("prefect.flow_runs").filter(record)
    assert record.exc_info is None
