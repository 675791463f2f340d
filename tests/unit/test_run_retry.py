"""A retried Prefect flow run reopens its own run directory (flows/run_state.py: open_run).

A deployment's train flow run that is retried (Prefect UI "Retry", or its state set back to
Scheduled through the API) calls ``train`` again with the same parameters, so the same
``trainer.run_id``. The run.json written by the first attempt records the flow run id; the
same id resumes the directory, any other id (or none) is refused.
"""

from __future__ import annotations

import json

import pytest

from flows.run_state import open_run
from hybridflow.config import load_config
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith
from workers.checkpoint import begin_save, commit_save


@pytest.fixture
def cfg(tmp_path):
    train = tmp_path / "train.jsonl"
    write_rows(make_arith(6, difficulty=0, seed=3), str(train))
    return load_config(None, [
        "model.path=tiny", f"data.train_files=[{train}]", "data.prompts_per_iteration=2",
        "rollout.samples_per_prompt=2", "actor.mini_batch_trajectories=4", "actor.micro_batch_trajectories=2",
        f"trainer.run_dir={tmp_path / 'runs'}", "trainer.run_id=r", "trainer.total_iterations=3",
    ])


def _first_attempt(cfg, flow_run_id: str):
    """What the first attempt leaves: run.json bound to the flow run, iteration 1 checkpointed."""
    state = open_run(cfg, resume=None, flow_run_id=flow_run_id)
    state.bind(prefect_flow_run_id=flow_run_id, mlflow_run_id="m1")
    state.prompts.take(1)
    state.trainer.policy_version = 1
    root = f"{state.run_dir}/checkpoints"
    begin_save(root, 1)
    commit_save(root, 1, state.trainer_state(1).to_dict())
    return state


def test_same_flow_run_resumes_its_run_directory(cfg):
    first = _first_attempt(cfg, "flow-run-a")
    again = open_run(cfg, resume=None, flow_run_id="flow-run-a")
    assert again.resumed and again.run_dir == first.run_dir
    # from the checkpoint of iteration 1: the next iteration is 2, one policy update applied
    assert (again.start_iteration, again.trainer.policy_version, again.trainer.mlflow_run_id) == (2, 1, "m1")
    assert again.info["prefect_flow_run_id"] == "flow-run-a"


@pytest.mark.parametrize("other", ["flow-run-b", None])
def test_another_or_no_flow_run_is_refused(cfg, other):
    first = _first_attempt(cfg, "flow-run-a")
    with pytest.raises(FileExistsError, match=f"run directory {first.run_dir} exists"):
        open_run(cfg, resume=None, flow_run_id=other)


def test_run_json_without_a_flow_run_is_refused(cfg, tmp_path):
    """A run started outside Prefect's API (no id recorded) is never taken for a retry."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r"}))
    with pytest.raises(FileExistsError):
        open_run(cfg, resume=None, flow_run_id="flow-run-a")
