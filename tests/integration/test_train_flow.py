"""End to end on a tiny random model: `train` flow → iteration subflows → node tasks on the Ray
task runner → persistent pools; Prefect server and MLflow SQLite are real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_overrides
from workers.checkpoint import checkpoint_name

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
    assert Path(summary["checkpoint"]).name == checkpoint_name(2)
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

    # every iteration is a subflow of the train flow run, with its node task runs, in the Prefect API
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, TaskRunFilter

    with get_client(sync_client=True) as client:
        train_run = client.read_flow_run(summary["prefect_flow_run_id"])
        assert train_run.state.is_completed()
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[train_run.id]))
        )
        names = sorted(r.name for r in subflows)
        assert names == ["iteration-000001", "iteration-000002"], names
        it1 = next(r for r in subflows if r.name == "iteration-000001")
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [it1.id]}),
                                      task_run_filter=TaskRunFilter())
        task_names = {t.name for t in tasks}
        assert {"rollout-000001", "reward-000001", "advantage-000001", "update_policy-000001"} <= task_names

    # the MLflow run holds verl-named metrics for every iteration
    from mlflow.tracking import MlflowClient

    ml = MlflowClient(f"sqlite:///{tmp_path / 'runs'}/mlflow.db")
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean", "timing_s/step",
                "perf/throughput"):
        steps = sorted(m.step for m in ml.get_metric_history(summary["mlflow_run_id"], key))
        assert steps == [1, 2], (key, steps)
    run = ml.get_run(summary["mlflow_run_id"])
    assert run.data.params["actor.lr"] == "0.001"
    assert run.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
