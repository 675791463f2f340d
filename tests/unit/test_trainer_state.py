"""flows/trainer_state.py: what trainer_state.json holds, round-tripped through a dict, JSON and
a real checkpoint; old files still read; a wrong key is a clear error naming file and key."""

from __future__ import annotations

import json

import pytest

from flows.trainer_state import TrainerState, TrainerStateError
from hybridflow.data import PromptSampler
from workers.checkpoint import begin_save, checkpoint_name, commit_save, load_latest

# the object the driver wrote before TrainerState existed (RunState.trainer_state in flows/run_state.py)
OLD_FORMAT = {
    "iteration": 4, "policy_version": 3, "critic_version": 4, "kl_coef": 0.0015, "bad_updates_in_a_row": 1,
    "sampler": {"epoch": 1, "step": 4, "step_in_epoch": 1, "num_prompts": 6, "prompts_per_step": 2,
                "shuffle": True, "seed": 7, "drop_last": True},
    "mlflow_run_id": "0f3c9d",
}


def _state() -> TrainerState:
    sampler = PromptSampler(6, 2, shuffle=True, seed=7, drop_last=True)
    for _ in range(4):
        sampler.next_indices()
    return TrainerState(kl_coef=0.0015, iteration=4, policy_version=3, critic_version=4, bad_updates_in_a_row=1,
                        sampler=sampler.state_dict(), mlflow_run_id="0f3c9d")


def test_to_dict_is_the_old_format():
    assert _state().to_dict() == OLD_FORMAT
    assert TrainerState.from_dict(OLD_FORMAT) == _state()


def test_round_trip_through_json():
    state = _state()
    assert TrainerState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    fresh = TrainerState(kl_coef=0.001)  # before the first checkpoint: counters 0, no sampler, no MLflow run
    assert TrainerState.from_dict(json.loads(json.dumps(fresh.to_dict()))) == fresh


def test_round_trip_through_a_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    state = _state()
    begin_save(root, 4)
    commit_save(root, 4, state.to_dict())
    path = load_latest(root)
    assert path == str(root / checkpoint_name(4))
    assert TrainerState.read(path) == state
    restored = PromptSampler(6, 2, shuffle=True, seed=7, drop_last=True)
    restored.load_state_dict(TrainerState.read(path).sampler)
    assert restored.state_dict() == state.sampler


def test_an_old_file_without_mlflow_run_id_reads_as_none(tmp_path):
    """A resume always read ``mlflow_run_id`` with a default; that stays the one optional key."""
    old = {k: v for k, v in OLD_FORMAT.items() if k != "mlflow_run_id"}
    assert TrainerState.from_dict(old).mlflow_run_id is None


def test_to_dict_copies_the_sampler_state():
    state = _state()
    state.to_dict()["sampler"]["epoch"] = 99
    assert state.sampler["epoch"] == 1


@pytest.mark.parametrize("change, message", [
    ({"weights_version": 3}, "unknown key 'weights_version'"),
    ({"policy_version": None}, "key 'policy_version' is None, expected int"),
    ({"kl_coef": "0.1"}, "key 'kl_coef' is '0.1', expected float"),
    ({"iteration": True}, "key 'iteration' is True, expected int"),
    ({"sampler": []}, "key 'sampler' is [], expected dict"),
    ({"mlflow_run_id": 5}, "key 'mlflow_run_id' is 5, expected str or null"),
])
def test_wrong_keys_name_the_file_and_the_key(tmp_path, change, message):
    root = tmp_path / "checkpoints"
    begin_save(root, 2)
    commit_save(root, 2, {**OLD_FORMAT, **change})
    with pytest.raises(TrainerStateError) as err:
        TrainerState.read(load_latest(root))
    assert str(err.value).startswith(f"{root / checkpoint_name(2)}/trainer_state.json: ")
    assert message in str(err.value)


@pytest.mark.parametrize("key", ["iteration", "policy_version", "critic_version", "kl_coef",
                                 "bad_updates_in_a_row", "sampler"])
def test_a_missing_key_is_named(key):
    data = {k: v for k, v in OLD_FORMAT.items() if k != key}
    with pytest.raises(TrainerStateError, match=f"^state.json: missing key '{key}'$"):
        TrainerState.from_dict(data, source="state.json")


def test_not_an_object():
    with pytest.raises(TrainerStateError, match="s.json: expected a JSON object, got list"):
        TrainerState.from_dict([1, 2], source="s.json")
