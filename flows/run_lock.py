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
from pathlib import Path
from typing import Any

from flows.preflight_base import PreflightError
from hybridflow.layout import RUN_LOCK

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


def held_locks() -> list[str]:
    return sorted(_HELD)


@atexit.register
def release_all() -> None:
    """Release every run lock this process holds (at exit, or when a second signal ends it at once)."""
    for path in list(_HELD):
        _HELD[path] = 1
        release_run_lock(Path(path).parent)


__all__ = ["LOCK_NAME", "RunLockedError", "acquire_run_lock", "release_run_lock", "read_holder",
           "holder_is_alive", "process_start_time", "held_locks", "release_all"]
