"""``hybridflow train`` in a subprocess, for the integration and cluster tests: start it in a
process group of its own, wait for it (failing with the log's tail), SIGKILL that group; and
stop any server or worker a test started together with the processes it started in sessions of
their own (``stop_process_tree``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def train_env(*, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment without the variables starting with ``drop``, with the tree on
    PYTHONPATH, tokenizers single-threaded and ``extra`` set."""
    env = {k: v for k, v in os.environ.items() if not (drop and k.startswith(drop))}
    return {**env, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **extra}


def start_train(
    args: list[str], *, log: Path, err_log: Path | None = None, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``python -m flows.cli train ARGS`` in a new session (its own process group).

    log: stdout, appended to, with stderr too unless err_log is given (then both are truncated).
    env: default :func:`train_env`.
    """
    mode = "ab" if err_log is None else "wb"
    stderr = subprocess.STDOUT if err_log is None else open(err_log, "wb")
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", *args], cwd=str(cwd),
                            env=train_env() if env is None else env, stdout=open(log, mode), stderr=stderr,
                            start_new_session=True)


def signal_and_expect_one_line(proc: subprocess.Popen, out: Path, err: Path, sig: int = signal.SIGTERM) -> str:
    """Send ``sig`` to the CLI and check the one shutdown path (flows/signals.py): exit 128 + sig
    within 30 s, the last stderr line ``run stopped: <reason> (<SIGNAME>)``, and no traceback nor
    Prefect crash line in what it printed after the signal. Returns that stderr."""
    from flows.signals import REASONS

    before = (len(out.read_bytes()), len(err.read_bytes()))  # what the start-up printed is not ours to judge
    proc.send_signal(sig)
    t0 = time.monotonic()
    code = wait_train(proc, err, timeout_s=60)
    took = time.monotonic() - t0
    stdout = out.read_bytes()[before[0]:].decode(errors="replace")
    stderr = err.read_bytes()[before[1]:].decode(errors="replace")
    assert code == 128 + sig, stderr[-3000:]
    assert took < 30, took
    assert stderr.strip().splitlines()[-1] == f"run stopped: {REASONS[sig]} ({signal.Signals(sig).name})", stderr[-3000:]
    for noise in ("Traceback", "Crash detected", "TerminationSignal", "SystemError"):
        assert noise not in stdout + stderr, (noise, stderr[-3000:])
    return stderr


def start_cli(argv: list[str], out: Path, err: Path, env: dict[str, str]) -> subprocess.Popen:
    """``python -m flows.cli ARGV`` from the repository in a new session, stdout/stderr to ``out``/``err``."""
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *argv], cwd=str(REPO), env=env,
                            stdout=open(out, "wb"), stderr=open(err, "wb"), start_new_session=True)


def wait_for_file(path: Path, proc: subprocess.Popen, err: Path, what: str, timeout_s: float = 600) -> None:
    """Until ``path`` exists; fails with the CLI's stderr if it exits first, with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, err.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def assert_tree_ends(tree: set[tuple[int, str]], timeout_s: float = 30, detail: str = "") -> None:
    """Every process of ``tree`` (:func:`_process_tree`, taken before the CLI exited) is gone within
    ``timeout_s`` (the reaper ends what the CLI left); fails naming the ones still running."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while (alive := {p for p, started in tree if _start_time(p) == started}) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = []
    for pid in alive:
        try:
            names.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:200]}")
        except psutil.Error:
            names.append(f"{pid}: (gone)")
    assert alive == set(), f"still running after the CLI exited: {names}\n{detail}"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group this test created (the CLI and whatever it started in it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def wait_train(proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> int:
    """The exit code; fails the test with the log's tail after ``timeout_s``. The group is killed
    on the way out if the CLI still runs."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hybridflow train did not finish in {timeout_s}s:\n{log.read_text(errors='replace')[-4000:]}")
    finally:
        if proc.poll() is None:
            kill_group(proc)


def stop_process_tree(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Stop a process we started in its own session, with its process group and every process
    it started in other sessions (a process worker puts each flow run in a new session): TERM
    to the group first, then KILL to whatever of that tree is still alive."""
    if proc.poll() is not None:
        return
    tree = _process_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    tree |= _process_tree(proc.pid) if proc.poll() is None else set()
    for pid, started in tree:
        if _start_time(pid) == started:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def write_train_deployment(path: Path, overrides: list[str], work_pool: str) -> dict:
    """deployments/prefect.yaml reduced to its ``train`` deployment (its concurrency limit kept),
    with the config of ``overrides`` as its ``config`` parameter and ``work_pool`` as its pool,
    written to ``path``. Returns the deployment's mapping as written."""
    import yaml

    from hybridflow.config import load_config, parse_overrides

    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml").read_text())
    dep = next(d for d in spec["deployments"] if d["name"] == "train")
    config = parse_overrides(overrides)
    # placement whole: a partial pool mapping in `config` is not merged onto the default pools
    # (only dotted overrides are, by load_config), so each pool is given complete here
    config["placement"] = load_config(None, overrides).placement.model_dump(mode="json")
    dep["parameters"] = {"config": config}
    dep["work_pool"] = {"name": work_pool, "job_variables": {}}
    spec["deployments"] = [dep]
    spec.pop("definitions", None)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return dep


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _process_tree(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of ``root`` and all its descendants, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        started = _start_time(pid)
        if started is not None:
            out.add((pid, started))
        todo.extend(children.get(pid, []))
    return out


__all__ = ["REPO", "train_env", "start_train", "kill_group", "wait_train", "stop_process_tree"]
