"""sandbox.run_code: output, stdin, wall-clock and memory limits, no network, a throwaway cwd."""

import os
import time

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
