"""What a ``hybridflow train`` leaves running, what it listens on, and a reward that always fails —
through the CLI on the tiny model, each run with its own Prefect server and local Ray (the CLI
starts them, as for a user).

- A SIGKILL of the driver's pid alone (not its group) takes down everything it started: the
  Prefect server, Ray (GCS, raylet, dashboard and runtime-env agents, workers, pool actors) and
  the reward processes (``flows/reaper.py``). Only pids this test started are looked at: the
  driver's process tree, recorded by pid and start time while it runs.
- While it runs, none of those processes listens on 0.0.0.0 or :: (``flows.runtime.loopback_ray``).
- A reward function that raises on every row stops the run after
  ``reward.max_failure_iterations`` iterations, with one line naming the function and the error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import tiny_overrides
from tests.train_process import start_train, train_env
from workers import checkpoint as C
from workers.checkpoint import checkpoint_name

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
FAILING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ConnectionError("reward backend is down")
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hybridflow.data import write_rows
    from hybridflow.data.tasks import make_arith

    d = tmp_path_factory.mktemp("process-data")
    write_rows(make_arith(6, difficulty=0, seed=21), str(d / "train.parquet"))
    write_rows(make_arith(2, difficulty=0, seed=22), str(d / "val.parquet"))
    (d / "failing_reward.py").write_text(FAILING_REWARD)
    return d


def _cli(args: list[str], out: Path, err: Path) -> subprocess.Popen:
    """The CLI in a session of its own, with no Prefect API set: it starts its own server and Ray."""
    return start_train(args, log=out, err_log=err, env=train_env(drop=("PREFECT_API_URL", "RAY_ADDRESS")))


def _tree(root: psutil.Process) -> dict[int, tuple[float, str]]:
    """pid → (start time, what it is) for ``root``'s descendants."""
    out = {}
    for p in root.children(recursive=True):
        try:
            out[p.pid] = (p.create_time(), " ".join(p.cmdline())[:120] or p.name())
        except psutil.Error:
            continue
    return out


def _survivors(tree: dict[int, tuple[float, str]]) -> dict[int, str]:
    left = {}
    for pid, (start, what) in tree.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == start and p.status() != psutil.STATUS_ZOMBIE:
                left[pid] = what
        except psutil.Error:
            continue
    return left


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    return [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _wait_for_iteration(proc: subprocess.Popen, metrics: Path, log: Path, timeout_s: float = 420) -> None:
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "no iteration finished in time"
        time.sleep(1.0)


def test_killed_driver_leaves_nothing_behind_and_nothing_listens_beyond_loopback(tmp_path, data):
    runs = tmp_path / "runs"
    args = tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"), **{
        "trainer.run_id": "killed", "trainer.total_iterations": "500", "trainer.save_every": "0"})
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    proc = _cli(args, out, err)
    tree: dict[int, tuple[float, str]] = {}
    try:
        _wait_for_iteration(proc, runs / "killed" / "metrics.jsonl", err)
        driver = psutil.Process(proc.pid)
        tree = _tree(driver)
        kinds = " | ".join(what for _, what in tree.values())
        for part in ("flows.reaper", "prefect server start", "gcs_server", "raylet", "ray::DashboardAgent",
                     "ray::RuntimeEnvAgent", "ray::WorkerHost", "hybridflow.rewards._worker"):
            assert part in kinds, f"{part} not among the driver's processes: {kinds}"
        # the listening sockets of the driver and everything it started, during the run
        listening = _listening(set(tree) | {proc.pid})
        assert len(listening) >= 5, listening  # Prefect server, GCS, raylet, agents, workers at least
        wide = [(ip, port, tree.get(pid, ("", "driver"))[1]) for ip, port, pid in listening if ip not in LOOPBACK]
        assert wide == [], f"listening beyond loopback: {wide}"

        tree = _tree(driver)  # again, just before the kill (workers may have started since)
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, not its process group
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _survivors(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _survivors(tree) == {}, f"still running after the driver was killed: {_survivors(tree)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _survivors(tree):  # only processes this test started, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_reward_failing_on_every_row_stops_the_run_in_one_line(tmp_path, data):
    runs = tmp_path / "runs"
    fn = f"{data / 'failing_reward.py'}:compute_score"
    args = tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"), **{
        "trainer.run_id": "failing", "trainer.total_iterations": "6", "trainer.save_every": "1",
        "reward.function": fn, "reward.max_failure_iterations": "2"})
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    proc = _cli(args, out, err)
    try:
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last == (
        f"reward.function={fn} failed on every row for 2 iterations in a row (reward.max_failure_iterations=2); "
        f"stopping at iteration 2. Last error: error: raised ConnectionError: reward backend is down "
        f"at {data / 'failing_reward.py'}:3"
    ), last
    records = [json.loads(x) for x in (runs / "failing" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]  # the stopping iteration is logged, nothing after
    assert [r["metrics"]["reward/errors"] for r in records] == [4.0, 4.0]  # 2 prompts x 2 samples, all failed
    assert sorted(p.name for p in (runs / "failing" / "checkpoints").glob(f"{C.CHECKPOINT_PREFIX}*")) == [checkpoint_name(1)]
