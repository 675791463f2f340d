"""Node-level recovery (issue 6) and user-defined node + estimator (docs/extending.md).

Three tiny runs with the same seed: A never fails; B fails once in iteration 2 after rollout and
reward (the Prefect retry re-runs only the failed node); C fails past its retries, then
`train(resume=...)` continues. Completed nodes never re-run (execution log), and B's and C's final
weights equal A's.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.conftest import tiny_overrides
from workers.checkpoint import checkpoint_name

pytestmark = pytest.mark.integration

FAULTS = {"trainer.dataflow": "tests.integration.fault_plugins:build_dataflow",
          "trainer.plugins": "[tests.integration.fault_plugins]"}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    folder = run_dir / "checkpoints" / checkpoint_name(2) / "policy"
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _counts(run_dir: Path, iteration: int) -> Counter:
    from tasks.common import read_execution_log

    return Counter(e["node"] for e in read_execution_log(str(run_dir)) if e["iteration"] == iteration)


def _run(tmp_path, arith_files, run_id, fail_plan=None, **extra):
    from flows.train import train

    train_file, val_file = arith_files
    root = tmp_path / "runs"
    run_dir = root / run_id
    ov = tiny_overrides(str(root), train_file, val_file, **{"trainer.run_id": run_id, **FAULTS, **extra})
    if fail_plan:
        run_dir.mkdir(parents=True)
        (run_dir / "fail_plan.json").write_text(json.dumps(fail_plan))
    return ov, run_dir, train


def test_node_level_recovery_retry_and_resume(prefect_api, ray_cluster, arith_files, tmp_path):
    ov, run_a, train = _run(tmp_path, arith_files, "A")
    train(overrides=ov)
    ref = _weights(run_a)

    # B: one failure after rollout and reward of iteration 2 → Prefect retries only the gate node
    ov, run_b, _ = _run(tmp_path, arith_files, "B", fail_plan={"iteration": 2, "failures": 1})
    train(overrides=ov)
    c = _counts(run_b, 2)
    assert (c["rollout"], c["reward"], c["gate"], c["advantage"], c["update_policy"]) == (1, 1, 2, 1, 1)
    for k, v in _weights(run_b).items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)

    # C: the gate fails past its retry → the run fails; a new flow run with resume skips what completed
    ov, run_c, _ = _run(tmp_path, arith_files, "C", fail_plan={"iteration": 2, "failures": 2})
    with pytest.raises(Exception, match="injected failure"):
        train(overrides=ov)
    assert _counts(run_c, 2)["rollout"] == 1 and not (run_c / "checkpoints" / checkpoint_name(2)).exists()
    train(overrides=ov, resume=str(run_c))
    c = _counts(run_c, 2)
    assert (c["rollout"], c["reward"], c["gate"], c["advantage"], c["update_policy"]) == (1, 1, 3, 1, 1)
    assert _counts(run_c, 1)["rollout"] == 1  # iteration 1 was checkpointed: not re-run
    for k, v in _weights(run_c).items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)


def test_user_node_and_estimator_run(prefect_api, ray_cluster, arith_files, tmp_path):
    ov, run_dir, train = _run(
        tmp_path, arith_files, "U",
        **{"trainer.dataflow": "tests.integration.user_plugins:build_dataflow",
           "trainer.plugins": "[tests.integration.user_plugins]",
           "algorithm.adv_estimator": "grpo_median", "trainer.total_iterations": "1"},
    )
    summary = train(overrides=ov)
    assert summary["iterations"] == 1
    assert _counts(run_dir, 1)["keep_informative_groups"] == 1
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["metrics"]
    assert "keep_informative_groups/kept" in metrics
