"""What a pool worker prints while it serves a call, handed back to the caller (the Prefect task).

A pool rank is a plain Ray actor: Prefect's run logger does not work there, and in quiet mode
(``ray.init(log_to_driver=False)``, :func:`flows.console.ray_init_options`) its stdout/stderr
go only to Ray's session logs. So each rank tees its Python-level output (:func:`install`,
called once by :class:`workers.host.WorkerHost`): ``sys.stdout``/``sys.stderr`` keep writing
where they wrote (Ray's log files, or the driver's console with ``-v``) and, while a call runs
on that thread (:func:`captured`), a copy of the text is kept. ``WorkerHost.call_logged``
returns those lines with the result, and :func:`workers.handles.call_ranks` re-emits them in
the calling process on the ``hybridflow.worker_logs`` logger (:data:`WORKER_LOGGER`), which a
task routes to its Prefect run logger (:func:`tasks.common.worker_logs_to_prefect`).

Covered: ``print``, ``warnings``, and every ``logging`` handler that writes to sys.stdout/stderr
(this package's ``workers.*`` / ``hybridflow.*`` loggers at INFO, transformers' own handler).
Not covered: output written by C/C++ code straight to file descriptors 1 and 2 (gloo, NCCL,
vLLM's engine process): it stays in Ray's logs. Lines reach Prefect when the call returns, not
while it runs; a call that raises loses its lines there (they are still in Ray's logs).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

WORKER_LOGGER = "hybridflow.worker_logs"
MAX_LINES = 200  # per call; the rest is summarised in one line
MAX_LINE_CHARS = 2000
OWN_LOGGERS = ("workers", "hybridflow")  # logged at INFO in pool ranks

_local = threading.local()
_installed = False


class _Tee:
    """A text stream that writes through to ``stream`` and keeps a copy while this thread captures."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        chunks = getattr(_local, "chunks", None)
        if chunks is not None:
            chunks.append(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty, buffer, ...
        return getattr(self._stream, name)


def install() -> None:
    """In a Ray actor: tee this process's sys.stdout/sys.stderr (once), point existing logging
    handlers that wrote to the old streams at the tees, and log this package's loggers at INFO
    to stderr. Elsewhere (a WorkerHost built by a test, the driver) it does nothing."""
    global _installed
    if _installed or not _in_actor():
        return
    old = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
    sys.stdout, sys.stderr = _Tee(sys.stdout), _Tee(sys.stderr)
    loggers = [logging.getLogger()] + [v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger)]  # fmt: skip
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and id(h.stream) in old:
                h.setStream(getattr(sys, old[id(h.stream)]))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in OWN_LOGGERS:
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.addHandler(handler)
        lg.propagate = False
    _installed = True


def _in_actor() -> bool:
    import ray

    return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id())


@contextmanager
def captured() -> Iterator[list[str]]:
    """Collect what this thread writes to sys.stdout/sys.stderr inside the block (after
    :func:`install`); the yielded list is filled with its non-blank lines when the block exits
    (at most :data:`MAX_LINES`, each cut at :data:`MAX_LINE_CHARS` characters)."""
    lines: list[str] = []
    outer = getattr(_local, "chunks", None)
    _local.chunks = chunks = []
    try:
        yield lines
    finally:
        _local.chunks = outer
        text = "".join(chunks)
        if outer is not None:
            outer.append(text)
        lines.extend(clip([ln for ln in text.splitlines() if ln.strip()]))


def clip(lines: list[str]) -> list[str]:
    """At most MAX_LINES lines of at most MAX_LINE_CHARS characters; a last line says what was cut."""
    out = [ln if len(ln) <= MAX_LINE_CHARS else ln[:MAX_LINE_CHARS] + " …" for ln in lines[:MAX_LINES]]
    if len(lines) > MAX_LINES:
        out.append(f"… {len(lines) - MAX_LINES} more line(s) in Ray's worker log")
    return out


class LoggedCalls:
    """Mixin of :class:`workers.host.WorkerHost` (which has ``call``): ``call_logged`` = ``call``
    + the lines it printed."""

    def call_logged(self, role: str, method: str, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
        """``(self.call(role, method, ...), lines this thread printed meanwhile)`` (:func:`captured`)."""
        with captured() as lines:
            result = self.call(role, method, *args, **kwargs)
        return result, lines


def emit(pool: str, rank: int, role: str, method: str, lines: list[str]) -> None:
    """Re-emit a rank's lines in this process on :data:`WORKER_LOGGER` at INFO, prefixed
    ``[<pool> rank <r> <role>.<method>]``."""
    logger = logging.getLogger(WORKER_LOGGER)
    for line in lines:
        logger.info("[%s rank %d %s.%s] %s", pool, rank, role, method, line)


# the re-emitted copies go only where a task attaches a handler (never to the console by themselves)
_worker_logger = logging.getLogger(WORKER_LOGGER)
_worker_logger.addHandler(logging.NullHandler())
_worker_logger.setLevel(logging.INFO)
_worker_logger.propagate = False

__all__ = ["WORKER_LOGGER", "LoggedCalls", "captured", "clip", "emit", "install"]
