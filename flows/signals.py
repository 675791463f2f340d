"""One shutdown path for every signal a command can get: SIGINT (Ctrl-C), SIGTERM (``kill``,
``timeout``, a scheduler, Kubernetes) and SIGHUP (the terminal went away).

:func:`install` (called by the CLI, and again by :func:`flows.services.services` after ``ray.init``,
which installs its own SIGTERM handler) puts :func:`_handle` in charge of the three signals, and
keeps it in charge inside flow runs: Prefect's flow engine would otherwise replace the SIGTERM
handler with its own, which raises ``TerminationSignal`` wherever the main thread is (inside
``ray.get`` that surfaces as a ``SystemError``, with tracebacks and a wrong stop reason).

The first signal records a :class:`StopSignal` (:func:`received`: the stop reason ``interrupted``,
``terminated`` or ``hangup``, and the exit status 128 + signal number), raises :class:`Stopped`
(a KeyboardInterrupt: Ray and Prefect unwind on it as on Ctrl-C) in the main thread, so the
``finally`` blocks record the reason, release the run lock and stop the servers, and starts a
watchdog that ends the process after :data:`GRACE_S` if unwinding hangs. A second signal, or the
watchdog, ends the process at once (:func:`exit_now`): the run lock released, the one line printed,
and what the run started ended by the reaper (:mod:`flows.reaper`), which watches this process.
Whatever exception then reaches the CLI, :func:`received` decides the exit: one line, 130/143/129.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

REASONS: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hangup"}
GRACE_S = 25.0  # after the first signal, the process ends by then even if unwinding hangs (one line within 30 s)

_received: StopSignal | None = None
_timer: threading.Timer | None = None
_deferred = False  # the first signal's Stopped was dropped by Python and is being delivered again (_unraisable)
DEFER_S = 0.05


@dataclass(frozen=True)
class StopSignal:
    """The first stop signal this process got. ``reason``: ``interrupted`` | ``terminated`` |
    ``hangup``; ``exit_code``: 128 + ``signum`` (130, 143, 129)."""

    signum: int
    reason: str

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        """The one line the command ends with."""
        return f"run stopped: {self.reason} ({self.name})"


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by the first stop signal; its text is the stop reason."""

    def __init__(self, stop: StopSignal) -> None:
        super().__init__(f"{stop.reason} ({stop.name})")
        self.stop = stop


def received() -> StopSignal | None:
    """The first stop signal this process got, or None."""
    return _received


def stop_reason(error: BaseException) -> StopSignal | None:
    """The stop signal behind ``error``: the one received, whatever the exception became on the way
    (Ray, Prefect and C extensions may wrap it), or a bare KeyboardInterrupt (Ctrl-C without
    :func:`install`) as ``interrupted``."""
    if _received is not None:
        return _received
    if isinstance(error, KeyboardInterrupt):
        return StopSignal(signal.SIGINT, REASONS[signal.SIGINT])
    return None


def exit_now(stop: StopSignal) -> None:
    """End the process now: release the run locks this process holds, print the one line, exit
    ``stop.exit_code`` (children are ended by the reaper, which sees this process go)."""
    from flows.run_lock import release_all

    try:
        release_all()
        print(stop.line(), file=sys.stderr, flush=True)
    finally:
        os._exit(stop.exit_code)


def _watchdog(stop: StopSignal, grace_s: float) -> None:
    global _timer
    _timer = threading.Timer(grace_s, exit_now, args=(stop,))
    _timer.daemon = True
    _timer.start()


def reset() -> None:
    """Forget the signal received and stop its watchdog (for tests that signal their own process)."""
    global _received, _timer, _deferred
    if _timer is not None:
        _timer.cancel()
    _received, _timer, _deferred = None, None, False


def _redeliver(signum: int) -> None:
    """Send ``signum`` to this process again in :data:`DEFER_S` (its handler then raises anew)."""
    timer = threading.Timer(DEFER_S, os.kill, args=(os.getpid(), signum))
    timer.daemon = True
    timer.start()


def _unraisable(unraisable: Any) -> None:
    """``sys.unraisablehook``: Python drops an exception raised where it cannot propagate (an
    object's ``__del__``, a weakref callback such as SQLAlchemy's ``_collection_gced``, a GC
    callback) and reports it here. The main thread may be in any of them when the signal comes
    (seen in real train runs, which then trained on to the end and exited 0); a :class:`Stopped`
    dropped so is delivered again a moment later, once that code has returned. Anything else goes
    to the hook that was there before."""
    global _deferred
    if isinstance(unraisable.exc_value, Stopped) and _received is not None:
        _deferred = True
        _redeliver(_received.signum)
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook


def _handle(signum: int, frame: Any) -> None:
    global _received, _deferred
    if _received is not None and not _deferred:  # the second signal: no more waiting
        exit_now(_received)
    if _received is None:
        _received = StopSignal(signum, REASONS.get(signum, signal.Signals(signum).name.lower()))
        _quiet_stop_noise()
        _watchdog(_received, GRACE_S)
    _deferred = False
    raise Stopped(_received)


def _caused_by_stop(error: BaseException | None) -> bool:
    """Whether ``error`` is a :class:`Stopped` or was raised while one was being handled."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Stopped):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class _StopNoise(logging.Filter):
    """After a stop signal, a log record that only describes our own stop is dropped: Prefect's
    ``Crash detected!`` lines, and any record whose exception is, or was raised while handling, a
    :class:`Stopped` (SQLAlchemy's ``Error closing cursor`` when the stop lands inside a SQLite
    fetch of MLflow's or Prefect's store; a library's ``logger.exception`` on the way out)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _received is None:
            return True
        if str(record.msg).startswith("Crash detected!"):
            return False
        return not (record.exc_info and _caused_by_stop(record.exc_info[1]))


def _quiet_stop_noise() -> None:
    """Put :class:`_StopNoise` on Prefect's run loggers and on every handler configured now (a
    record logged by a library's own logger reaches the handlers of its ancestors, past their
    loggers' filters)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _StopNoise) for f in logger.filters):
            logger.addFilter(_StopNoise())
    loggers = [logging.getLogger()] + [
        logger for logger in list(logging.Logger.manager.loggerDict.values()) if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            if not any(isinstance(f, _StopNoise) for f in handler.filters):
                handler.addFilter(_StopNoise())


def _keep_ours_in_flow_runs() -> None:
    """Prefect's flow engine enters ``capture_sigterm()`` for every flow run (and subflow), which
    installs Prefect's SIGTERM handler; in a process whose signals are ours it must not. Prefect's
    handler exists for runner-driven cancellation, which a CLI process does not have."""
    try:
        import prefect.flow_engine as engine
    except ImportError:  # pragma: no cover - prefect is a dependency
        return
    engine.capture_sigterm = contextlib.nullcontext


def install(*, prefect: bool = False) -> dict[int, Any] | None:
    """Put :func:`_handle` in charge of SIGINT, SIGTERM and SIGHUP; ``prefect``: also inside the
    Prefect flow runs of this process (imports Prefect: pass it once the command is about to run a
    flow, so a bad config is still reported fast). Returns the previous handlers by signal number
    (None off the main thread, where handlers cannot be set)."""
    global _previous_unraisablehook
    if threading.current_thread() is not threading.main_thread():
        return None
    if prefect:
        _keep_ours_in_flow_runs()
    if sys.unraisablehook is not _unraisable:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _unraisable
    return {s: signal.signal(s, _handle) for s in REASONS}


def restore(previous: dict[int, Any] | None) -> None:
    """Put back the handlers :func:`install` returned."""
    if previous and threading.current_thread() is threading.main_thread():
        for s, handler in previous.items():
            signal.signal(s, handler)
