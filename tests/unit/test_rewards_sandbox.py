"""sandbox.run_code: output, stdin, wall-clock and memory limits, no network, a throwaway cwd."""

import os
import time

import pytest

from hybridflow.rewards.sandbox import run_code


def test_runs_code_with_stdin_and_captures_output():
    res = run_code("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", timeout_s=10,
                   memory_mb=256, stdin="1 2 3\n")  # fmt: skip
    assert res.ok and res.stdout == "6\n" and res.stderr == ""


def test_error_shows_in_returncode_and_stderr():
    res = run_code("raise SystemExit('boom')", timeout_s=10, memory_mb=256)
    assert res.returncode == 1 and "boom" in res.stderr and not res.ok


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    res = run_code("while True:\n    pass", timeout_s=1.0, memory_mb=256)
    assert res.timed_out and not res.ok
    assert res.duration_s < 5  # 1 s limit + process teardown, never the loop's forever


def test_child_processes_die_with_it():
    code = "import subprocess, time\np = subprocess.Popen(['sleep', '30'])\nprint(p.pid, flush=True)\ntime.sleep(30)"
    res = run_code(code, timeout_s=1.0, memory_mb=256, isolate_network=False)  # same pid namespace
    assert res.timed_out and res.duration_s < 5
    pid = int(res.stdout)
    time.sleep(0.2)
    try:
        state = open(f"/proc/{pid}/stat").read().split()[2]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z")  # killed with its process group (a zombie until reaped)


def test_memory_limit():
    res = run_code("x = bytearray(512 * 1024 * 1024)\nprint('allocated')", timeout_s=10, memory_mb=200)
    assert "MemoryError" in res.stderr and "allocated" not in res.stdout and res.returncode != 0


def test_output_is_capped():
    res = run_code("print('x' * 100000)", timeout_s=10, memory_mb=256, max_output_bytes=1000)
    assert len(res.stdout) <= 1000 and not res.ok  # writing past RLIMIT_FSIZE kills it (SIGXFSZ)


def test_runs_in_a_temporary_directory_that_is_removed():
    res = run_code("import os\nprint(os.getcwd())\nopen('f.txt', 'w').write('x')", timeout_s=10, memory_mb=256)
    cwd = res.stdout.strip()
    assert res.ok and "hybridflow-sandbox-" in cwd and not os.path.exists(cwd)


def test_no_network_when_isolation_is_available():
    code = "import socket\nprint(sorted(name for _, name in socket.if_nameindex()))"
    res = run_code(code, timeout_s=10, memory_mb=256)
    assert res.ok, res.stderr
    if res.network_isolated:
        assert res.stdout.strip() == "['lo']"  # a fresh network namespace: only the (down) loopback
    else:  # documented: where namespaces are forbidden the code has the host's network
        assert res.stdout.strip() != ""
    unisolated = run_code(code, timeout_s=10, memory_mb=256, isolate_network=False)
    assert unisolated.network_isolated is False


# ---- hardening: what model-written code tries (issue 16) ------------------------------------------
def _run(code: str, **kw):
    return run_code(code, timeout_s=kw.pop("timeout_s", 10), memory_mb=256, **kw)


def test_root_only_files_are_unreadable_when_started_as_root(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    os.chmod(secret, 0o600)
    res = _run(f"print(open({str(secret)!r}).read())")
    if os.geteuid() == 0:
        assert res.unprivileged and "PermissionError" in res.stderr and "s3cret" not in res.stdout
    else:  # not root: the sandbox is this user, who owns the file
        assert res.unprivileged and res.ok


def test_cannot_write_outside_its_folder(tmp_path):
    target = tmp_path / "planted.txt"
    os.chmod(tmp_path, 0o755)
    res = _run(f"open({str(target)!r}, 'w').write('x')")
    if os.geteuid() == 0:
        assert "PermissionError" in res.stderr and not target.exists()
    res = _run("import os\nopen('mine.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    assert res.ok and res.stdout.strip() == "['mine.txt']"  # its own folder starts empty and is writable


def test_cannot_open_a_network_connection():
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('connected')"
    res = _run(code)
    if not res.network_isolated:
        pytest.skip("this kernel allows no network namespace: the sandbox documents that it has network here")
    assert "connected" not in res.stdout and res.returncode != 0 and "OSError" in res.stderr


def test_fork_bomb_is_cut_off_and_the_next_run_works():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    res = _run(bomb, timeout_s=2)
    assert not res.ok and time.monotonic() - start < 20
    after = _run("print('alive')")
    assert after.ok and after.stdout == "alive\n"


def test_filling_the_disk_is_cut_off():
    code = "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))"
    res = _run(code, max_output_bytes=8 << 20)
    assert not res.ok and not res.timed_out  # SIGXFSZ at the file-size limit (or ENOSPC on the tmpfs)
    many = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20)); i += 1"
    res = _run(many, max_output_bytes=8 << 20, timeout_s=5)
    assert not res.ok


def test_environment_is_clean(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "k")
    res = _run("import os\nprint(sorted(os.environ))")
    assert res.ok and res.stdout.strip() == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE']"
