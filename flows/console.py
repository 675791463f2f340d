"""What a person reads on the console while a run trains.

- On a terminal: one live display per run (rich): iteration k/N with elapsed time and ETA, the
  dataflow nodes in progress (read from the run's ``execution_log.jsonl``, which every node
  appends to when its body starts), the phase in progress with its count (``generating:
  trajectories 24/32``, ``updating policy: micro-batch 3/8``: what the pool ranks report in
  ``<run_dir>/progress/``, :mod:`workers.progress`), and the headline metrics of the last iteration.
- Elsewhere (CI, a log file, a Prefect worker): one plain line per iteration and one per
  validation.
- Quiet by default (``configure_console_logging``): Prefect's per-flow/task-run INFO lines
  (``Finished in state Completed()``) and Ray's ``(pid=...)``-prefixed worker output stay off
  the console; they still reach Prefect's API logs (each task logs through its run logger, and
  what a pool rank prints during a task's call is forwarded there: :mod:`workers.worker_logs`).
  ``-v`` brings them back.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from hybridflow.layout import EXECUTION_LOG
from workers.progress import PhaseProgress, read_progress

CONSOLE_ENV = "HYBRIDFLOW_CONSOLE"  # "quiet" (the CLI's default) or "verbose" (-v); unset: as Prefect/Ray default

# (metric, short label, format) shown per iteration; missing ones are left out
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/ppo_kl", "kl", "{:.4f}"),
    ("actor/pg_clipfrac", "clip", "{:.3f}"),
    ("actor/pg_loss", "pg_loss", "{:.4f}"),
    ("timing_s/gen", "gen", "{:.1f}s"),
    ("timing_s/update_actor", "update", "{:.1f}s"),
    ("timing_s/step", "step", "{:.1f}s"),
)


# the unit each phase counts (workers.progress); other phases show a bare done/total
PHASE_UNITS = {"generating": "trajectories", "validating": "trajectories",
               "updating policy": "micro-batch", "updating critic": "micro-batch"}


def phase_text(p: PhaseProgress) -> str:
    """``generating: trajectories 24/32``, ``updating policy: micro-batch 3/8`` (``done`` once complete)."""
    unit = PHASE_UNITS.get(p.phase, "")
    text = f"{p.phase}: {unit + ' ' if unit else ''}{p.done}/{p.total}"
    return text + ("  done" if p.total and p.done >= p.total else "")


def configure_console_logging(verbose: bool) -> None:
    """Choose what reaches the console; call before prefect is imported (its logging config
    reads ``PREFECT_LOGGING_*`` overrides from the environment when it is loaded). Ray workers
    inherit the environment, so their Prefect loggers follow the same setting."""
    os.environ[CONSOLE_ENV] = "verbose" if verbose else "quiet"
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # "Creating initial MLflow database tables..."
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def storage_error_line(exc: BaseException) -> str | None:
    """``error: <message>`` for a CheckpointError, or an OSError of a full disk or quota (ENOSPC,
    EDQUOT), anywhere in ``exc``'s chain (Ray wraps a worker's error as RayTaskError(...) with the
    error as ``.cause``, Prefect re-raises it from the task); None otherwise. How a run's failed
    write reads on the console: one line, naming the file and what to do."""
    from workers.checkpoint import CheckpointError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)  # RayTaskError keeps the worker's exception as .cause
        if isinstance(cause, (CheckpointError, OSError)):
            e = cause
        if isinstance(e, CheckpointError):
            return "error: " + " ".join(str(e.args[0] if e.args else e).split("\n")[0].split())
        if isinstance(e, OSError) and e.errno in FULL_DISK_ERRNOS:
            where = f" writing {e.filename}" if e.filename else ""
            return (f"error: {os.strerror(e.errno)}{where}: free space, then continue the run with "
                    "hybridflow train --resume <run dir> (nothing completed is lost)")
        e = e.__cause__ or e.__context__
    return None


def quiet() -> bool:
    return os.environ.get(CONSOLE_ENV) == "quiet"


def ray_init_options() -> dict[str, Any]:
    """``ray.init`` options for the console mode: quiet keeps workers' stdout/stderr in Ray's
    session logs (``/tmp/ray/session_latest/logs``) instead of prefixing them onto the driver's."""
    if not quiet():
        return {"log_to_driver": True}
    import logging

    return {"log_to_driver": False, "logging_level": logging.WARNING}


def headline(metrics: dict[str, float]) -> str:
    """``score 0.250  len 31.2  kl 0.0012 ...`` from the metrics present."""
    parts = [f"{label} {fmt.format(metrics[k])}" for k, label, fmt in HEADLINE if _finite(metrics.get(k))]
    return "  ".join(parts)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


class RunConsole:
    """The console of one run. ``live=None``: a live display when ``stream`` is a terminal and
    the console is not verbose, plain lines otherwise. ``progress(since)``: the phases the workers
    reported since ``since`` (epoch seconds); default: :func:`workers.progress.read_progress` of
    ``run_dir``."""

    def __init__(self, run_id: str, run_dir: str, total_iterations: int, start_iteration: int = 1, *,
                 stream: IO[str] | None = None, live: bool | None = None,
                 progress: Callable[[float], list[PhaseProgress]] | None = None):
        self.run_id, self.run_dir, self.total = run_id, run_dir, total_iterations
        self.start_iteration = start_iteration
        self.stream = stream or sys.stdout
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.live_mode = (isatty and not os.environ.get(CONSOLE_ENV) == "verbose") if live is None else live
        self.t0 = time.monotonic()
        self.current = start_iteration
        self.done = 0
        self.last: dict[str, float] = {}
        self.last_val = ""
        self._live: Any = None
        self.progress = progress or (lambda since: read_progress(run_dir, since))
        self.phases_since = time.time()  # progress reported before this belongs to finished work

    # ---- lifecycle ----
    def start(self) -> None:
        if self.live_mode:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self, console=Console(file=self.stream), refresh_per_second=2, transient=False)
            self._live.start()
        else:
            self._line(f"run {self.run_id}: iterations {self.start_iteration}..{self.total} in {self.run_dir}")

    def iteration_started(self, it: int) -> None:
        self.current = it

    def iteration_done(self, it: int, metrics: dict[str, float]) -> None:
        self.done += 1
        self.current = it + 1
        self.last = dict(metrics)
        self.phases_since = time.time()
        if not self.live_mode:
            self._line(f"iteration {it}/{self.total}  {headline(metrics)}  ETA {_fmt_s(self.eta())}")

    def validation_done(self, it: int, metrics: dict[str, float]) -> None:
        accs = {k.removeprefix("val-core/"): v for k, v in metrics.items() if k.startswith("val-core/")}
        self.last_val = ", ".join(f"{k} {v:.3f}" for k, v in accs.items())
        self.phases_since = time.time()
        if not self.live_mode and accs:
            self._line(f"validation {'before training' if it == 0 else f'after iteration {it}'}: {self.last_val}")

    def stopped(self, reason: str) -> None:
        self.close()
        self._line(f"run stopped: {reason}")

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    # ---- what the live display shows ----
    def eta(self) -> float | None:
        if not self.done:
            return None
        per_iteration = (time.monotonic() - self.t0) / self.done
        return per_iteration * max(self.total - (self.current - 1), 0)

    def phase(self) -> str:
        """The nodes of the current iteration that have started, from the execution log."""
        path = Path(self.run_dir) / EXECUTION_LOG
        try:
            lines = path.read_text().splitlines()[-20:]
        except OSError:
            return "starting"
        nodes = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("iteration") == self.current:
                nodes.append(str(rec.get("node")))
        return (" → ".join(dict.fromkeys(nodes)) + " …") if nodes else "starting"

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        done = min(self.current - 1, self.total)
        grid.add_row(f"[bold]train {self.run_id}[/]",
                     ProgressBar(total=max(self.total, 1), completed=done, width=30),
                     f"iteration {min(self.current, self.total)}/{self.total}",
                     f"elapsed {_fmt_s(time.monotonic() - self.t0)}  ETA {_fmt_s(self.eta())}")
        lines = [grid, f"  in progress: {self.phase()}"]
        lines += self._phase_rows()
        if self.last:
            lines.append(f"  last iteration: {headline(self.last)}")
        if self.last_val:
            lines.append(f"  validation: {self.last_val}")
        return Group(*lines)

    def _phase_rows(self) -> list[Any]:
        """One row per phase the workers reported since the last iteration or validation ended,
        with a bar; nothing when the reporter has nothing (or fails: the display never does)."""
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        try:
            phases = self.progress(self.phases_since)
        except Exception:
            return []
        rows = []
        for p in phases:
            row = Table.grid(padding=(0, 2))
            row.add_row(f"  {phase_text(p)}", ProgressBar(total=max(p.total, 1), completed=p.done, width=20))
            rows.append(row)
        return rows

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
