"""SIGTERM during ``hybridflow node run`` (issue 40: one shutdown path for train, eval, node run and
bench): the node re-runs iteration 1's ``reward`` of a finished tiny run with a reward function
that announces itself and then sleeps (the call is in flight in the reward worker), and the CLI
exits 143 with one line, no traceback, and nothing it started left running."""

from __future__ import annotations

import signal

import pytest

from tests.integration.test_signals_train import _args, _train, data  # noqa: F401 - fixture
from tests.train_process import (
    _process_tree,
    assert_tree_ends,
    signal_and_expect_one_line,
    start_cli,
    train_env,
    wait_for_file,
    wait_train,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

SLEEPY_REWARD = '''
import pathlib, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pathlib.Path(__file__).with_name("called").touch()
    time.sleep(120)
    return 0.0
'''


def test_sigterm_mid_node_run_exits_143_in_one_line_and_leaves_nothing(tmp_path, data):  # noqa: F811
    runs = tmp_path / "runs"
    run = runs / "noderun"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    code = wait_train(_train([*_args(runs, data, "noderun"), "trainer.total_iterations=1"], out, err), err)
    assert code == 0, err.read_text(errors="replace")[-3000:]
    reward = tmp_path / "sleepy_reward.py"
    reward.write_text(SLEEPY_REWARD)
    env = train_env(drop=("PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"))
    proc = start_cli(["node", "run", "reward", "--run", str(run), "--iteration", "1",
                      f"reward.function={reward}:compute_score"], out, err, env)
    wait_for_file(tmp_path / "called", proc, err, "the reward function was never called", timeout_s=300)
    tree = _process_tree(proc.pid)
    signal_and_expect_one_line(proc, out, err, signal.SIGTERM)
    assert_tree_ends(tree)
