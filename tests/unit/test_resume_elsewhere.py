"""A resume is self-contained (issue 40, defect 4): ``cd elsewhere && hybridflow train --resume
/abs/runs/X`` uses the MLflow URI and Prefect home of the run as it started (absolute), and creates
nothing in the new working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flows.preflight import preflight_run
from flows.resume import owned_run_dir, resume_target
from flows.run_dir import RunDir
from flows.run_state import open_run
from flows.services import default_prefect_home
from flows.tracking import tracking_uri
from hybridflow.config import dump_config, load_config
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


def test_a_prefect_home_given_at_start_is_recorded_absolute(tmp_path, monkeypatch):
    """Issue 40: ``--prefect-home`` given when the run started was not recorded, so a resume went
    to the default home and its Prefect server knew nothing of the run. While :func:`services`
    holds a local server, its folder (absolute) is what the train flow records (prefect_location)."""
    import flows.runtime
    from flows.runtime import PrefectServer
    from flows.services import PREFECT_HOME_ENV, prefect_location, services

    monkeypatch.delenv(PREFECT_HOME_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(flows.runtime, "launch_prefect_api", lambda home: PrefectServer("http://127.0.0.1:1/api", None, home))
    with services(None, prefect_home="rel/home"):
        assert prefect_location() == {"prefect_home": str(tmp_path / "rel" / "home")}
    assert prefect_location() == {}  # gone with the server
    monkeypatch.setattr(flows.runtime, "launch_prefect_api", lambda home: PrefectServer("http://x/api", None, ""))
    with services(None, prefect_home="unused"):  # the user's $PREFECT_API_URL: no home of ours to record
        assert prefect_location() == {}


def test_resume_uses_the_recorded_prefect_home_unless_one_is_given(tmp_path, monkeypatch):
    import json

    import flows.runtime
    from flows.cli import main
    from tests.unit.test_reliability_inputs import args_for

    write_rows(make_arith(6, difficulty=0, seed=1), str(tmp_path / "train.jsonl"))
    args = args_for(tmp_path, tmp_path / "train.jsonl", **{"trainer.run_id": "r"})[1:]
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(load_config(None, args)))
    recorded = tmp_path / "my-prefect"
    (run / "run.json").write_text(json.dumps({"run_id": "r", "prefect_home": str(recorded)}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    homes = []

    def stop_here(home):
        homes.append(str(home))
        raise RuntimeError("stop before the server")

    monkeypatch.setattr(flows.runtime, "launch_prefect_api", stop_here)
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(RuntimeError, match="stop before the server"):
            main(["train", "--resume", str(run)])
        with pytest.raises(RuntimeError, match="stop before the server"):
            main(["train", "--resume", str(run), "--prefect-home", str(tmp_path / "other")])
    finally:
        for sig, handler in handlers.items():  # the CLI installs its signal handlers for good
            signal.signal(sig, handler)
    assert homes == [str(recorded), str(tmp_path / "other")]
    assert list((tmp_path / "elsewhere").iterdir()) == []
