"""flows/reaper.py: a process's identity survives a change of the wall clock."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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


DRIVER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"


def test_the_driver_is_gone_only_when_it_has_exited(monkeypatch):
    """A driver that only *looks* gone (its identity check fails while it runs) is not reaped;
    once it exits, what it started is."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER])
    try:
        proc = psutil.Process(driver.pid)
        deadline = time.monotonic() + 20
        while not proc.children() and time.monotonic() < deadline:
            time.sleep(0.1)
        (grandchild,) = proc.children()
        real_same, calls = reaper._same, []

        def flaky_same(pid, start):  # the driver is found at start, then never again while it runs
            if pid == driver.pid:
                calls.append(pid)
                return real_same(pid, start) if len(calls) == 1 else None
            return real_same(pid, start)

        monkeypatch.setattr(reaper, "_same", flaky_same)
        t = threading.Thread(target=reaper.watch, args=(driver.pid, reaper.start_time(proc)), daemon=True)
        t.start()
        t.join(3 * reaper.POLL_S)
        assert t.is_alive() and grandchild.is_running()  # still watching; nothing was killed
        driver.kill()
        driver.wait()
        t.join(reaper.GRACE_S + 10)
        assert not t.is_alive()
        assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE  # reaped
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
