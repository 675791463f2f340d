"""One run owns its folder: ``run.lock`` (O_EXCL, holder pid + host + start time), taken by
``hybridflow train`` before any server starts, released at exit, taken over when its holder is
gone.

The CLI test holds a real ``hybridflow train --resume RUN`` inside its preflight by giving it a
dataset that is a named pipe (reading it blocks until the test writes): the lock is held, no
server has started, and every other start against that folder must be refused in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.run_lock import (
    LOCK_NAME,
    RunLockedError,
    acquire_run_lock,
    held_locks,
    process_start_time,
    read_holder,
    release_run_lock,
)

REPO = Path(__file__).resolve().parents[2]


def _train_args(runs: Path, data: Path, **extra: str) -> list[str]:
    base = {"model.path": "tiny", "data.train_files": f"[{data}]", "data.prompts_per_iteration": "2",
            "rollout.samples_per_prompt": "2", "actor.mini_batch_trajectories": "4",
            "actor.micro_batch_trajectories": "2", "trainer.run_dir": str(runs), "trainer.device": "cpu",
            "tracking.mlflow_uri": f"sqlite:///{runs}/mlflow.db", **extra}
    return [f"{k}={v}" for k, v in base.items()]


def _cli(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # never reached
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", *args], cwd=str(REPO), env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _session_members(sid: int) -> list[int]:
    """PIDs whose session is ``sid`` (each CLI runs in a session of its own, started by this test)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 (session) = index 3 after "(comm)"
                out.append(int(d.name))
    return out


def _refused(args: list[str], log: Path) -> str:
    proc = _cli(args, log)
    assert proc.wait(timeout=120) == 2, log.read_text()[-2000:]
    assert _session_members(proc.pid) == []  # it left nothing running
    out = log.read_text().strip()
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    return out


@pytest.mark.timeout(300)
def test_a_live_run_owns_its_folder_through_the_cli(tmp_path):
    from hybridflow.config import dump_config, load_config
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    good, fifo, runs = tmp_path / "train.jsonl", tmp_path / "pipe.jsonl", tmp_path / "runs"
    write_rows(make_arith(6, difficulty=0, seed=1), str(good))
    os.mkfifo(fifo)
    run_dir = runs / "r"
    run_dir.mkdir(parents=True)  # a run that exists (run.json, config.yaml) and is resumed by the holder
    (run_dir / "config.yaml").write_text(dump_config(load_config(None, _train_args(runs, fifo, **{
        "trainer.run_id": "r"}))))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r"}))

    holder = _cli(["--resume", str(run_dir)], tmp_path / "holder.log")
    try:
        deadline = time.monotonic() + 120
        while read_holder(run_dir / LOCK_NAME) is None:
            assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.1)
        lock = read_holder(run_dir / LOCK_NAME)
        assert (lock["pid"], lock["host"]) == (holder.pid, socket.gethostname())
        assert lock["start_time"] == process_start_time(holder.pid)
        # a second start with the same trainer.run_id, and a --resume of the folder: refused
        again = _refused(_train_args(runs, good, **{"trainer.run_id": "r"}), tmp_path / "second.log")
        resume = _refused(["--resume", str(run_dir)], tmp_path / "resume.log")
        for out in (again, resume):
            assert f"run directory {run_dir.resolve()} is in use by another hybridflow run (pid {holder.pid}" in out
        assert not (runs / ".prefect").exists()  # no Prefect server was started by anyone
        assert holder.poll() is None  # the holder was not disturbed
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # its own session: only what this test started
        holder.wait(timeout=30)
    assert _session_members(holder.pid) == []
    # the killed holder's lock is stale (dead pid on this host): the next start takes it over,
    # and is refused for what it is (a fresh start on a folder that holds a run), before any server
    assert read_holder(run_dir / LOCK_NAME)["pid"] == holder.pid
    out = _refused(_train_args(runs, good, **{"trainer.run_id": "r"}), tmp_path / "after.log")
    assert "already holds a run (trainer.run_id='r'); continue it with --resume" in out
    assert not (run_dir / LOCK_NAME).exists()  # released at exit
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "run.json"]


# ---- the lock itself (in process) ---------------------------------------------------------------
def _plant(run_dir: Path, **holder) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "start_time": None, **holder}))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it)


def test_lock_is_exclusive_reentrant_and_released(tmp_path):
    run_dir = tmp_path / "r"
    path = acquire_run_lock(run_dir)
    assert read_holder(path)["pid"] == os.getpid() and str(path) in held_locks()
    assert acquire_run_lock(run_dir) == path  # re-entrant: the CLI, then the flow it runs
    release_run_lock(run_dir)
    assert path.exists()  # one reference left
    release_run_lock(run_dir, remove_empty_dir=True)
    assert not path.exists() and not run_dir.exists()  # nothing else was in it


def test_a_live_holder_refuses_and_a_dead_or_reused_pid_is_taken_over(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = _plant(tmp_path / "live", pid=parent.pid, start_time=process_start_time(parent.pid))
        with pytest.raises(RunLockedError, match=f"in use by another hybridflow run \\(pid {parent.pid}"):
            acquire_run_lock(tmp_path / "live")
        assert read_holder(path)["pid"] == parent.pid  # untouched
        # the same pid recorded with another start time: the pid was reused, the holder is gone
        _plant(tmp_path / "reused", pid=parent.pid, start_time=process_start_time(parent.pid) - 1)
        assert read_holder(acquire_run_lock(tmp_path / "reused"))["pid"] == os.getpid()
    finally:
        parent.kill()
        parent.wait()
    _plant(tmp_path / "dead", pid=_dead_pid())
    assert read_holder(acquire_run_lock(tmp_path / "dead"))["pid"] == os.getpid()
    for name in ("reused", "dead"):
        release_run_lock(tmp_path / name)


def test_another_hosts_lock_and_a_half_written_lock_are_refused(tmp_path):
    path = _plant(tmp_path / "remote", pid=1234, host="other-host")
    with pytest.raises(RunLockedError, match=f"another host .*other-host.*delete {path}"):
        acquire_run_lock(tmp_path / "remote")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / LOCK_NAME).write_text("")  # a holder between create and write
    with pytest.raises(RunLockedError, match="is being locked by another process"):
        acquire_run_lock(empty)
    old = time.time() - 60  # ... or one that crashed there long ago: stale
    os.utime(empty / LOCK_NAME, (old, old))
    assert read_holder(acquire_run_lock(empty))["pid"] == os.getpid()
    release_run_lock(empty)
