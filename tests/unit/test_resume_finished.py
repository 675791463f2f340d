"""``hybridflow train --resume`` of a finished run (issue 40, defect 9): one line saying it is
already finished and how to extend it, exit 0, and nothing started (no preflight, no servers)."""

from __future__ import annotations

import os

import pytest

from flows.run_state import open_run
from hybridflow.config import load_config
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith
from workers.checkpoint import begin_save, commit_save


@pytest.fixture
def finished_run(tmp_path):
    train = tmp_path / "train.jsonl"
    write_rows(make_arith(16, difficulty=0, seed=3), str(train))
    cfg = load_config(None, ["model.path=tiny", f"data.train_files=[{train}]", "data.prompts_per_iteration=8",
                             f"trainer.run_dir={tmp_path / 'runs'}", "trainer.run_id=done",
                             "trainer.total_iterations=2"])
    state = open_run(cfg, resume=None)
    root = f"{state.run_dir}/checkpoints"
    begin_save(root, 2)
    commit_save(root, 2, state.trainer_state(2).to_dict())
    state.close()
    return state


def _nothing_may_start(monkeypatch):
    import flows.cli.train as cli_train

    def started(*a, **k):
        raise AssertionError("a finished run started something")

    monkeypatch.setattr(cli_train, "_preflight", started)
    monkeypatch.setattr(cli_train, "_train_with_servers", started)


def test_resume_of_a_finished_run_says_so_and_starts_nothing(finished_run, monkeypatch, capsys):
    from flows.cli import main

    finished_run.dir.write_summary({"run_id": "done"})
    _nothing_may_start(monkeypatch)
    assert main(["train", "--resume", finished_run.run_dir]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "already finished (2 of 2 iterations)" in out[0], out
    assert "trainer.total_iterations=4" in out[0]
    assert not os.path.exists(finished_run.dir.url + "/run.lock")


def test_a_run_without_summary_or_extended_still_resumes(finished_run):
    from flows.resume import already_finished

    cfg = finished_run.cfg
    assert already_finished(cfg, finished_run.run_dir) is None  # stopped after the last checkpoint: validate, sum up
    finished_run.dir.write_summary({"run_id": "done"})
    longer = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_iterations": 3})})
    assert already_finished(longer, finished_run.run_dir) is None
    assert already_finished(cfg, finished_run.run_dir) is not None


def test_summary_has_no_validation_before_when_none_ran_before_training(finished_run):
    """Issue 40, defect 10: with trainer.val_before_train=false the summary's "validation before"
    is empty, not the validation after training."""
    finished_run.record_validation(2, {"val-core/acc": 0.5})
    summary = finished_run.summary()
    assert summary["val_before"] == {} and summary["val_after"] == {"val-core/acc": 0.5}
    finished_run.record_validation(0, {"val-core/acc": 0.1})
    assert finished_run.summary()["val_before"] == {"val-core/acc": 0.1}
