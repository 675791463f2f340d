"""Make every process ``hybridflow train`` starts die with it, even when it is SIGKILLed.

``python -m flows.reaper DRIVER_PID DRIVER_START_TIME`` is started by the CLI
(:func:`flows.runtime.start_reaper`) before any server, in a session of its own, so neither a
SIGKILL of the driver nor one of the driver's process group reaches it. While the driver lives,
it records the driver's descendants every second by pid and start time (:func:`start_time`): the
Prefect server and its children, Ray's GCS, raylet, dashboard and runtime-env agents, log monitor, workers and pool
actors, and what those start (reward processes). Once the driver is gone (woken at once through
a pidfd), it sends SIGTERM to each recorded process that is still the same process (same start
time, so a recycled pid is never hit) and to their children, SIGKILL to whatever is left after
``GRACE_S``, and exits. After a clean exit of the CLI it finds nothing left to stop.

Why not ``PR_SET_PDEATHSIG`` alone: it reaches only direct children (Ray's agents and workers
are the raylet's children, the Prefect server's uvicorn its own), and it fires when the *thread*
that started the child exits, not the process. Ray's fate-sharing ends its GCS and raylet with
the driver, but its agents lived on for a minute or two (issue 15).

Imports only the standard library and psutil, so it starts in a fraction of a second.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

import psutil

POLL_S = 1.0
GRACE_S = 5.0


def start_time(proc: psutil.Process) -> float:
    """When ``proc`` started, in a unit no clock change moves: on Linux its start in clock ticks
    since boot (field 22 of /proc/PID/stat), else psutil's ``create_time()``.

    psutil's ``create_time()`` is that tick count plus the boot time read again from /proc/stat
    on every new ``Process``, and the kernel recomputes the boot time from the wall clock: when
    NTP or a VM host adjusts the clock it moves by a second or more, so a live process compared
    equal to its recorded create_time no more: the driver looked gone, and its reaper SIGTERMed
    everything the still-running driver had started. (Seen, most likely from this, in CI: a
    tools worker of a unit test died with exit code -15 mid-call, and nothing else here sends
    SIGTERM.)"""
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            data = f.read()
        return float(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return proc.create_time()


def _same(pid: int, start: float) -> psutil.Process | None:
    """The process ``pid`` if it is still the one that started at ``start`` (:func:`start_time`)."""
    try:
        proc = psutil.Process(pid)
        return proc if start_time(proc) == start and proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def _record(roots: list[psutil.Process], known: dict[int, float]) -> None:
    """Add the descendants of ``roots`` to ``known`` (pid → start time), skipping this process."""
    me = os.getpid()
    for root in roots:
        try:
            for child in root.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, start_time(child))
        except psutil.Error:
            continue


def _alive(known: dict[int, float]) -> list[psutil.Process]:
    return [p for pid, start in known.items() if (p := _same(pid, start)) is not None]


def reap(known: dict[int, float], grace_s: float = GRACE_S) -> None:
    """SIGTERM the recorded processes still alive (and their children), SIGKILL the rest after ``grace_s``."""
    procs = _alive(known)
    _record(procs, known)
    procs = _alive(known)
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    _record(left, known)  # children started while shutting down
    for p in _alive(known):
        try:
            p.kill()
        except psutil.Error:
            pass


def watch(driver_pid: int, driver_start: float) -> None:
    """Record the driver's descendants until it exits, then :func:`reap` them."""
    known: dict[int, float] = {}
    driver = _same(driver_pid, driver_start)
    try:
        pidfd: int | None = os.pidfd_open(driver_pid) if driver is not None else None
    except (AttributeError, OSError):
        pidfd = None
    while driver is not None:
        _record([driver, *_alive(known)], known)
        if pidfd is not None:
            # the pidfd is that very process: readable once it has exited, and only then (a failed
            # /proc read or a moved clock cannot make a live driver look gone)
            if select.select([pidfd], [], [], POLL_S)[0]:
                break
        else:
            time.sleep(POLL_S)
            if _same(driver_pid, driver_start) is None:
                break
    reap(known)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's; we act when it has gone
    watch(int(sys.argv[1]), float(sys.argv[2]))


if __name__ == "__main__":
    main()
