"""A small process pool for reward functions that survives hangs and crashes of user code.

Each worker is a fresh interpreter (``python -m hybridflow.rewards._worker``, in its own
session) that loads the scorer once. Work goes out in chunks of rows; the child answers row
by row, so the parent always knows which row is running. A row that runs past ``timeout_s``
(measured from the previous answer of that worker) gets its worker's process group killed
(SIGKILL) and the worker replaced; a worker that dies (``os._exit``, segfault, OOM kill)
fails the row it was on; in both cases the rest of the chunk goes again to a live worker.
A batched call fails as a whole.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.rewards.loader import RewardLoadError

Row = tuple[int, tuple[Any, ...]]  # (row index, payload)
Outcome = tuple[str, Any]  # (status, value): ok | nan | error | timeout | crash
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class RewardWorkerError(RuntimeError):
    """A reward worker could not be started (not a failure of one row)."""


@dataclass
class Unit:
    """A chunk of rows scored by one worker: row by row ("rows") or in one call ("batch")."""

    kind: str
    rows: list[Row]


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Any
    pidfd: int | None
    started: float
    ready: bool = False
    unit: Unit | None = None
    done: set[int] = field(default_factory=set)
    deadline: float = 0.0


def _start_worker(init: tuple[Any, ...]) -> _Worker:
    parent, child = mp.Pipe(duplex=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.rewards._worker", str(child.fileno())],
        pass_fds=(child.fileno(),), env=env, start_new_session=True,
    )  # fmt: skip
    child.close()
    parent.send(init)
    try:
        pidfd: int | None = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: exits are found by polling
        pidfd = None
    return _Worker(proc, parent, pidfd, time.monotonic())


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            w.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        w.conn.close()
        if w.pidfd is not None:
            os.close(w.pidfd)
            w.pidfd = None


class ProcessPool:
    """``num_workers`` reward processes for one scorer (rule rewards when ``spec`` is None)."""

    def __init__(self, spec: str | None, cfg_dict: dict[str, Any], plugins: list[str], num_workers: int,
                 start_timeout_s: float = 120.0) -> None:  # fmt: skip
        self._init = (list(sys.path), spec, cfg_dict, list(plugins))
        self._start_timeout_s = start_timeout_s
        self.reward_names: list[str] = []
        self.batched = False
        self.restarts = 0
        self._call = 0
        self._timeout_s = 0.0
        self._pending: deque[Unit] = deque()
        self._out: dict[int, Outcome] = {}
        self._workers = [_start_worker(self._init) for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    # ---- lifecycle -------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Block until every worker has loaded the scorer; raise RewardLoadError / RewardWorkerError."""
        while not all(w.ready for w in self._workers):
            self._poll(time.monotonic() + 0.5)

    def close(self) -> None:
        """Stop the workers (politely, then SIGKILL after 2 s)."""
        for w in self._workers:
            try:
                w.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()  # kills what is left, closes pipes; runs once

    def _replace(self, i: int) -> None:
        _kill_all([self._workers[i]])
        self._workers[i] = _start_worker(self._init)
        self.restarts += 1

    # ---- scoring ---------------------------------------------------------------------------
    def run(self, units: list[Unit], timeout_s: float) -> dict[int, Outcome]:
        """Score all rows of ``units``; returns {row index: (status, value)} for every row."""
        self._call += 1
        self._timeout_s = timeout_s
        self._pending = deque(units)
        self._out = {}
        want = sum(len(u.rows) for u in units)
        while len(self._out) < want:
            for w in self._workers:
                if w.ready and w.unit is None and self._pending:
                    self._assign(w, self._pending.popleft())
            busy = [w.deadline for w in self._workers if w.unit is not None]
            self._poll(min(busy) if busy else time.monotonic() + 0.5)
        return self._out

    def _assign(self, w: _Worker, unit: Unit) -> None:
        w.unit, w.done = unit, set()
        w.deadline = time.monotonic() + self._timeout_s
        w.conn.send((unit.kind, self._call, unit.rows))

    def _poll(self, until: float) -> None:
        waitables: list[Any] = [w.conn for w in self._workers]
        waitables += [w.pidfd for w in self._workers if w.pidfd is not None]
        cap = 0.1 if any(w.pidfd is None for w in self._workers) else 60.0
        mpc.wait(waitables, timeout=min(cap, max(0.0, until - time.monotonic())))
        for i, w in enumerate(self._workers):
            pipe_open = self._drain(w)
            if not pipe_open or w.proc.poll() is not None:
                try:
                    w.proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
                self._fail_current(w, "crash", f"worker process died (exit code {w.proc.returncode})")
                self._replace(i)
            elif w.unit is not None and time.monotonic() > w.deadline:
                self._fail_current(w, "timeout", f"still running after {self._timeout_s:g} s; worker killed")
                self._replace(i)
            elif not w.ready and time.monotonic() - w.started > self._start_timeout_s:
                raise RewardWorkerError(f"reward worker did not start within {self._start_timeout_s:g} s")

    def _drain(self, w: _Worker) -> bool:
        """Handle every message waiting from ``w``; False when its pipe is closed."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, w: _Worker, msg: tuple[Any, ...]) -> None:
        if msg[0] == "ready":
            w.ready, self.reward_names, self.batched = True, list(msg[1]), bool(msg[2])
        elif msg[0] == "load_error":
            raise RewardLoadError(f"reward worker could not load the reward: {msg[1]}")
        elif msg[1] != self._call or w.unit is None:
            return  # an answer to a call that was already given up on
        elif msg[0] == "row":
            _, _, row, status, value = msg
            self._out[row] = (status, value)
            w.done.add(row)
            w.deadline = time.monotonic() + self._timeout_s
            if len(w.done) == len(w.unit.rows):
                w.unit = None
        elif msg[0] == "batch":
            for (row, _), outcome in zip(w.unit.rows, msg[2], strict=True):
                self._out[row] = outcome
            w.unit = None

    def _fail_current(self, w: _Worker, status: str, message: str) -> None:
        """Fail the row ``w`` was on (every row, for a batch); requeue the rest of its chunk."""
        if not w.ready:
            raise RewardLoadError(f"reward worker died while loading the reward (exit code {w.proc.returncode})")
        if w.unit is None:
            return
        left = [r for r in w.unit.rows if r[0] not in w.done]
        failed = left if w.unit.kind == "batch" else left[:1]
        for row, _ in failed:
            self._out[row] = (status, message)
        if len(left) > len(failed):
            self._pending.appendleft(Unit(w.unit.kind, left[len(failed) :]))
        w.unit = None


__all__ = ["ProcessPool", "Unit", "RewardWorkerError"]
