"""SIGTERM in the middle of an iteration of a real ``hybridflow train`` (the Prefect flow on Ray, the
tiny model, the CLI starting its own Prefect server and Ray): exit 143 with one line, the stop reason
``terminated`` in run.json, no traceback and no Prefect ``Crash detected!`` line, the run lock
released, and ``--resume`` finishes the run equal to an uninterrupted one (flows/signals.py;
the fake-flow test: tests/unit/test_cli_train_signals.py). The run starts with today's defaults
(``trainer.run_dir=runs`` relative, no MLflow URI) and is resumed from another working directory,
which stays empty (defect 4: the resume uses the locations recorded when the run started)."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.fixtures.compare_runs import compare
from tests.integration.conftest import tiny_overrides
from tests.train_process import signal_and_expect_one_line, start_train, train_env, wait_train

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    d = tmp_path_factory.mktemp("signal-data")
    write_rows(make_arith(8, difficulty=0, seed=31), str(d / "train.parquet"))
    write_rows(make_arith(2, difficulty=0, seed=32), str(d / "val.parquet"))
    return d


def _args(runs: Path, data: Path, run_id: str) -> list[str]:
    return tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"), **{
        "trainer.run_id": run_id, "trainer.total_iterations": "3", "trainer.save_every": "1"})


def _defaults(args: list[str]) -> list[str]:
    """``args`` with today's defaults for where things go: runs/ and mlflow.db in the working directory."""
    return [a for a in args if not a.startswith(("tracking.mlflow_uri=", "trainer.run_dir="))] + ["trainer.run_dir=runs"]


def _train(args: list[str], out: Path, err: Path, cwd: Path | None = None, prefect_home: Path | None = None):
    env = train_env(drop=("PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"),
                    **({"PREFECT_HOME": str(prefect_home)} if prefect_home else {}))
    return start_train(args, log=out, err_log=err, env=env, **({"cwd": cwd} if cwd else {}))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data) -> Path:
    """The uninterrupted run both stopped runs must end equal to: the same config and seed, run
    once for the module (the hold plugin without a marker changes nothing: hold_plugins.py)."""
    tmp = tmp_path_factory.mktemp("straight")
    out, err = tmp / "out.log", tmp / "err.log"
    code = wait_train(_train(_args(tmp / "runs", data, "straight"), out, err), err)
    assert code == 0, err.read_text(errors="replace")[-3000:]
    return tmp / "runs" / "straight"


def _flow_runs(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("select count(*) from flow_run where name not like 'iteration-%'").fetchone()[0]


def _wait_mid_iteration_2(proc, run: Path, err: Path, timeout_s: float = 600) -> None:
    """Until a node of iteration 2 has started (execution_log.jsonl)."""
    deadline = time.monotonic() + timeout_s
    log = run / "execution_log.jsonl"
    while True:
        assert proc.poll() is None, err.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "iteration 2 never started"
        if log.exists() and any(json.loads(x).get("iteration") == 2 for x in log.read_text().splitlines() if x):
            return
        time.sleep(0.2)


def test_sigterm_mid_iteration_exits_143_in_one_line_and_resumes(tmp_path, data, straight):
    runs = tmp_path / "runs"
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    run = home / "runs" / "stopped"
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    driver_home = tmp_path / "driver-prefect-home"  # where a server-less ephemeral Prefect would write
    proc = _train(_defaults(_args(runs, data, "stopped")), out, err, cwd=home, prefect_home=driver_home)
    _wait_mid_iteration_2(proc, run, err)
    time.sleep(0.5)  # inside the node's body
    signal_and_expect_one_line(proc, out, err, signal.SIGTERM)
    assert json.loads((run / "run.json").read_text())["stop_reason"] == "terminated"
    assert not (run / "run.lock").exists()

    code = wait_train(_train(["--resume", str(run)], out, err, cwd=elsewhere), err)
    assert code == 0, err.read_text(errors="replace")[-3000:]
    assert "stop_reason" not in {k for k, v in json.loads((run / "run.json").read_text()).items() if v}
    assert list(elsewhere.iterdir()) == []  # no mlflow.db, no runs/.prefect here
    # the flow runs are in the run's own Prefect server, none in an ephemeral API of the driver
    assert _flow_runs(home / "runs" / ".prefect" / "prefect.db") >= 2  # train (stopped), train (resumed)
    assert not (driver_home / "prefect.db").exists()

    report = io.StringIO()
    with redirect_stdout(report):
        equal = compare(run, straight)
    assert equal, report.getvalue()


def test_sigterm_during_a_checkpoint_write_exits_143_and_resumes_equal(tmp_path, data, straight):
    """SIGTERM while checkpoint iter_000002 is being written (the policy's part is in the staging
    folder, not yet committed: tests/integration/hold_plugins.py holds the actor there): exit 143 in
    one line, ``latest`` still the complete iter_000001, and ``--resume`` ends equal to a run never
    stopped."""
    from tests.integration.hold_plugins import holds_dir
    from workers.checkpoint import checkpoint_name, load_latest

    runs = tmp_path / "runs"
    run = runs / "ckpt-stopped"
    holds = holds_dir(run)
    holds.mkdir(parents=True)
    key = f"save_checkpoint-{checkpoint_name(2)}"
    (holds / key).touch()
    plugin = ["trainer.plugins=[tests.integration.hold_plugins]"]
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    proc = _train(_args(runs, data, "ckpt-stopped") + plugin, out, err)
    deadline = time.monotonic() + 600
    while not (holds / f"{key}.held").exists():
        assert proc.poll() is None, err.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the checkpoint write of iteration 2 never started"
        time.sleep(0.1)
    assert (run / "checkpoints" / f"{checkpoint_name(2)}.tmp").is_dir()  # mid-write: staged, not committed
    signal_and_expect_one_line(proc, out, err, signal.SIGTERM)
    assert Path(load_latest(run / "checkpoints")).name == checkpoint_name(1)  # the half-written one is not latest
    assert not (run / "run.lock").exists()

    code = wait_train(_train(["--resume", str(run)], out, err), err)
    assert code == 0, err.read_text(errors="replace")[-3000:]
    assert Path(load_latest(run / "checkpoints")).name == checkpoint_name(3)
    report = io.StringIO()
    with redirect_stdout(report):
        equal = compare(run, straight)
    assert equal, report.getvalue()
