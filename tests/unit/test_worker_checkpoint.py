"""workers/checkpoint.py: atomic step folders, the latest pointer, pickle-free state, RNG states."""

from __future__ import annotations

import json
import random

import pytest
import torch

from workers import checkpoint as C


def _write_step(root, step, payload: str, state: dict) -> str:
    tmp = C.begin_save(root, step)
    (C.Path(tmp) / "policy").mkdir()
    (C.Path(tmp) / "policy" / "weights.txt").write_text(payload)
    return C.finalize_checkpoint(root, step, state)


def test_commit_moves_folder_and_points_latest(tmp_path):
    path = _write_step(tmp_path, 7, "w7", {"iteration": 7})
    assert path == str(tmp_path / C.checkpoint_name(7))
    assert (tmp_path / "latest").read_text() == C.checkpoint_name(7)
    assert not (tmp_path / f"{C.checkpoint_name(7)}.tmp").exists()
    assert C.load_latest(tmp_path) == path
    assert C.read_trainer_state(path) == {"iteration": 7}


@pytest.mark.parametrize("fail_at_call", [1, 2])  # 1: moving the folder into place, 2: swapping `latest`
def test_interrupted_commit_leaves_previous_checkpoint(tmp_path, monkeypatch, fail_at_call):
    good = _write_step(tmp_path, 3, "w3", {"iteration": 3})
    tmp = C.begin_save(tmp_path, 4)
    (C.Path(tmp) / "policy").mkdir()
    real_replace, calls = C.os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == fail_at_call:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(C.os, "replace", failing_replace)
    with pytest.raises(C.CheckpointError, match="No space left"):
        C.finalize_checkpoint(tmp_path, 4, {"iteration": 4})
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == C.checkpoint_name(3)
    assert C.load_latest(tmp_path) == good
    assert (C.Path(good) / "policy" / "weights.txt").read_text() == "w3"
    # the next attempt at step 4 starts from an empty staging folder
    tmp = C.begin_save(tmp_path, 4)
    assert list(C.Path(tmp).iterdir()) == []


def test_trainer_state_that_is_not_json_is_a_clear_error(tmp_path):
    C.begin_save(tmp_path, 1)
    with pytest.raises(C.CheckpointError, match=C.checkpoint_name(1)):
        C.finalize_checkpoint(tmp_path, 1, {"bad": object()})
    assert C.load_latest(tmp_path) is None


def test_unwritable_root_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(C.CheckpointError, match="cannot create checkpoint folder"):
        C.begin_save(blocker / "ckpt", 1)


def test_exception_while_workers_write_keeps_latest(tmp_path):
    good = _write_step(tmp_path, 1, "w1", {"iteration": 1})

    def crashing_save() -> None:
        tmp = C.begin_save(tmp_path, 2)
        (C.Path(tmp) / "policy").mkdir()
        raise KeyboardInterrupt("killed mid-save")

    with pytest.raises(KeyboardInterrupt):
        crashing_save()
    assert C.load_latest(tmp_path) == good


def test_load_latest_falls_back_to_newest_complete_step(tmp_path):
    assert C.load_latest(tmp_path / "missing") is None
    assert C.load_latest(tmp_path) is None
    _write_step(tmp_path, 1, "a", {"i": 1})
    _write_step(tmp_path, 2, "b", {"i": 2})
    (tmp_path / "latest").unlink()
    (tmp_path / C.checkpoint_name(9)).mkdir()  # incomplete: no trainer_state.json
    assert C.load_latest(tmp_path) == str(tmp_path / C.checkpoint_name(2))


def test_resave_same_step_replaces_it(tmp_path):
    _write_step(tmp_path, 5, "first", {"i": 1})
    path = _write_step(tmp_path, 5, "second", {"i": 2})
    assert (C.Path(path) / "policy" / "weights.txt").read_text() == "second"
    assert C.read_trainer_state(path) == {"i": 2}


def test_save_state_round_trip_is_bit_exact_without_pickle(tmp_path):
    obj = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}, 1: {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "fused": None}],
        "steps_applied": 3,
    }
    C.save_state(obj, tmp_path / "optim" / "rank_0")
    doc = json.loads((tmp_path / "optim" / "rank_0.json").read_text())  # plain JSON structure
    assert "__dict__" in doc
    back = C.load_state(tmp_path / "optim" / "rank_0")
    assert set(back["state"]) == {0, 1}  # int keys survive
    assert torch.equal(back["state"][0]["exp_avg"], obj["state"][0]["exp_avg"])
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["steps_applied"] == 3


def test_save_state_rejects_non_storable_values(tmp_path):
    with pytest.raises(TypeError, match="not storable"):
        C.save_state({"x": object()}, tmp_path / "s")


def test_rng_state_round_trip(tmp_path):
    state = C.capture_rng_state()
    json.dumps(state)  # JSON-serialisable
    expected = (torch.rand(3), random.random())
    C.restore_rng_state(json.loads(json.dumps(state)))
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]


# ---- folder names: iter_<N> for new checkpoints, legacy step_<N> always read -------------------


@pytest.fixture
def writes_iter(monkeypatch):
    """New checkpoints named iter_<N> (what CHECKPOINT_PREFIX becomes once every reader takes it)."""
    monkeypatch.setattr(C, "CHECKPOINT_PREFIX", C.ITERATION_PREFIX)


def test_iteration_of_a_checkpoint_folder_under_either_name():
    assert C.checkpoint_iteration("runs/r/checkpoints/iter_000007") == 7
    assert C.checkpoint_iteration("step_000012") == 12
    for other in ("iter_000007.tmp", "step_000007.damaged", "latest", "iter_", "iteration_7"):
        assert C.checkpoint_iteration(other) is None


def test_a_run_with_legacy_step_folders_continues_in_iter_folders(tmp_path, writes_iter):
    C.CHECKPOINT_PREFIX = C.LEGACY_PREFIX  # a run from before: step_000003, step_000010, latest -> step_000010
    _write_step(tmp_path, 3, "w3", {"iteration": 3})
    _write_step(tmp_path, 10, "w10", {"iteration": 10})
    C.CHECKPOINT_PREFIX = C.ITERATION_PREFIX
    assert C.load_latest(tmp_path) == str(tmp_path / "step_000010")  # `latest` names a legacy folder
    assert C.checkpoint_dir(tmp_path, 3) == str(tmp_path / "step_000003")
    assert C.checkpoint_dir(tmp_path, 11) == str(tmp_path / "iter_000011")  # not saved yet: where it will go
    # resumed: iteration 11 is saved under the new name; order is by iteration, not by folder name
    assert _write_step(tmp_path, 11, "w11", {"iteration": 11}) == str(tmp_path / "iter_000011")
    assert [(it, p.name) for it, p in C.list_checkpoints(tmp_path)] == [
        (3, "step_000003"), (10, "step_000010"), (11, "iter_000011")]
    (tmp_path / "latest").unlink()
    assert C.load_latest(tmp_path) == str(tmp_path / "iter_000011")  # the fallback compares iterations
    # re-saving an iteration that exists under the legacy name replaces it
    _write_step(tmp_path, 3, "w3b", {"iteration": 3})
    assert not (tmp_path / "step_000003").exists()
    assert (tmp_path / "iter_000003" / "policy" / "weights.txt").read_text() == "w3b"


def test_resume_fallback_crosses_from_iter_to_legacy_step_folders(tmp_path, writes_iter):
    from workers.checkpoint_integrity import choose_resume_checkpoint

    C.CHECKPOINT_PREFIX = C.LEGACY_PREFIX
    _write_step(tmp_path, 9, "w9", {"iteration": 9})
    C.CHECKPOINT_PREFIX = C.ITERATION_PREFIX
    _write_step(tmp_path, 10, "w10", {"iteration": 10})
    (tmp_path / "iter_000010" / "policy" / "weights.txt").write_text("changed")  # damaged after commit
    warnings: list[str] = []
    chosen = choose_resume_checkpoint(tmp_path, fallback=True, warn=warnings.append)
    assert chosen == str(tmp_path / "step_000009")
    assert (tmp_path / "latest").read_text() == "step_000009" and (tmp_path / "iter_000010.damaged").is_dir()
    assert "resuming from the newest intact checkpoint step_000009" in warnings[0]
