"""The worker process of a :class:`hybridflow.procpool.ProcessPool`: loads its handler once, then
runs chunks of requests sent over a pipe.

A call kind's child module (e.g. ``hybridflow.rewards._worker``) runs as ``python -m MODULE FD``
(a fresh interpreter, like multiprocessing's ``spawn``, but without re-running the parent's
``__main__``, which breaks under ``python - < script`` and in Ray workers) and calls
:func:`serve` with its handler factory. FD is the child end of a ``multiprocessing`` Pipe; the
first message is ``(sys_path, setup, plugins)``. Protocol (tuples over the pipe):

- child → parent at start: ``("ready", info, batched)`` (``info``: the handler's, any picklable
  value) or ``("load_error", message)``.
- parent → child: ``("rows", call_id, [(row, request), ...])`` — run each request, answering
  ``("row", call_id, row, status, value)`` as each finishes (so the parent knows which row a
  hang or crash happened on); ``("batch", call_id, [(row, request), ...])`` — one batched call,
  answered by ``("batch", call_id, [(status, value), ...])``; ``("stop",)``.

A handler's ``call`` / ``call_batch`` return ``(status, value)`` outcomes; whatever they raise,
or a value that cannot be pickled back, becomes ``("error", one line naming the exception and
where it was raised)``. Nothing raised by
user code leaves this loop. Must stay importable without torch (a fast spawn).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

Outcome = tuple[str, Any]


class Handler(Protocol):
    """What a call kind's worker executes. ``info``: sent to the parent once loaded
    (:attr:`ProcessPool.info`); ``batched``: whether the parent may send "batch" units."""

    info: Any
    batched: bool

    def call(self, request: Any) -> Outcome:
        """One request → (status, value); may raise (an "error" outcome)."""
        ...

    def call_batch(self, requests: list[Any]) -> list[Outcome]:
        """Requests → one outcome each; may raise (every row an "error" outcome)."""
        ...


def error_outcome(e: BaseException) -> Outcome:
    """("error", "raised <Type>: <message, 300 chars at most> at <file>:<line>")."""
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    return "error", f"raised {type(e).__name__}: {str(e)[:300]}{at}"


def _send(conn: Any, msg: tuple[Any, ...], failed: Callable[[Outcome], tuple[Any, ...]]) -> None:
    """Send ``msg``; when its value cannot be pickled, send ``failed(error outcome)`` instead (the
    row fails, the worker lives on). A closed pipe (OSError) ends the worker."""
    try:
        conn.send(msg)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - pickling a user value can raise almost anything
        conn.send(failed(error_outcome(e)))


def _loop(conn: Any, handler: Handler) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        kind, call_id, rows = msg
        if kind == "rows":
            for row, request in rows:
                try:
                    status, value = handler.call(request)
                except BaseException as e:  # noqa: BLE001 - user code: report anything
                    status, value = error_outcome(e)
                _send(conn, ("row", call_id, row, status, value), lambda o, c=call_id, r=row: ("row", c, r, *o))
        else:
            try:
                out = handler.call_batch([r for _, r in rows])
            except BaseException as e:  # noqa: BLE001
                out = [error_outcome(e)] * len(rows)
            _send(conn, ("batch", call_id, out), lambda o, c=call_id, n=len(rows): ("batch", c, [o] * n))


def worker_main(conn: Any, make_handler: Callable[[Any], Handler], setup: Any, plugins: list[str]) -> None:
    """Import ``plugins``, build the handler from ``setup``, report ready (or the load error), serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    try:
        for mod in plugins:
            importlib.import_module(mod)
        handler = make_handler(setup)
        conn.send(("ready", handler.info, handler.batched))
    except BaseException as e:  # noqa: BLE001 - report anything, including SystemExit
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    _loop(conn, handler)


def _exit_with_parent() -> None:
    """Workers live in their own session, so a SIGKILLed parent would leave a hung one behind:
    a daemon thread ends this process once its parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def serve(make_handler: Callable[[Any], Handler]) -> None:
    """The child module's ``main``: the pipe is ``sys.argv[1]``; runs until "stop" or the pipe closes."""
    _exit_with_parent()
    conn = Connection(int(sys.argv[1]))
    sys_path, setup, plugins = conn.recv()
    sys.path[:] = sys_path
    worker_main(conn, make_handler, setup, plugins)


__all__ = ["Handler", "Outcome", "error_outcome", "serve", "worker_main"]
