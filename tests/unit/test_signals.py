"""One shutdown path for every signal (flows/signals.py): the stop reason, the exit status, the
second signal and the watchdog, and Prefect's flow engine leaving our handler in charge. The real
train flow under SIGTERM: tests/integration/test_signals_train.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows import signals

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean():
    previous = {s: signal.getsignal(s) for s in signals.REASONS}
    yield
    signals.reset()
    for s, h in previous.items():
        signal.signal(s, h)


@pytest.mark.parametrize("sig,reason,code", [(signal.SIGINT, "interrupted", 130),
                                             (signal.SIGTERM, "terminated", 143),
                                             (signal.SIGHUP, "hangup", 129)])
def test_first_signal_records_the_reason_and_unwinds(sig, reason, code, monkeypatch):
    monkeypatch.setattr(signals, "GRACE_S", 60.0)
    signals.install()
    with pytest.raises(KeyboardInterrupt) as stop:
        os.kill(os.getpid(), sig)
        time.sleep(10)
    assert str(stop.value) == f"{reason} ({signal.Signals(sig).name})"  # never empty
    got = signals.received()
    assert (got.reason, got.exit_code) == (reason, code)
    # whatever the exception became on its way up (Ray, Prefect, a C extension), the signal decides
    assert signals.stop_reason(SystemError("<built-in method __new__> returned a result")) == got


def test_without_a_signal_only_keyboard_interrupt_is_a_stop():
    assert signals.stop_reason(RuntimeError("boom")) is None
    assert signals.stop_reason(KeyboardInterrupt()).reason == "interrupted"


def test_prefect_flow_runs_keep_our_sigterm_handler(monkeypatch):
    """Prefect's flow engine enters capture_sigterm() for each flow run; ours must stay installed."""
    import prefect.flow_engine as engine

    monkeypatch.setattr(engine, "capture_sigterm", engine.capture_sigterm)  # undone after the test
    signals.install(prefect=True)
    with engine.capture_sigterm():
        assert signal.getsignal(signal.SIGTERM) is signals._handle


def test_observer_reason_from_a_signal_is_never_empty():
    from flows.observe import stop_reason

    assert stop_reason(KeyboardInterrupt()) == ("interrupted", "SIGINT")
    assert stop_reason(RuntimeError("x")) == ("error", "x")


# a command that holds a run lock and hangs while it unwinds: the second signal (or the watchdog)
# must end it at once, releasing the lock, with one line
SCRIPT = r"""
import sys, time
from pathlib import Path
from flows import signals
from flows.run_lock import acquire_run_lock
run_dir = Path(sys.argv[1])
signals.GRACE_S = float(sys.argv[2])
signals.install()
acquire_run_lock(run_dir)
(run_dir / "started").write_text("")
try:
    time.sleep(120)
finally:
    (run_dir / "unwinding").write_text("")
    time.sleep(120)  # a hung shutdown
"""


def _start(tmp_path: Path, grace_s: float) -> subprocess.Popen:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run_dir), str(grace_s)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    _wait_for(run_dir / "started", proc)
    return proc


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


def test_second_signal_exits_at_once_releasing_the_lock(tmp_path):
    proc = _start(tmp_path, grace_s=120)
    try:
        proc.send_signal(signal.SIGTERM)
        _wait_for(tmp_path / "run" / "unwinding", proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=20)
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143  # the first signal's status
    assert proc.stderr.read().strip().splitlines() == ["run stopped: terminated (SIGTERM)"]
    assert not (tmp_path / "run" / "run.lock").exists()


def test_a_hung_shutdown_ends_after_the_grace_period(tmp_path):
    proc = _start(tmp_path, grace_s=2)
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGHUP)
        code = proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 129
    assert proc.stderr.read().strip().splitlines() == ["run stopped: hangup (SIGHUP)"]
    assert not (tmp_path / "run" / "run.lock").exists()


def _signal_inside_a_del() -> None:
    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside __del__
                pass

    Collected()  # collected at once: __del__ runs here


def _signal_inside_a_weakref_callback() -> None:
    import weakref

    class Target:
        pass

    def gced(ref):  # as SQLAlchemy's event registry's _collection_gced
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass

    target = Target()
    ref = weakref.ref(target, gced)
    del target  # the callback runs here
    assert ref() is None


@pytest.mark.parametrize("land", [_signal_inside_a_del, _signal_inside_a_weakref_callback], ids=["__del__", "weakref"])
def test_a_signal_landing_where_python_drops_exceptions_still_stops_the_command(monkeypatch, land):
    """The main thread may be inside an object's ``__del__`` (an asyncio transport collected under
    Prefect's client) or a weakref callback (SQLAlchemy's ``_collection_gced``) when the signal
    comes: both seen in real train runs, which then trained on to the end and exited 0. Python
    prints and drops an exception raised there (``Exception ignored in``); the stop is delivered
    again once that code has returned (``sys.unraisablehook``), and nothing is printed."""
    import io
    from contextlib import redirect_stderr

    monkeypatch.setattr(signals, "GRACE_S", 60.0)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # put back after the test
    signals.install()
    printed = io.StringIO()
    with redirect_stderr(printed), pytest.raises(KeyboardInterrupt) as stop:
        land()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.01)
    assert str(stop.value) == "terminated (SIGTERM)"
    assert signals.received().exit_code == 143
    assert "Exception ignored" not in printed.getvalue()


def test_other_dropped_exceptions_still_reach_the_previous_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value).__name__))
    signals.install()

    class Broken:
        def __del__(self):
            raise ValueError("not a signal")

    Broken()
    assert seen == ["ValueError"]


@pytest.mark.parametrize("sig,code,reason", [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hangup")])
def test_bench_stops_in_one_line_and_runs_its_finally_blocks(tmp_path, sig, code, reason):
    """``hybridflow bench NAME`` is one of the commands with the one shutdown path: SIGTERM/SIGHUP
    unwind the benchmark like Ctrl-C (its ``finally`` blocks stop what it started), one line,
    143/129. Before, SIGTERM killed it where it stood (no line, -15, the finally never ran)."""
    (tmp_path / "sleepy.py").write_text(
        "import sys, time\n"
        "def main(argv):\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        f"        open({str(tmp_path / 'cleaned')!r}, 'w').close()\n")
    script = ("import sys; from pathlib import Path; import flows.cli.bench as b; "
              f"b.BENCH_DIR = Path({str(tmp_path)!r}); from flows.cli import main; sys.exit(main(['bench', 'sleepy']))")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.strip().splitlines() == [f"run stopped: {reason} ({signal.Signals(sig).name})"], err
    assert (tmp_path / "cleaned").exists()


def test_ray_started_on_demand_keeps_the_commands_handlers():
    """``ray.init`` installs Ray's own SIGTERM handler (C++: prints "SIGTERM received" and aborts the
    driver); a command whose Ray starts on demand inside it (``node run`` of a node with a pool)
    kept Ray's and died that way on SIGTERM. start_ray puts the command's handlers back."""
    script = """
import signal
from flows import signals
from workers.runtime import start_ray, stop_ray
signals.install()
start_ray(address=None, num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False)
try:
    print(all(signal.getsignal(s) is signals._handle for s in signals.REASONS))
finally:
    stop_ray()
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True", proc.stdout + proc.stderr[-2000:]


def test_a_library_logging_its_own_error_about_our_stop_prints_nothing(monkeypatch):
    """CI saw it: the SIGTERM landed inside a SQLite fetch of the driver's store, and SQLAlchemy,
    closing the cursor on the way out, logged ``Error closing cursor`` with a traceback whose
    context is our Stopped (``_safe_close_cursor``). A record whose exception is, or was raised
    while handling, the stop describes our own stop and is dropped, whichever logger and handler it
    goes through; an error that has nothing to do with the stop still prints, with its traceback."""
    import io

    def store_fetch():  # the shape of SQLAlchemy's fetch-then-close-the-cursor on an exit exception
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # lands inside the fetch
            for _ in range(100000):
                pass
        except BaseException:
            try:
                raise RuntimeError("Cannot operate on a closed database.")
            except RuntimeError:
                logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("Error closing cursor", exc_info=True)
            raise

    monkeypatch.setattr(signals, "GRACE_S", 60.0)
    printed = io.StringIO()
    handler = logging.StreamHandler(printed)
    root = logging.getLogger()
    root.addHandler(handler)
    signals.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            store_fetch()
        logging.getLogger("some.library").error("unrelated failure", exc_info=ValueError("not ours"))
    finally:
        root.removeHandler(handler)
    text = printed.getvalue()
    assert "Error closing cursor" not in text and "Stopped" not in text, text
    assert "unrelated failure" in text and "ValueError: not ours" in text, text
