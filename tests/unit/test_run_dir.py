"""flows/run_dir.py: the run folder's layout and its files, on a local folder and on ``memory://``."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest

from flows.run_dir import RunDir
from hybridflow.config import ConfigError, load_config


@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path) -> RunDir:
    if request.param == "local":
        yield RunDir(tmp_path / "runs" / "r1")
        return
    url = f"memory://runs-{uuid.uuid4().hex[:8]}/r1"  # one memory filesystem per process: a fresh folder
    yield RunDir(url)
    fs, path = fsspec.core.url_to_fs(url)
    fs.rm(path.rsplit("/", 1)[0], recursive=True)


def test_layout_names_every_file():
    rd = RunDir("memory://runs/r7")
    assert rd.url == "memory://runs/r7" and rd.name == "r7"
    assert [rd.config_file, rd.run_info_file, rd.metrics_file, rd.validation_file, rd.summary_file] == [
        f"memory://runs/r7/{n}" for n in ("config.yaml", "run.json", "metrics.jsonl", "validation.jsonl",
                                          "summary.json")]
    assert rd.execution_log == "memory://runs/r7/execution_log.jsonl"
    assert rd.pool_events == "memory://runs/r7/pool_events.jsonl"
    assert rd.checkpoints == "memory://runs/r7/checkpoints"
    assert rd.results == "memory://runs/r7/prefect-results"
    assert rd.iter_dir(7) == "memory://runs/r7/iter_000007"
    assert rd.ledger("critic") == "memory://runs/r7/updates_critic.jsonl"
    assert rd.checkpoint_dir(12) == "memory://runs/r7/checkpoints/iter_000012"
    assert RunDir("memory://runs/r7/").url == "memory://runs/r7"


def test_a_local_path_is_absolute_and_resolved(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    rd = RunDir(Path("link") / "r2")
    assert rd.url == str((tmp_path / "real" / "r2").resolve()) and rd.name == "r2"
    assert rd.metrics_file == f"{rd.url}/metrics.jsonl"
    assert rd.checkpoint_dir(3) == f"{rd.url}/checkpoints/iter_000003"
    (tmp_path / "real" / "r2" / "checkpoints" / "step_000003").mkdir(parents=True)  # a run from before iter_<N>
    assert rd.checkpoint_dir(3) == f"{rd.url}/checkpoints/step_000003"


def test_create_writes_config_and_result_storage(run_dir):
    cfg = load_config(None, ["trainer.seed=11", "trainer.total_iterations=3"])
    assert not run_dir.exists() and not run_dir.is_run()
    run_dir.create(cfg)
    assert run_dir.exists("config.yaml") and run_dir.fs.isdir(run_dir.results)
    assert run_dir.read_config() == cfg
    assert not run_dir.is_run()  # run.json comes with bind


def test_read_config_errors_name_the_file(run_dir):
    with pytest.raises(ConfigError, match=r"config\.yaml' does not exist"):
        run_dir.read_config()
    run_dir.fs.makedirs(run_dir.url, exist_ok=True)
    with run_dir.fs.open(run_dir.config_file, "w") as f:
        f.write("- a list\n")
    with pytest.raises(ConfigError, match=r"config\.yaml must hold a mapping"):
        run_dir.read_config()


def test_bind_merges_into_run_json(run_dir):
    run_dir.create(load_config(None, []))
    assert run_dir.run_info() == {}
    assert run_dir.bind() == {}
    assert json.loads(run_dir.fs.cat_file(run_dir.run_info_file)) == {"run_id": "r1"}
    assert run_dir.bind(mlflow_run_id="m1", prefect_flow_run_id="f1") == {"mlflow_run_id": "m1",
                                                                          "prefect_flow_run_id": "f1"}
    run_dir.bind(mlflow_run_id="m2")
    assert run_dir.is_run()
    assert run_dir.run_info() == {"mlflow_run_id": "m2", "prefect_flow_run_id": "f1"}
    on_disk = json.loads(run_dir.fs.cat_file(run_dir.run_info_file))
    assert on_disk == {"run_id": "r1", "mlflow_run_id": "m2", "prefect_flow_run_id": "f1"}


def test_metrics_keep_finite_floats_and_the_last_record_wins(run_dir):
    run_dir.create(load_config(None, []))
    assert run_dir.metrics_history() == {}
    run_dir.append_metrics(1, {"critic/score/mean": 0.25, "bad": float("nan"), "inf": float("inf"), "n": 3})
    run_dir.append_metrics(2, {"critic/score/mean": 0.5})
    run_dir.append_metrics(2, {"critic/score/mean": 0.75})  # iteration 2 again, after a resume
    assert run_dir.metrics_history() == {1: {"critic/score/mean": 0.25}, 2: {"critic/score/mean": 0.75}}
    lines = run_dir.fs.cat_file(run_dir.metrics_file).decode().splitlines()
    assert len(lines) == 3 and json.loads(lines[0]) == {"iteration": 1, "metrics": {"critic/score/mean": 0.25}}


def test_validations_round_trip(run_dir):
    run_dir.create(load_config(None, []))
    assert run_dir.validations() == {}
    run_dir.append_validation(0, {"val-core/arith/acc/mean@1": 0.125})
    run_dir.append_validation(4, {"val-core/arith/acc/mean@1": 0.5, "timing_s/validate": 1.5})
    assert run_dir.validations() == {0: {"val-core/arith/acc/mean@1": 0.125},
                                     4: {"val-core/arith/acc/mean@1": 0.5, "timing_s/validate": 1.5}}


def test_summary_round_trip(run_dir):
    run_dir.create(load_config(None, []))
    assert run_dir.read_summary() is None
    summary = {"run_id": "r1", "iterations": 3, "reward_first": 0.1, "val_after": {"val-core/x": 0.5}}
    run_dir.write_summary(summary)
    assert run_dir.read_summary() == summary
    assert run_dir.fs.cat_file(run_dir.summary_file).decode() == json.dumps(summary, indent=2)


def test_local_files_are_plain_files(tmp_path):
    """A local run directory keeps the files a reader (and older code) opens with open()."""
    rd = RunDir(tmp_path / "r3")
    rd.create(load_config(None, []))
    rd.bind(mlflow_run_id="m")
    rd.append_metrics(1, {"critic/score/mean": 1.0})
    assert json.loads((tmp_path / "r3" / "run.json").read_text()) == {"run_id": "r3", "mlflow_run_id": "m"}
    assert (tmp_path / "r3" / "metrics.jsonl").read_text() == (
        '{"iteration": 1, "metrics": {"critic/score/mean": 1.0}}\n')
    assert load_config(tmp_path / "r3" / "config.yaml") == load_config(None, [])
    assert (tmp_path / "r3" / "prefect-results").is_dir()
