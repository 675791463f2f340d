"""flows/reaper.py: a process's identity survives a change of the wall clock."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from flows import reaper


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the boot time psutil reads is Linux's /proc/stat")
def test_a_clock_step_does_not_make_a_live_driver_look_gone(monkeypatch):
    import psutil._pslinux as pslinux

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc = psutil.Process(child.pid)
        start, created = reaper.start_time(proc), proc.create_time()
        real = pslinux.boot_time
        monkeypatch.setattr(pslinux, "boot_time", lambda: real() + 1.0)  # NTP moved the clock by 1 s
        assert psutil.Process(child.pid).create_time() != created  # psutil's create_time moves with it...
        assert reaper.start_time(psutil.Process(child.pid)) == start  # ...the start in ticks does not
        assert reaper._same(child.pid, start) is not None  # so the reaper still sees its driver alive
        known: dict[int, float] = {}
        reaper._record([psutil.Process()], known)
        assert known[child.pid] == start
    finally:
        child.kill()
        child.wait()
    assert reaper._same(child.pid, start) is None  # gone (and reaped) is gone
