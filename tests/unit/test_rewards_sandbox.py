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


@pytest.fixture
def outside_walls():
    """A folder the sandbox sees as the host has it: not under a temp folder (those are walled off)."""
    import shutil
    import tempfile
    from pathlib import Path

    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.commonpath([here, os.path.realpath(tempfile.gettempdir())]) == os.path.realpath(tempfile.gettempdir()):
        here = os.path.expanduser("~")  # a checkout under /tmp (a CI clone) is walled off itself
    path = Path(tempfile.mkdtemp(prefix=".sandbox-test-", dir=here))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_root_only_files_are_unreadable_when_started_as_root(outside_walls):
    tmp_path = outside_walls
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    os.chmod(secret, 0o600)
    res = _run(f"print(open({str(secret)!r}).read())")
    if os.geteuid() == 0:
        assert res.unprivileged and "PermissionError" in res.stderr and "s3cret" not in res.stdout
    else:  # not root: the sandbox is this user, who owns the file
        assert res.unprivileged and res.ok


def test_cannot_write_outside_its_folder(outside_walls):
    tmp_path = outside_walls
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


# ---- walls: private temp folders, one disk quota, nothing left on the host (issue 40, defect 2) -----
def _host_writable_paths() -> list[str]:
    import tempfile

    return list(dict.fromkeys(p for p in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir()) if os.path.isdir(p)))


def test_writes_to_every_host_temp_folder_stay_inside_the_walls():
    from hybridflow.rewards.sandbox import walls_check

    if not walls_check().available:
        pytest.skip(f"no walls on this machine: {walls_check().missing}")
    paths = _host_writable_paths()
    names = [os.path.join(p, f"hybridflow-walls-probe-{os.getpid()}-{i}") for i, p in enumerate(paths)]
    code = (f"import os\nfor n in {names!r}:\n    open(n, 'w').write('x')\n    os.mkdir(n + '.d')\n"
            f"print(sorted(os.listdir(os.path.dirname({names[0]!r}))) != [], all(os.path.exists(n) for n in {names!r}))")
    res = _run(code)
    assert res.ok and res.walled, res.stderr
    assert res.stdout.split() == ["True", "True"]  # the code saw its own files, in private folders
    for n in names:  # nothing landed on the host, nothing stays
        assert not os.path.exists(n) and not os.path.exists(n + ".d"), n


def test_private_temp_folders_start_empty():
    from hybridflow.rewards.sandbox import walls_check

    if not walls_check().available:
        pytest.skip(f"no walls on this machine: {walls_check().missing}")
    marker = f"/dev/shm/hybridflow-walls-host-{os.getpid()}"
    open(marker, "w").write("host")
    try:
        res = _run(f"import os\nprint(os.path.exists({marker!r}), sorted(os.listdir('/var/tmp')))")
    finally:
        os.unlink(marker)
    assert res.ok and res.stdout.strip() == "False []"  # the host's files are not visible either


def test_a_write_beyond_the_disk_quota_fails():
    from hybridflow.rewards.sandbox import walls_check

    if not walls_check().available:
        pytest.skip(f"no walls on this machine: {walls_check().missing}")
    # 3 files of 3 MB each in three folders (each under RLIMIT_FSIZE = 4 MB): 9 MB > the 8 MB quota
    code = ("import os\nfor i, d in enumerate(('/tmp', '/dev/shm', '.')):\n"
            "    try:\n        open(f'{d}/f{i}', 'wb').write(b'x' * (3 << 20))\n"
            "    except OSError as e:\n        print('failed', i, e.errno == 28)\n        break\nelse:\n    print('all written')")
    res = _run(code, disk_mb=8, max_output_bytes=4 << 20)
    assert res.ok, res.stderr
    assert res.stdout.strip() == "failed 2 True"  # ENOSPC: the quota is the total over every folder
    small = _run(code, disk_mb=16, max_output_bytes=4 << 20)
    assert small.stdout.strip() == "all written"  # the same writes fit a bigger quota
