"""One run owns its folder: ``<run dir>/run.lock``, created with ``O_CREAT | O_EXCL``.

The lock file holds the holder's pid, host, the kernel's start time of that pid (so a
reused pid is not mistaken for the holder) and the command line. It is taken by
``hybridflow train`` before any server starts (and by the train flow's ``open_run``, for
runs started from a deployment), held for the run's lifetime and removed at exit.

A lock whose holder is gone is *stale* and is taken over: the holder ran on this host and
its pid no longer exists (or now belongs to a process started at another time), or the file
is empty/unreadable and older than :data:`UNREADABLE_GRACE_S` (a crash between create and
write). A lock held on another host cannot be checked from here: it is refused, naming the
host and the file to delete if no run is alive there.

Re-entrant within one process (a reference count): the CLI takes it, the flow it runs takes
it again, and only the last release removes the file.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flows.preflight import PreflightError
from hybridflow.config import ExperimentConfig
from hybridflow.layout import RUN_INFO, RUN_LOCK

LOCK_NAME = RUN_LOCK  # the name tests and callers import from here
UNREADABLE_GRACE_S = 10.0  # an empty lock file younger than this may be mid-write
_HELD: dict[str, int] = {}  # lock path -> reference count in this process


class RunLockedError(PreflightError):
    """Another live run holds the run directory (one line: folder, holder, what to do)."""


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22);
    None where /proc is not available or the process does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)": state is field 3


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start_time": process_start_time(os.getpid()),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:300]}


def read_holder(path: Path) -> dict[str, Any] | None:
    """The lock file's JSON, or None when it is empty or unreadable."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def holder_is_alive(holder: dict[str, Any]) -> bool | None:
    """True/False for a holder on this host; None when it ran on another host (unknown)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    recorded, now = holder.get("start_time"), process_start_time(pid)
    return not (recorded is not None and now is not None and recorded != now)  # a reused pid is not the holder


def _is_stale(path: Path, holder: dict[str, Any] | None) -> bool:
    if holder is None:
        try:
            return time.time() - path.stat().st_mtime > UNREADABLE_GRACE_S
        except FileNotFoundError:
            return True
    return holder_is_alive(holder) is False


def _refusal(run_dir: Path, path: Path, holder: dict[str, Any] | None) -> RunLockedError:
    if holder is None:
        return RunLockedError(f"run directory {run_dir} is being locked by another process right now "
                              f"({path} is not written yet); try again in a few seconds")
    who = f"pid {holder['pid']} on host {holder.get('host')}, started {holder.get('started_at', '?')}"
    if holder_is_alive(holder) is None:
        return RunLockedError(f"run directory {run_dir} is locked by a run on another host ({who}); "
                              f"if no run is alive there, delete {path}")
    return RunLockedError(f"run directory {run_dir} is in use by another hybridflow run ({who}): "
                          "two runs must not write one folder; wait for it to finish or stop it")


def _break_stale(path: Path, stale: dict[str, Any] | None) -> None:
    """Remove a stale lock, guarded so that two processes breaking it cannot both win."""
    guard = path.with_name(path.name + ".break")
    try:
        fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if time.time() - guard.stat().st_mtime > 30:  # a breaker that died: its guard is stale too
            guard.unlink(missing_ok=True)
        return  # the other breaker goes first; the caller retries
    try:
        os.close(fd)
        if read_holder(path) == stale:  # still the stale one, not a lock taken meanwhile
            path.unlink(missing_ok=True)
    finally:
        guard.unlink(missing_ok=True)


def acquire_run_lock(run_dir: str | Path) -> Path:
    """Take ``<run_dir>/run.lock`` (creating ``run_dir``). Returns the lock path.

    Raises RunLockedError when a live run holds it (or a run on another host), PreflightError
    when the folder cannot be created or written.
    """
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_NAME
    if _HELD.get(str(path)):
        _HELD[str(path)] += 1
        return path
    me = _me()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(path)
                if not _is_stale(path, holder):
                    raise _refusal(run_dir, path, holder) from None
                _break_stale(path, holder)
                time.sleep(0.05)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me))
                f.flush()
                os.fsync(f.fileno())
            _HELD[str(path)] = 1
            return path
    except OSError as e:
        raise PreflightError(f"cannot lock run directory {run_dir}: {e.strerror or e}") from None
    raise _refusal(run_dir, path, read_holder(path))


def release_run_lock(run_dir: str | Path, *, remove_empty_dir: bool = False) -> None:
    """Drop one reference; the last one removes the lock file (only if this process holds it).
    ``remove_empty_dir``: also remove ``run_dir`` when nothing else is in it (a run that was
    refused before it wrote anything leaves no folder behind)."""
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_NAME
    count = _HELD.get(str(path), 0)
    if count > 1:
        _HELD[str(path)] = count - 1
        return
    _HELD.pop(str(path), None)
    holder = read_holder(path)
    if count and holder is not None and holder["pid"] == os.getpid():
        path.unlink(missing_ok=True)
    if remove_empty_dir:
        try:
            run_dir.rmdir()  # only succeeds when empty
        except OSError:
            pass


def latest_run(parent: Path) -> Path | None:
    runs = [p for p in parent.iterdir() if (p / RUN_INFO).exists()] if parent.exists() else []
    return max(runs, key=lambda p: (p / RUN_INFO).stat().st_mtime) if runs else None


def resolve_run_dir(cfg: ExperimentConfig, resume: str | None) -> tuple[Path, bool]:
    """(the run directory ``open_run`` will use, whether it reopens an existing run).

    ``resume`` = a run directory, or "auto" (the latest run under trainer.run_dir; none: a new
    run); ``trainer.resume: auto`` in the config does the same. A new run without
    ``trainer.run_id`` gets a name from the time (the CLI fixes it in the config first, so the
    flow opens the folder the CLI locked). Raises FileNotFoundError when ``resume`` is not a run
    directory.
    """
    parent = Path(cfg.trainer.run_dir)
    if resume == "auto" or (resume is None and cfg.trainer.resume == "auto"):
        target = latest_run(parent)
        if target is not None:
            return target, True
    elif resume:
        if not (Path(resume) / RUN_INFO).exists():
            raise FileNotFoundError(f"--resume {resume}: not a run directory (no run.json)")
        return Path(resume), True
    run_id = cfg.trainer.run_id or time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.algorithm.adv_estimator}"
    return parent / run_id, False


@contextmanager
def owned_run_dir(cfg: ExperimentConfig, resume: str | None, *,
                  apply_overrides: bool = False) -> Iterator[tuple[ExperimentConfig, str | None]]:
    """Lock the run directory for a command's lifetime before any server starts, and yield
    ``(config to run, run directory to resume or None)`` (``trainer.resume: auto`` without
    ``--resume`` resolves to the latest run here). A second start of the same ``trainer.run_id``, or a
    ``--resume`` of a folder a live run holds, is a RunLockedError (one line, exit 2); a new run
    whose folder already holds a run is a PreflightError. A new run without ``trainer.run_id``
    gets its generated name fixed in the config, so the flow opens the folder locked here. On
    resume, overrides that change the saved config are refused unless ``apply_overrides``
    (:func:`flows.resume_config.reconcile_resume_config`). A folder created here and left empty
    (the run was refused before it wrote anything) is removed at exit."""
    if apply_overrides and resume is None:
        raise PreflightError("--override applies only with --resume (a new run takes its overrides as they are)")
    run_dir, reopen = resolve_run_dir(cfg, resume)
    if not reopen:
        from flows.preflight import check_run_dir

        check_run_dir(cfg)  # an unwritable trainer.run_dir is named as such, not as a lock failure
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_id": run_dir.name})})
    acquire_run_lock(run_dir)
    try:
        if not reopen and (run_dir / RUN_INFO).exists():
            raise PreflightError(f"run directory {run_dir} already holds a run (trainer.run_id={run_dir.name!r}); "
                                 f"continue it with --resume {run_dir}, or choose another trainer.run_id")
        if reopen:
            from flows.resume_config import reconcile_resume_config

            cfg = reconcile_resume_config(cfg, run_dir, apply=apply_overrides)
        yield cfg, (str(run_dir) if reopen else None)
    finally:
        release_run_lock(run_dir, remove_empty_dir=not reopen)


def held_locks() -> list[str]:
    return sorted(_HELD)


@atexit.register
def _release_all() -> None:
    for path in list(_HELD):
        _HELD[path] = 1
        release_run_lock(Path(path).parent)


__all__ = ["LOCK_NAME", "resolve_run_dir", "owned_run_dir", "RunLockedError", "acquire_run_lock", "release_run_lock", "read_holder",
           "holder_is_alive", "process_start_time", "held_locks"]
