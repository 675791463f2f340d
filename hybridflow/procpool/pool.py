"""A small process pool that survives hangs and crashes of the user code it runs.

Generic over a :class:`CallKind`: what the workers execute (a reward function scoring rows, an
environment's ``reset`` / ``step``, ...) with the kind's own request and response types. Each
worker is a fresh interpreter (``python -m <kind.child_module>``, in its own session; the child
loop is :func:`hybridflow.procpool.child.serve`) that loads its handler once. Work goes out in
small chunks of rows (a row = one request), one chunk in flight per worker (:data:`_DEPTH`):
free workers keep taking chunks from the queue, so a hung row holds up only its own worker and
the rest of its chunk. The child answers row by row, so the parent always knows which row is
running.

One deadline per call of :meth:`ProcessPool.run`: ``timeout_s`` from its start, the clock
stopped while no worker is up (all being replaced after a crash or a timeout). The rows of a
batch time out together, so a handler that hangs on every row costs one ``timeout_s`` per batch,
not one per row: at the deadline every row still running, or sent but not started, or still
queued, is a ``timeout``, and the workers that hold such rows have their process group killed
(SIGKILL) and are replaced. A worker that dies (``os._exit``, segfault, OOM kill) fails the
row it was on; the rest of its chunks go back to the queue. A batched call fails as a whole.
Every replaced worker counts in :attr:`ProcessPool.restarts`; no row is ever lost: each row of
a call comes back with an outcome.

Outcomes are ``(status, value)``: "ok" with the kind's response, "error" (the handler raised;
value = one line), "timeout", "crash" (value = what happened), or a status the kind defines
(rewards: "nan").
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

from hybridflow.procpool.child import Outcome  # (status, value): ok | error | timeout | crash | a kind's own

Row = tuple[int, Any]  # (row index, request of the pool's call kind)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_DEPTH = 1  # chunks in flight per worker; more would queue rows behind a row that may hang


class WorkerLoadError(RuntimeError):
    """A worker could not load its handler (or its plugins), or died while loading."""


class WorkerStartError(RuntimeError):
    """A worker did not start within ``start_timeout_s`` (not a failure of one row)."""


@dataclass(frozen=True)
class CallKind:
    """One kind of call a pool executes.

    name: in error messages ("reward", "environment"). child_module: the worker process, run as
    ``python -m child_module FD`` (its ``main`` calls :func:`hybridflow.procpool.child.serve` with
    the kind's handler; the name shows in ``ps``). loads: what a worker loads before it is ready
    ("the reward"), for the load error. load_error / start_error: the exception classes raised for
    a worker that cannot load (message first) / does not start in time.
    """

    name: str
    child_module: str
    loads: str
    load_error: type[Exception] = WorkerLoadError
    start_error: type[Exception] = WorkerStartError


@dataclass
class Unit:
    """A chunk of rows run by one worker: row by row ("rows") or in one batched call ("batch").
    worker: the index of the worker that must run it (a worker keeping state for it, e.g. a sticky
    environment instance), None = any. A pinned unit waits for its worker, replaced or not."""

    kind: str
    rows: list[Row]
    worker: int | None = None


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Any
    pidfd: int | None
    started: float
    ready: bool = False
    units: deque[Unit] = field(default_factory=deque)  # sent, not finished; the first is running
    done: set[int] = field(default_factory=set)  # rows of units[0] answered


def _start_worker(child_module: str, init: tuple[Any, ...]) -> _Worker:
    parent, child = mp.Pipe(duplex=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", child_module, str(child.fileno())],
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
    """``num_workers`` processes executing calls of one :class:`CallKind`.

    setup: picklable, handed to the kind's handler factory in each worker (e.g. the reward spec and
    config). plugins: modules each worker imports first (off the call clock). After
    :meth:`wait_ready`, ``info`` is what the handler reported when it was ready (the kind's type)
    and ``batched`` whether it takes "batch" units. ``restarts``: workers replaced since start.
    """

    def __init__(self, kind: CallKind, setup: Any, plugins: list[str] | tuple[str, ...], num_workers: int,
                 start_timeout_s: float = 120.0) -> None:  # fmt: skip
        self.kind = kind
        self._init = (list(sys.path), setup, list(plugins))
        self._start_timeout_s = start_timeout_s
        self.info: Any = None
        self.batched = False
        self.restarts = 0
        self._call = 0
        self._timeout_s = 0.0
        self._pending: deque[Unit] = deque()
        self._out: dict[int, Outcome] = {}
        self._workers = [_start_worker(kind.child_module, self._init) for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    # ---- lifecycle -------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Block until every worker has loaded its handler; raises ``kind.load_error`` / ``kind.start_error``."""
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
        self._workers[i] = _start_worker(self.kind.child_module, self._init)
        self.restarts += 1

    # ---- calls -----------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def run(self, units: list[Unit], timeout_s: float) -> dict[int, Outcome]:
        """Run all rows of ``units`` within one deadline, ``timeout_s`` from now; returns
        {row index: (status, value)} for every row (see the module docstring). A unit pinned to a
        worker (``Unit.worker``) runs only there. Raises ValueError for a pin outside the pool."""
        bad = [u.worker for u in units if u.worker is not None and not 0 <= u.worker < len(self._workers)]
        if bad:
            raise ValueError(f"units pinned to worker {bad[0]} of a pool of {len(self._workers)}")
        self.wait_ready()  # workers replaced after the last call load first: not on this call's clock
        self._call += 1
        self._timeout_s = timeout_s
        self._pending = deque(units)
        self._out = {}
        want = sum(len(u.rows) for u in units)
        deadline = time.monotonic() + timeout_s
        while len(self._out) < want:
            if time.monotonic() >= deadline:
                self._time_out_the_rest()
                break
            for i, w in enumerate(self._workers):
                while w.ready and len(w.units) < _DEPTH:
                    unit = next((u for u in self._pending if u.worker is None or u.worker == i), None)
                    if unit is None or not self._assign(w, unit):
                        break
                    self._pending.remove(unit)
            starting, t0 = not any(w.ready for w in self._workers), time.monotonic()
            self._poll(deadline)
            if starting:  # no worker could run (all replaced after a crash): that time is not the rows'
                deadline += time.monotonic() - t0
        return self._out

    def _assign(self, w: _Worker, unit: Unit) -> bool:
        """Send ``unit`` to ``w``; False when ``w`` died while idle (killed between calls, the OOM
        killer): the unit stays queued and the next poll replaces the worker, no row failed."""
        try:
            w.conn.send((unit.kind, self._call, unit.rows))
        except OSError:  # BrokenPipeError / ConnectionResetError: nobody reads the other end
            return False
        if not w.units:
            w.done = set()
        w.units.append(unit)
        return True

    def _time_out_the_rest(self) -> None:
        """At the deadline: every row not answered is a timeout; workers holding rows are replaced."""
        running = f"still running at the deadline ({self._timeout_s:g} s for the batch); worker killed"
        behind = f"not started before the deadline ({self._timeout_s:g} s for the batch): queued behind a hung row"
        queued = f"not started before the deadline ({self._timeout_s:g} s for the batch)"
        for i, w in enumerate(self._workers):
            if not w.units:
                continue
            for k, unit in enumerate(w.units):
                left = [row for row, _ in unit.rows if k > 0 or row not in w.done]
                n_running = 0 if k > 0 else len(left) if unit.kind == "batch" else 1
                for j, row in enumerate(left):
                    self._out[row] = ("timeout", running if j < n_running else behind)
            w.units.clear()
            self._replace(i)
        for unit in self._pending:
            for row, _ in unit.rows:
                self._out[row] = ("timeout", queued)
        self._pending.clear()

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
            elif not w.ready and time.monotonic() - w.started > self._start_timeout_s:
                raise self.kind.start_error(f"{self.kind.name} worker did not start within {self._start_timeout_s:g} s")

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
            w.ready, self.info, self.batched = True, msg[1], bool(msg[2])
        elif msg[0] == "load_error":
            raise self.kind.load_error(f"{self.kind.name} worker could not load {self.kind.loads}: {msg[1]}")
        elif msg[1] != self._call or not w.units:
            return  # an answer to a call that was already given up on
        elif msg[0] == "row":
            _, _, row, status, value = msg
            self._out[row] = (status, value)
            w.done.add(row)
            if len(w.done) == len(w.units[0].rows):
                w.units.popleft()
                w.done = set()
        elif msg[0] == "batch":
            for (row, _), outcome in zip(w.units.popleft().rows, msg[2], strict=True):
                self._out[row] = outcome
            w.done = set()

    def _fail_current(self, w: _Worker, status: str, message: str) -> None:
        """Fail the row ``w`` was on (every row, for a batch); requeue the rest of its chunks."""
        if not w.ready:
            k = self.kind
            raise k.load_error(f"{k.name} worker died while loading {k.loads} (exit code {w.proc.returncode})")
        if not w.units:
            return
        head = w.units.popleft()
        left = [r for r in head.rows if r[0] not in w.done]
        failed = left if head.kind == "batch" else left[:1]
        for row, _ in failed:
            self._out[row] = (status, message)
        rest = ([Unit(head.kind, left[len(failed) :], head.worker)] if len(left) > len(failed) else []) + list(w.units)
        self._pending.extendleft(reversed(rest))
        w.units.clear()
        w.done = set()


__all__ = ["CallKind", "Outcome", "ProcessPool", "Row", "Unit", "WorkerLoadError", "WorkerStartError"]
