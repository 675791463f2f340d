"""End to end on a tiny random model: `train` flow → iteration subflows → node tasks on the Ray
task runner → persistent pools; Prefect server and MLflow SQLite are real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_overrides

pytestmark = pytest.mark.integration


def test_train_two_iterations(prefect_api, ray_cluster, arith_files, tmp_path):
    from flows.train import train
    from tasks.common import read_execution_log

    train_file, val_file = arith_files
    ov = tiny_overrides(str(tmp_path / "runs"), train_file, val_file,
                        **{"trainer.run_id": "tiny-e2e", "trainer.val_every": "2", "trainer.val_before_train": "true"})
    summary = train(overrides=ov)
    run_dir = Path(summary["run_dir"])
    assert summary["iterations"] == 2
    assert Path(summary["checkpoint"]).name == "step_000002"
    nodes = [(e["iteration"], e["node"]) for e in read_execution_log(str(run_dir))]
    for it in (1, 2):
        for node in ("rollout", "reward", "advantage", "update_policy"):
            assert (it, node) in nodes
    assert (0, "validate") in nodes and (2, "validate") in nodes
    hist = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in hist] == [1, 2]
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "timing_s/gen", "timing_s/step"):
        assert key in hist[0]["metrics"], key
    assert summary["val_before"] and summary["val_after"]
