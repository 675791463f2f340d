"""Asynchronous training end to end on a tiny model (issue 20, docs/async.md): a rollout pool apart
from the trainer, rollouts ahead as Prefect futures, weights published after each update, the
staleness bound, and the fixed schedule that makes runs reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import tiny_overrides

pytestmark = pytest.mark.integration

ROLLOUT_POOL = {"placement.pools.gen.workers": "1", "placement.pools.gen.cpus_per_worker": "0.5",
                "placement.pools.gen.roles": "[rollout]"}


def _overrides(tmp_path, arith_files, run_id: str, **extra: str) -> list[str]:
    train_file, val_file = arith_files
    return tiny_overrides(str(tmp_path / "runs"), train_file, val_file,
                          **{"trainer.run_id": run_id, "actor.old_log_probs": "recompute", **extra})


def _rollouts(run_dir: Path, iterations: int) -> dict[int, list[int]]:
    """Each iteration's trajectories' rollout_version, read from the saved rollout batches."""
    from hybridflow.batch import Batch

    out = {}
    for it in range(1, iterations + 1):
        batch = Batch.load(str(run_dir / f"iter_{it:06d}" / "rollout"))
        out[it] = batch["rollout_version"].tolist()
    return out


def _final_weights(summary: dict) -> dict[str, torch.Tensor]:
    from workers.checkpoint import read_safetensors_folder

    return read_safetensors_folder(Path(summary["checkpoint"]) / "policy")


def test_one_step_off_policy_keeps_the_bound_and_overlaps(prefect_api, ray_cluster, arith_files, tmp_path):
    from flows.train import train
    from tasks.versions import read_ledger

    summary = train(overrides=_overrides(tmp_path, arith_files, "async-1", **ROLLOUT_POOL, **{
        "trainer.max_staleness": "1", "trainer.total_iterations": "4", "trainer.save_every": "2"}))
    run_dir = Path(summary["run_dir"])
    assert summary["iterations"] == 4
    # the schedule: iteration j generates with the weights after iteration j-2's update
    versions = _rollouts(run_dir, 4)
    assert versions == {1: [0] * 4, 2: [0] * 4, 3: [1] * 4, 4: [2] * 4}, versions
    ledger = read_ledger(str(run_dir), "policy")
    assert [(e["version_before"], e["iteration"]) for e in ledger] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    hist = {h["iteration"]: h["metrics"] for h in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    for it, m in hist.items():
        trained_at = ledger[it - 1]["version_before"]
        assert trained_at - min(versions[it]) <= 1  # never older than the bound
        assert m["rollout/staleness/max"] == trained_at - versions[it][0]
        assert m["rollout/dropped_stale"] == 0
        assert m["timing_s/weight_sync"] > 0 and "async/overlap_fraction" in m
    # the checkpoint after iteration 2 recorded the rollout in flight (iteration 3's, weights v1)
    state = json.loads((run_dir / "checkpoints" / "iter_000002" / "trainer_state.json").read_text())
    assert list(state["rollouts"]) == ["3"] and state["rollouts"]["3"]["rollout"]["rollout_version"] == 1

    # the rollouts are task runs of the train flow run itself, beside its iteration subflows
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [summary["prefect_flow_run_id"]]}))
        names = {t.name for t in tasks}
    assert {f"rollout-{it:06d}" for it in range(1, 5)} <= names, sorted(names)


def test_max_staleness_0_on_a_rollout_pool_equals_the_colocated_run(prefect_api, ray_cluster, arith_files, tmp_path):
    from flows.train import train

    colocated = train(overrides=_overrides(tmp_path, arith_files, "sync-colocated"))
    separate = train(overrides=_overrides(tmp_path, arith_files, "sync-separate", **ROLLOUT_POOL))
    a, b = _final_weights(colocated), _final_weights(separate)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _rollouts(Path(separate["run_dir"]), 2) == {1: [0] * 4, 2: [1] * 4}
