"""SIGTERM during the start-up of a real ``hybridflow train`` (issue 40: every signal, not only
mid-iteration): once the flow has opened the run (run.json written) and before the first iteration
started, the CLI exits 143 with one line and no traceback, the run lock is released, nothing it
started is left running, and ``--resume`` then finishes the run. Reuses the helpers of
tests/integration/test_signals_train.py."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.integration.test_signals_train import _args, _train, data  # noqa: F401 - fixture
from tests.train_process import _process_tree, assert_tree_ends, signal_and_expect_one_line, wait_train

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def _wait_opened_not_iterating(proc, run: Path, err: Path, timeout_s: float = 300) -> None:
    """Until run.json exists (the flow opened the run) and no node has started (execution_log.jsonl)."""
    deadline = time.monotonic() + timeout_s
    while not (run / "run.json").exists():
        assert proc.poll() is None, err.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the run never opened"
        time.sleep(0.05)
    assert not (run / "execution_log.jsonl").exists(), "an iteration started before the signal"


def test_sigterm_during_start_up_exits_143_in_one_line_leaves_nothing_and_resumes(tmp_path, data):  # noqa: F811
    runs = tmp_path / "runs"
    run = runs / "early"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    args = [*_args(runs, data, "early"), "trainer.total_iterations=2"]
    proc = _train(args, out, err)
    _wait_opened_not_iterating(proc, run, err)
    tree = _process_tree(proc.pid)
    signal_and_expect_one_line(proc, out, err, signal.SIGTERM)
    assert not (run / "run.lock").exists()
    assert_tree_ends(tree)

    code = wait_train(_train(["--resume", str(run)], out, err), err)
    assert code == 0, err.read_text(errors="replace")[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("2")
    assert json.loads((run / "run.json").read_text()).get("stop_reason") in (None, "")
