"""A resume is self-contained (issue 40, defect 4): ``cd elsewhere && hybridflow train --resume
/abs/runs/X`` uses the MLflow URI and Prefect home of the run as it started (absolute), and creates
nothing in the new working directory."""

from __future__ import annotations

import os
from pathlib import Path

from flows.preflight import preflight_run
from flows.resume import owned_run_dir, resume_target
from flows.run_dir import RunDir
from flows.run_state import open_run
from flows.services import default_prefect_home
from flows.tracking import tracking_uri
from hybridflow.config import load_config
from hybridflow.data import write_rows
from hybridflow.data.tasks import make_arith


def _started_in(home: Path) -> Path:
    """A run started in ``home`` with today's defaults: trainer.run_dir=runs (relative), no MLflow URI."""
    write_rows(make_arith(8, difficulty=0, seed=3), str(home / "train.jsonl"))
    cwd = os.getcwd()
    os.chdir(home)
    try:
        cfg = load_config(None, ["model.path=tiny", f"data.train_files=[{home / 'train.jsonl'}]",
                                 "trainer.run_dir=runs", "trainer.run_id=x"])
        assert cfg.tracking.mlflow_uri is None
        state = open_run(cfg, resume=None)
        state.bind(mlflow_uri=tracking_uri(cfg))  # as the train flow records it
        state.close()
    finally:
        os.chdir(cwd)
    return home / "runs" / "x"


def test_resume_from_another_directory_uses_the_recorded_locations(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run starts with today's defaults
    (tmp_path / "home").mkdir()
    (tmp_path / "elsewhere").mkdir()
    run = _started_in(tmp_path / "home")
    monkeypatch.chdir(tmp_path / "elsewhere")

    cfg, resume = resume_target(None, [], str(run))
    with owned_run_dir(cfg, resume) as (cfg, resume):
        preflight_run(cfg, resume)  # what the CLI checks before starting servers
        assert tracking_uri(cfg) == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
        assert default_prefect_home(cfg) == str(tmp_path / "home" / "runs" / ".prefect")
        state = open_run(cfg, resume=resume)  # what the flow does: it reads the saved config again
        assert tracking_uri(state.cfg) == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
        assert state.cfg.trainer.run_dir == str(tmp_path / "home" / "runs")
        state.close()
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert RunDir(run).read_config().trainer.run_dir == "runs"  # the saved config is not rewritten


def test_a_configured_mlflow_uri_wins_and_redacted_ones_are_not_used(tmp_path, monkeypatch):
    from flows.resume import where_it_started

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run starts with today's defaults
    (tmp_path / "home").mkdir()
    run = _started_in(tmp_path / "home")
    folder = RunDir(run)
    saved = folder.read_config()
    assert where_it_started(saved, folder, {"mlflow_uri": "http://***@host"}).tracking.mlflow_uri is None
    given = saved.model_copy(update={"tracking": saved.tracking.model_copy(update={"mlflow_uri": "http://h"})})
    assert where_it_started(given, folder, {"mlflow_uri": "sqlite:///x.db"}).tracking.mlflow_uri == "http://h"
