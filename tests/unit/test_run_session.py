"""flows/run_state.py: a RunSession's trainer state goes into a checkpoint and comes back on a
resume (versions, KL coefficient, NaN-update count, sampler, MLflow run, validations); a
trainer_state.json with a wrong key refuses the resume naming the file and the key."""

from __future__ import annotations

import pytest

from flows.iteration import flow_input_values
from flows.run_lock import held_locks
from flows.run_state import open_run
from flows.trainer_state import TrainerStateError
from hybridflow.config import load_config
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith
from workers.checkpoint import begin_save, checkpoint_name, commit_save


@pytest.fixture
def cfg(tmp_path):
    train = tmp_path / "train.jsonl"
    write_rows(make_arith(6, difficulty=0, seed=3), str(train))
    return load_config(None, [
        "model.path=tiny", f"data.train_files=[{train}]", "data.prompts_per_iteration=2",
        "rollout.samples_per_prompt=2", "actor.mini_batch_trajectories=4", "actor.micro_batch_trajectories=2",
        f"trainer.run_dir={tmp_path / 'runs'}", "trainer.run_id=r", "trainer.total_iterations=3",
    ])


def _run_two_iterations(cfg):
    """A run that did two iterations (the train flow's bookkeeping by hand) and checkpointed the second."""
    state = open_run(cfg, resume=None)
    state.bind(mlflow_run_id="m1")
    for it in (1, 2):
        state.prompts.take(it)
        state.append_metrics(it, {"critic/score/mean": 0.25 * it})
    state.trainer.policy_version, state.trainer.kl_coef, state.trainer.bad_updates_in_a_row = 1, 0.002, 1
    state.record_validation(2, {"val-core/arith/acc/mean@1": 0.5})
    begin_save(state.dir.checkpoints, 2)
    commit_save(state.dir.checkpoints, 2, state.trainer_state(2).to_dict())
    state.close()
    return state


def test_the_trainer_state_survives_a_resume(cfg):
    first = _run_two_iterations(cfg)
    snapshot = first.trainer_state(2)
    assert snapshot.iteration == 2 and snapshot.sampler == first.prompts.sampler.state_dict()
    assert first.trainer.iteration == 0  # the snapshot is a copy: the live state is not touched
    again = open_run(cfg, resume=first.run_dir)
    assert again.resumed and again.trainer == snapshot
    assert (again.start_iteration, again.last_iteration, again.last_checkpoint_iteration) == (3, 2, 2)
    assert again.prompts.sampler.state_dict() == first.prompts.sampler.state_dict()
    assert again.validations == {2: {"val-core/arith/acc/mean@1": 0.5}}
    assert flow_input_values(again.cfg, {"node": "prompts"}, again.trainer)["kl_coef"] == 0.002
    summary = again.summary()
    assert (summary["reward_first"], summary["reward_last"], summary["mlflow_run_id"]) == (0.25, 0.5, "m1")
    assert summary["checkpoint"] == f"{first.run_dir}/checkpoints/{checkpoint_name(2)}"
    again.close()


def test_a_wrong_key_refuses_the_resume(cfg):
    """(Written through commit_save, so the checkpoint matches its manifest: the key is the fault.)"""
    first = _run_two_iterations(cfg)
    data = first.trainer_state(3).to_dict()
    data["weights_version"] = data.pop("policy_version")
    begin_save(first.dir.checkpoints, 3)
    commit_save(first.dir.checkpoints, 3, data)
    path = f"{first.dir.checkpoint_dir(3)}/trainer_state.json"
    locks_before = held_locks()
    with pytest.raises(TrainerStateError, match=f"^{path}: unknown key 'weights_version'"):
        open_run(cfg, resume=first.run_dir)
    assert held_locks() == locks_before  # the refused resume released the folder's lock
