"""Run untrusted Python (model-written code) in a subprocess with time, memory, process, file and
network limits, as an unprivileged user.

:func:`run_code` runs ``code`` with an interpreter in isolated mode (``python -I``: no user
site-packages, no PYTHON* environment variables) under:

- **user**: started as root, the code runs as ``nobody`` (uid/gid 65534, no supplementary
  groups), so root-only files are unreadable and nothing outside its folder is writable. The
  interpreter must be one ``nobody`` can execute: this one, else the system ``python3`` (probed
  once; then only the standard library is importable). ``unprivileged`` says whether it ran so.
- **files**: the working directory is an empty folder (a 64 MB tmpfs of its own when mount
  namespaces are available, so filling it stops there); the program and its stdin/stdout/stderr
  files live elsewhere, out of its reach; HOME points at the working folder; everything is
  deleted afterwards. ``RLIMIT_FSIZE`` (``max_output_bytes``) caps every file it writes
  (a write past it kills it with SIGXFSZ); no core dumps.
- **time**: wall clock ``timeout_s`` (the process group, and with a pid namespace every process
  it started, is SIGKILLed), and ``RLIMIT_CPU`` = ceil(timeout_s) + 1 s of CPU time;
- **memory**: ``RLIMIT_AS`` = ``memory_mb`` of address space (allocations past it fail with
  MemoryError; the interpreter itself needs ~20–30 MB);
- **processes**: ``RLIMIT_NPROC`` = ``max_processes`` for the unprivileged user (a fork bomb
  gets EAGAIN), and a pid namespace where available (nothing survives the run);
- **network**: a new network namespace with only a down loopback (``unshare -n``, with ``-r``
  when not root) when the kernel allows it. Where it does not, the code RUNS WITH NETWORK
  ACCESS and the result says ``network_isolated=False``;
- **environment**: only PATH, HOME, LANG and PYTHONDONTWRITEBYTECODE (no PREFECT_API_URL,
  MLFLOW_TRACKING_URI, cloud credentials or anything else of the parent's).

What it is not: a complete security boundary (same kernel, same filesystem view for what
``nobody`` may read). Use a container or gVisor/nsjail against a determined attacker.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
TMPFS_MB = 64


@dataclass(frozen=True)
class SandboxResult:
    """returncode: the exit status (negative = killed by that signal); timed_out: the wall-clock
    limit was hit; stdout/stderr: decoded (UTF-8, errors replaced), at most max_output_bytes each;
    duration_s: wall time; network_isolated: whether the code ran without network; unprivileged:
    whether it ran as a user other than root (``nobody``, or the non-root caller)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    network_isolated: bool
    unprivileged: bool = True

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.cache
def _unshare_prefix(network: bool) -> tuple[tuple[str, ...], bool]:
    """(the ``unshare`` command that works here, whether it has a mount namespace), probed once.
    Prefers network + mount + pid namespaces, then network only; () when none works."""
    exe = shutil.which("unshare")
    if exe is None:
        return (), False
    user = () if os.geteuid() == 0 else ("-r",)
    full = (*user, "-m", "-p", "-f", "--kill-child", *(("-n",) if network else ()))
    options = [(full, True)] + ([((*user, "-n"), False)] if network else [])
    for opts, mounts in options:
        try:
            probe = subprocess.run([exe, *opts, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return (exe, *opts), mounts
    return (), False


# Runs first, in the namespaces, still as the caller: mount the folder's tmpfs, set the limits,
# drop to the unprivileged user, then exec the program. (Done in the child rather than with
# Popen(preexec_fn=...), which is unsafe in threaded callers.)
_BOOT = """
import ctypes, os, resource, sys
cpu, mem, fsize, nproc, uid, tmpfs_mb = (int(x) for x in sys.argv[1:7])
exe, work, program = sys.argv[7:10]
if tmpfs_mb > 0:
    opts = f"size={tmpfs_mb}m,mode=0700" + (f",uid={uid},gid={uid}" if uid >= 0 else "")
    if ctypes.CDLL(None, use_errno=True).mount(b"tmpfs", work.encode(), b"tmpfs", 0, opts.encode()) != 0:
        sys.stderr.write("sandbox: could not mount the working folder's tmpfs\\n")
        os._exit(125)
os.chdir(work)
for res, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                   (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 256)):
    resource.setrlimit(res, (value, value))
if uid >= 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.execv(exe, [exe, "-I", program])
"""


@functools.cache
def _sandbox_user() -> tuple[str, int]:
    """(interpreter, uid to run as): as root, the first interpreter ``nobody`` can run (probed
    once) and NOBODY; otherwise this interpreter and -1 (stay the caller). ("", -1) when root but
    no interpreter works for nobody (the code then runs as root: ``unprivileged=False``)."""
    if os.geteuid() != 0:
        return sys.executable, -1
    probe = "import os, sys\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\nos.execv(sys.argv[1], [sys.argv[1], '-I', '-c', 'pass'])"
    for exe in dict.fromkeys([sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"]):
        try:
            ok = subprocess.run([sys.executable, "-I", "-c", probe, exe], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return exe, NOBODY
    return "", -1


def _prepare(tmp: Path, code: str, stdin: str | None, uid: int) -> tuple[Path, Path, Path]:
    """tmp (0711) / code/main.py (readable), work/ (empty, the user's), io/ (the caller's only)."""
    os.chmod(tmp, 0o711)
    code_dir, work, io_dir = tmp / "code", tmp / "work", tmp / "io"
    code_dir.mkdir(mode=0o755)
    work.mkdir(mode=0o700)
    io_dir.mkdir(mode=0o700)
    (code_dir / "main.py").write_text(code)
    os.chmod(code_dir / "main.py", 0o644)
    (io_dir / "stdin.txt").write_text(stdin or "")
    if uid >= 0:
        os.chown(work, uid, uid)
    return code_dir / "main.py", work, io_dir


def run_code(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    stdin: str | None = None,
    max_output_bytes: int = 1 << 20,
    isolate_network: bool = True,
    max_processes: int = 64,
) -> SandboxResult:
    """Run Python source ``code`` under the limits in the module docstring; never raises for
    anything the code does (errors show in returncode/stderr). ``stdin`` is fed to the program.
    ``isolate_network=False`` skips the namespaces (network, mount, pid)."""
    prefix, mounts = _unshare_prefix(True) if isolate_network else ((), False)
    exe, uid = _sandbox_user()
    unprivileged = uid >= 0 or os.geteuid() != 0
    exe = exe or sys.executable
    with tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-") as tmp:
        program, work, io_dir = _prepare(Path(tmp), code, stdin, uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        limits = [math.ceil(timeout_s) + 1, memory_mb * 1024 * 1024, max_output_bytes, max_processes, uid,
                  TMPFS_MB if mounts else 0]  # fmt: skip
        start = time.monotonic()
        with open(io_dir / "stdin.txt", "rb") as fin, open(io_dir / "stdout.txt", "wb") as fout, \
                open(io_dir / "stderr.txt", "wb") as ferr:  # fmt: skip
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-c", _BOOT, *map(str, limits), exe, str(work), str(program)],
                cwd=tmp, env=env, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True,
            )  # fmt: skip
            timed_out = _wait(proc, timeout_s)
        duration = time.monotonic() - start
        out = (io_dir / "stdout.txt").read_bytes()[:max_output_bytes].decode("utf-8", "replace")
        err = (io_dir / "stderr.txt").read_bytes()[:max_output_bytes].decode("utf-8", "replace")
    return SandboxResult(proc.returncode, out, err, timed_out, duration, "-n" in prefix, unprivileged)


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait up to ``timeout_s``; past it SIGKILL the process group. True when it was killed so."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended on its own just now
            pass
        proc.wait()
        return True


__all__ = ["run_code", "SandboxResult"]
