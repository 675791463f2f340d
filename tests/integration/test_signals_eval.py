"""SIGTERM and Ctrl-C during a real ``hybridflow eval`` (issue 40: one shutdown path for train, eval,
node run): the signal lands while the policy pool generates for the evaluation
(tests/integration/hold_plugins.py holds that call: ``validate_generate``), and the CLI exits
143 / 130 with one line, no traceback, and nothing it started left running (its own Prefect
server and Ray stopped, the reaper ending the rest)."""

from __future__ import annotations

import signal

import pytest

from tests.integration.conftest import tiny_overrides
from tests.integration.hold_plugins import holds_dir
from tests.integration.test_signals_train import data  # noqa: F401 - fixture
from tests.train_process import (
    _process_tree,
    assert_tree_ends,
    signal_and_expect_one_line,
    start_cli,
    train_env,
    wait_for_file,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_eval_exits_in_one_line_and_leaves_nothing(tmp_path, data, sig):  # noqa: F811
    from hybridflow.models import build_tiny_model, build_tiny_tokenizer, save_hf_checkpoint

    tok = build_tiny_tokenizer()
    model = save_hf_checkpoint(build_tiny_model(len(tok)), tok, tmp_path / "model")
    runs = tmp_path / "runs"
    holds = holds_dir(runs / "evalsig")  # the workers' cfg.trainer.run_dir / run_id
    holds.mkdir(parents=True)
    (holds / "validate_generate").touch()
    overrides = [o for o in tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"))
                 if not o.startswith("model.path=")]
    args = ["eval", "--model", str(model), *overrides, "trainer.run_id=evalsig",
            "trainer.plugins=[tests.integration.hold_plugins]"]
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    env = train_env(drop=("PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"))
    proc = start_cli(args, out, err, env)
    wait_for_file(holds / "validate_generate.held", proc, err, "the evaluation never generated")
    tree = _process_tree(proc.pid)
    stderr = signal_and_expect_one_line(proc, out, err, sig)
    assert_tree_ends(tree, detail=stderr[-3000:])

