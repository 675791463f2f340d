"""`hybridflow eval` argument handling and the evaluate flow's plan: every error is reported
before any service starts (a Prefect server start here fails the test)."""

from __future__ import annotations

import pytest

from flows.cli import main
from tests.unit.test_cli_export import _fake_run
from workers.checkpoint import checkpoint_name


@pytest.fixture(autouse=True)
def no_services(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a service was started before the arguments were checked")

    monkeypatch.setattr("flows.runtime.launch_prefect_api", refuse)
    monkeypatch.setattr("flows.runtime.ensure_ray", refuse)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    return _fake_run(tmp_path_factory.mktemp("runs"), (1, 3))[0]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    path = tmp_path_factory.mktemp("data") / "val.parquet"
    write_rows(make_arith(3, difficulty=0, seed=1), str(path))
    return str(path)


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "tiny", "--samples", "0"], "--samples must be >= 1, got 0"),
    (["--model", "tiny", "--max-prompts", "0"], "--max-prompts must be >= 1, got 0"),
    (["--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
    (["--model", "tiny"], "no evaluation data: pass data_files"),
    (["--model", "tiny", "--data", "/no/such.parquet"], "evaluation data file '/no/such.parquet' does not exist"),
    (["--model", "tiny", "--step", "2"], "--step applies to a run directory"),
    (["--model", "/no/such/model", "--step", "2"], "model path '/no/such/model' does not exist"),  # not --step's fault
    (["--model", "tiny", "-c", "/no/such.yaml"], "file '/no/such.yaml' does not exist"),
    (["--model", "tiny", "rollout.temperature=-1"], "rollout.temperature"),
])
def test_eval_argument_errors(capsys, argv, message):
    assert main(["eval", *argv]) == 2
    assert message in capsys.readouterr().err


def test_eval_missing_step_of_a_run_lists_the_steps(fake_run, capsys):
    assert main(["eval", "--model", str(fake_run), "--step", "2"]) == 2
    assert "no checkpoint at step 2; steps saved: 1, 3" in capsys.readouterr().err


def test_eval_run_with_a_config_file_uses_that_config(fake_run, data_file, tmp_path):
    from flows.eval_plan import plan_evaluation

    (tmp_path / "c.yaml").write_text("rollout:\n  max_response_tokens: 7\n")
    target, cfg = plan_evaluation(run_dir=str(fake_run), config_path=str(tmp_path / "c.yaml"), data_files=[data_file])
    assert cfg.rollout.max_response_tokens == 7 and cfg.model.path == target.model_path
    _, run_cfg = plan_evaluation(run_dir=str(fake_run), data_files=[data_file])
    assert run_cfg.rollout.max_response_tokens == 64  # the run's config.yaml (defaults)


def test_eval_step_of_a_checkpoint_folder_is_refused(fake_run, capsys):
    assert main(["eval", "--model", str(fake_run / "checkpoints" / checkpoint_name(1)), "--step", "1"]) == 2
    assert "already one checkpoint" in capsys.readouterr().err


def test_flow_kwargs_for_run_dir_checkpoint_folder_and_model(fake_run, data_file):
    from flows.cli import build_parser
    from flows.cli.eval import flow_kwargs

    def kw(*argv):
        return flow_kwargs(build_parser().parse_args(["eval", *argv]))

    assert kw("--model", str(fake_run))["run_dir"] == str(fake_run)
    assert kw("--model", str(fake_run))["checkpoint"] == "latest"
    folder = kw("--model", str(fake_run / "checkpoints" / checkpoint_name(1)))
    assert (folder["run_dir"], folder["checkpoint"]) == (str(fake_run), checkpoint_name(1))
    latest = kw("--model", str(fake_run / "checkpoints" / "latest"))  # the pointer file
    assert (latest["run_dir"], latest["checkpoint"]) == (str(fake_run), "latest")
    ckpts = kw("--model", str(fake_run / "checkpoints"), "--step", "1")
    assert (ckpts["run_dir"], ckpts["checkpoint"]) == (str(fake_run), "1")
    got = kw("--model", "tiny", "--data", data_file, "rollout.max_response_tokens=8", "--samples", "4")
    assert got["model"] == "tiny" and got["data_files"] == [data_file]
    assert got["overrides"] == ["rollout.max_response_tokens=8"]  # taken back from --data
    assert got["samples_per_prompt"] == 4


def test_plan_of_a_checkpoint_uses_its_policy_folder_and_only_policy_and_reward(fake_run, data_file):
    from flows.eval_plan import plan_evaluation

    target, cfg = plan_evaluation(run_dir=str(fake_run), checkpoint="1", data_files=[data_file],
                                  overrides=["algorithm.adv_estimator=gae"], samples_per_prompt=3, temperature=0.7,
                                  max_prompts=2)
    assert target.step == 1 and target.label == "run-a@step1"
    assert target.model_path == str((fake_run / "checkpoints" / checkpoint_name(1) / "policy").resolve())
    assert cfg.model.path == target.model_path and cfg.model.tokenizer_path is None
    assert cfg.data.val_files == [data_file] and cfg.data.val_max_prompts == 2
    assert (cfg.rollout.val_samples_per_prompt, cfg.rollout.val_temperature) == (3, 0.7)
    roles = {r for p in cfg.placement.pools.values() for r in p.roles}
    assert roles == {"policy", "reward"}  # the run's critic/reference are not loaded to evaluate
    assert not cfg.needs_critic and not cfg.needs_reference
    latest, _ = plan_evaluation(run_dir=str(fake_run), data_files=[data_file])
    assert latest.step == 3


def test_plan_of_a_model_and_both_at_once(fake_run, data_file):
    from flows.eval_plan import plan_evaluation

    target, cfg = plan_evaluation(model="tiny", data_files=[data_file])
    assert (target.label, cfg.model.path, target.step) == ("tiny", "tiny", None)
    with pytest.raises(ValueError, match="not both"):
        plan_evaluation(run_dir=str(fake_run), model="tiny", data_files=[data_file])


def test_planning_imports_no_prefect(data_file):
    # Prefect reads PREFECT_API_URL when it is imported: the CLI plans before it starts the server
    import subprocess
    import sys

    code = ("import sys; from flows.eval_plan import plan_evaluation; "
            f"plan_evaluation(model='tiny', data_files=[{data_file!r}]); "
            "assert 'prefect' not in sys.modules, 'prefect imported while planning'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
