"""Live progress of a worker's long calls, for the driver's console (``flows/console.py``).

Workers report ``(phase, done, total)`` while they work: ``generating`` / ``validating``
(trajectories finished / trajectories this rank generates), ``updating policy`` /
``updating critic`` (micro-batches run / micro-batches of this update on this rank). A
:class:`FileProgress` keeps the latest report of each phase of one pool rank as a small JSON file
in the run directory (``<run_dir>/progress/<pool>.<rank>.<phase>.json``, replaced atomically,
the same shared folder the batches and ``pool_events.jsonl`` live in), so a driver on another
node reads it with :func:`read_progress` without any call into the workers.

Reporting never slows or breaks the work it describes: writes are throttled (at most one per
``min_interval_s`` per phase, plus the final ``done == total``), an OSError disables the reporter
for the rest of the process, and a worker built outside a pool (unit tests, ``hybridflow export``)
has :data:`NO_PROGRESS`, which does nothing.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PROGRESS_DIR = "progress"
Tick = Callable[[int, int], None]  # (done, total)


class ProgressSink:
    """Where a worker reports progress. This base class drops every report (:data:`NO_PROGRESS`)."""

    def report(self, phase: str, done: int, total: int) -> None:
        """``done`` of ``total`` units of ``phase`` (ints ≥ 0) are finished on this rank."""

    def tick(self, phase: str) -> Tick:
        """``report`` bound to ``phase``: the ``(done, total)`` callback engines and loops take."""
        return lambda done, total: self.report(phase, done, total)


NO_PROGRESS = ProgressSink()


@dataclass
class Countdown:
    """Units of work done out of a known ``total``, reported to ``tick`` at each :meth:`advance`
    (an update's micro-batches); ``tick`` None counts silently."""

    tick: Tick | None
    total: int
    done: int = 0

    def advance(self, units: int = 1) -> None:
        self.done += units
        if self.tick is not None and self.total > 0:
            self.tick(min(self.done, self.total), self.total)


def _slug(phase: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", phase.lower()).strip("-") or "phase"


class FileProgress(ProgressSink):
    """The latest report of each phase of pool ``pool`` rank ``rank`` as a file in ``directory``.

    directory: ``<run_dir>/progress`` (created on the first write). min_interval_s: the least time
    between two writes of one phase, except a report with ``done >= total`` (always written).
    clock: a ``time.monotonic``-like function (tests). The record: ``{"phase", "done", "total",
    "pool", "rank", "pid", "t"}`` with ``t`` = ``time.time()`` (seconds since the epoch).
    """

    def __init__(self, directory: str, pool: str, rank: int, *, min_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.directory, self.pool, self.rank = directory, pool, rank
        self.min_interval_s, self.clock = min_interval_s, clock
        self._last: dict[str, float] = {}
        self.disabled = False

    def report(self, phase: str, done: int, total: int) -> None:
        if self.disabled:
            return
        now = self.clock()
        if done < total and now - self._last.get(phase, -float("inf")) < self.min_interval_s:
            return
        self._last[phase] = now
        record = {"phase": phase, "done": int(done), "total": int(total), "pool": self.pool, "rank": self.rank,
                  "pid": os.getpid(), "t": time.time()}
        path = os.path.join(self.directory, f"{self.pool}.{self.rank}.{_slug(phase)}.json")
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except OSError:
            self.disabled = True  # a full or read-only disk: training goes on without progress


def run_progress_dir(run_dir: str) -> str:
    """``<run_dir>/progress``: where a run's workers keep their progress files."""
    return os.path.join(run_dir, PROGRESS_DIR)


def progress_for_run(ckpt_root: str | None, pool: str, rank: int) -> ProgressSink:
    """The sink of a pool rank of the run that owns ``ckpt_root`` (``<run_dir>/checkpoints``);
    :data:`NO_PROGRESS` without one (an evaluation's or a debug node's pools) or when the run
    folder is a remote URI (``s3://...``: no small files rewritten twice a second there)."""
    if not ckpt_root or ("://" in ckpt_root and not ckpt_root.startswith("file://")):
        return NO_PROGRESS
    ckpt_root = ckpt_root.removeprefix("file://")
    return FileProgress(run_progress_dir(os.path.dirname(os.path.normpath(ckpt_root))), pool, rank)


@dataclass(frozen=True)
class PhaseProgress:
    """One phase over all ranks: done/total summed over the ranks (generation: each rank has its
    own trajectories; an update: each rank its own micro-batches); updated: the latest ``t``."""

    phase: str
    done: int
    total: int
    updated: float


def read_progress(run_dir: str, since: float = 0.0) -> list[PhaseProgress]:
    """The phases reported in ``run_dir`` with a record at or after ``since`` (epoch seconds), the
    one reported last at the end. Unreadable or half-written files are skipped; no folder: []."""
    folder = run_progress_dir(run_dir)
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".json")]
    except OSError:
        return []
    records: list[dict[str, Any]] = []
    for name in names:
        try:
            with open(os.path.join(folder, name)) as f:
                rec = json.load(f)
            if float(rec["t"]) >= since:
                records.append(rec)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return summarize(records)


def summarize(records: list[dict[str, Any]]) -> list[PhaseProgress]:
    """Records (as :class:`FileProgress` writes them) → one :class:`PhaseProgress` per phase."""
    phases: dict[str, PhaseProgress] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        p = phases.get(r["phase"])
        if p is None:
            phases[r["phase"]] = PhaseProgress(r["phase"], int(r["done"]), int(r["total"]), r["t"])
        else:
            phases[r["phase"]] = PhaseProgress(p.phase, p.done + int(r["done"]), p.total + int(r["total"]), r["t"])
    return sorted(phases.values(), key=lambda p: p.updated)


__all__ = ["Countdown", "FileProgress", "NO_PROGRESS", "PhaseProgress", "ProgressSink", "Tick", "read_progress",
           "progress_for_run", "run_progress_dir", "summarize"]
