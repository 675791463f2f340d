"""Issue 18: what a pool rank prints during a call reaches the calling task (workers/worker_logs.py,
workers/handles.py, tasks/common.py), without Ray: the streams are tees made by the test."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from workers import worker_logs as W
from workers.dispatch import get_dispatch


def test_captured_keeps_this_threads_output_and_writes_it_through(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", W._Tee(out))
    monkeypatch.setattr(sys, "stderr", W._Tee(err))
    handler = logging.StreamHandler(sys.stderr)  # like a library's handler made after install()
    logger = logging.getLogger("workers.test_capture")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with W.captured() as lines:
            print("generated 4 trajectories")
            logger.info("update: 2 optimizer steps")
            other = threading.Thread(target=print, args=("another thread's line",))
            other.start()
            other.join()
            assert lines == []  # filled when the block ends
    finally:
        logger.removeHandler(handler)
    assert lines[:2] == ["generated 4 trajectories", "update: 2 optimizer steps"]
    assert not any("another thread" in ln for ln in lines)
    assert "another thread's line" in out.getvalue() and "generated 4" in out.getvalue()  # still written
    assert "update: 2 optimizer steps" in err.getvalue()
    print("after the block")
    assert "after the block" not in lines


def test_python_warnings_are_captured_too():
    """Python's default showwarning writes to sys.stderr at the time of the warning (pytest records
    warnings itself, hence a fresh interpreter)."""
    code = ("import io, sys, warnings; from workers import worker_logs as W; "
            "sys.stderr = W._Tee(io.StringIO())\n"
            "with W.captured() as lines: warnings.warn('a worker warning', UserWarning)\n"
            "print(lines)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert "UserWarning: a worker warning" in out, out


def test_clip_bounds_lines_and_their_length():
    lines = W.clip(["x" * (W.MAX_LINE_CHARS + 5)] + ["y"] * (W.MAX_LINES + 3))
    assert len(lines) == W.MAX_LINES + 1 and lines[0].endswith(" …") and len(lines[0]) == W.MAX_LINE_CHARS + 2
    assert lines[-1] == "… 4 more line(s) in Ray's worker log"


def test_logged_call_returns_the_result_and_the_lines(monkeypatch):
    monkeypatch.setattr(sys, "stdout", W._Tee(io.StringIO()))

    class Host(W.LoggedCalls):
        def call(self, role, method, *args, **kwargs):
            print(f"{role}.{method} on {args[0]}")
            return args[0] * 2

    assert Host().call_logged("policy", "generate_sequences", 21) == (42, ["policy.generate_sequences on 21"])


def test_call_ranks_reemits_each_ranks_lines_and_a_task_forwards_them(monkeypatch):
    import workers.handles as H
    from tasks.common import worker_logs_to

    class Actor:
        def __init__(self, rank):
            self.call_logged = SimpleNamespace(remote=lambda role, method, *a, **k: (rank, [f"line of rank {rank}"]))

    monkeypatch.setattr(H.ray, "get", lambda ref, timeout=None: ref)
    pool = SimpleNamespace(actors=[Actor(0), Actor(1)], world_size=2, name="main")
    got = []
    run_logger = SimpleNamespace(log=lambda level, fmt, msg: got.append((level, fmt % msg)))
    with worker_logs_to(run_logger):
        assert H.call_ranks(pool, "policy", "ping", get_dispatch("broadcast"), (), {}) == [0, 1]
        elsewhere = threading.Thread(target=W.emit, args=("main", 3, "policy", "x", ["from another thread"]))
        elsewhere.start()
        elsewhere.join()
    H.call_ranks(pool, "policy", "ping", get_dispatch("broadcast"), (), {})  # after the block: not forwarded
    assert got == [(logging.INFO, "[main rank 0 policy.ping] line of rank 0"),
                   (logging.INFO, "[main rank 1 policy.ping] line of rank 1")]
    assert not logging.getLogger(W.WORKER_LOGGER).propagate  # never printed on the console by itself


def test_install_outside_a_ray_actor_leaves_the_streams_alone():
    before = (sys.stdout, sys.stderr)
    W.install()
    assert (sys.stdout, sys.stderr) == before
