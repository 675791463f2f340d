"""Meaningless input is refused in one line before any server starts: overrides on ``--resume``
(unless ``--override``: then applied and recorded in run.json), a prompt budget longer than the
model's context, and a group-baseline estimator with one sample per prompt.

``hybridflow train`` runs in process with the Prefect/Ray start replaced by a tripwire
(tests/unit/test_reliability_inputs.py's fixtures)."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from hybridflow.config import dump_config, load_config
from tests.unit.test_reliability_inputs import args_for, good_data, no_servers, run_cli  # noqa: F401 - fixtures


@pytest.fixture
def saved_run(tmp_path, good_data):  # noqa: F811 - the fixture imported above
    """A run folder as a first run leaves it (config.yaml, run.json), lr 1e-6."""
    args = args_for(tmp_path, good_data, **{"trainer.run_id": "r", "actor.lr": "1e-06"})[1:]
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(load_config(None, args)))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "mlflow_run_id": "m1"}))
    return run_dir


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_override_on_resume_is_refused_without_override_flag(saved_run, capsys, no_servers):  # noqa: F811
    before = (saved_run / "config.yaml").read_text()
    code, err = run_cli(["train", "--resume", str(saved_run), "actor.lr=0.5"], capsys)
    assert code == 2
    line = _one_line(err)
    assert "actor.lr=0.5 (saved: 1e-06) would change the run's saved config" in line and "--override" in line
    assert (saved_run / "config.yaml").read_text() == before  # nothing changed on disk
    assert "config_overrides" not in json.loads((saved_run / "run.json").read_text())
    # extending the run is what resume is for: allowed without --override (reaches the servers)
    with pytest.raises(AssertionError, match="a server was started"):
        main(["train", "--resume", str(saved_run), "trainer.total_iterations=20"])


def test_override_on_resume_applies_and_is_recorded_with_override_flag(saved_run, capsys, monkeypatch):
    import flows.cli.train

    ran = {}

    def fake_train(args, cfg, resume):
        ran["cfg"], ran["resume"] = cfg, resume
        return 0

    monkeypatch.setattr(flows.cli.train, "_train_with_servers", fake_train)
    assert main(["train", "--resume", str(saved_run), "--override", "actor.lr=0.5"]) == 0
    assert ran["cfg"].actor.lr == 0.5 and ran["resume"] == str(saved_run)
    assert load_config(saved_run / "config.yaml").actor.lr == 0.5  # a later resume continues with it
    info = json.loads((saved_run / "run.json").read_text())
    (record,) = info["config_overrides"]
    assert record["changes"] == {"actor.lr": {"saved": 1e-06, "now": 0.5}} and record["from_checkpoint"] is None
    assert info["mlflow_run_id"] == "m1"  # the rest of run.json is kept
    code, err = run_cli(["train", "--override", *args_for(saved_run, saved_run / "x.jsonl")[1:]], capsys)
    assert code == 2 and "--override applies only with --resume" in _one_line(err)


@pytest.mark.parametrize(("extra", "expected"), [
    ({"data.max_prompt_tokens": "8192"},
     "data.max_prompt_tokens=8192 is longer than the model's context (512 positions, model.path='tiny')"),
    ({"data.max_prompt_tokens": "500", "rollout.max_response_tokens": "64"},
     "data.max_prompt_tokens=500 + rollout.max_response_tokens=64 = 564 tokens exceed the model's context (512"),
])
def test_prompt_budget_longer_than_the_model_context(tmp_path, capsys, no_servers, good_data, extra, expected):  # noqa: F811
    code, err = run_cli(args_for(tmp_path, good_data, **extra), capsys)
    assert code == 2 and expected in _one_line(err)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run folder left


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_baseline_estimator_with_one_sample_per_prompt(tmp_path, capsys, no_servers, good_data, estimator):  # noqa: F811
    args = args_for(tmp_path, good_data, **{"algorithm.adv_estimator": estimator, "rollout.samples_per_prompt": "1",
                                            "actor.mini_batch_trajectories": "2", "critic.mini_batch_trajectories": "2"})
    code, err = run_cli(args, capsys)
    line = _one_line(err)
    assert code == 2 and f"rollout.samples_per_prompt=1 but algorithm.adv_estimator={estimator!r}" in line
    assert "sample at least 2 per prompt" in line


def test_estimators_without_a_group_baseline_accept_one_sample():
    from hybridflow.algorithms import advantage_estimator_min_samples

    assert {n: advantage_estimator_min_samples(n) for n in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline",
                                                           "gae", "reinforce_plus_plus", "remax")} == {
        "grpo": 2, "rloo": 2, "opo": 2, "reinforce_plus_plus_baseline": 2, "gae": 1, "reinforce_plus_plus": 1,
        "remax": 1}


def test_resume_auto_in_the_config_is_checked_like_resume(saved_run, tmp_path, good_data, capsys, no_servers):  # noqa: F811
    """``trainer.resume=auto`` (no --resume) picks the latest run before any server starts: the same
    lock and the same override rule apply to it."""
    code, err = run_cli(args_for(tmp_path, good_data, **{"trainer.resume": "auto", "actor.lr": "0.5"}), capsys)
    assert code == 2 and f"--resume {saved_run}: actor.lr=0.5 (saved: 1e-06)" in _one_line(err)
