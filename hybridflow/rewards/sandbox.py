"""Run untrusted Python (model-written code) in a subprocess with time, memory, process, file and
network limits, as an unprivileged user.

:func:`run_code` runs ``code`` with an interpreter in isolated mode (``python -I``: no user
site-packages, no PYTHON* environment variables) under:

- **user**: started as root, the code runs as ``nobody`` (uid/gid 65534, no supplementary
  groups), so root-only files are unreadable and nothing outside its folder is writable. The
  interpreter must be one ``nobody`` can execute: this one, else the system ``python3`` (probed
  once; then only the standard library is importable). ``unprivileged`` says whether it ran so.
- **files (the walls)**: in a private mount namespace, one tmpfs of ``disk_mb`` (default
  :data:`TMPFS_MB`) holds everything it can write: the working directory (empty) and empty,
  world-writable stand-ins for every world-writable temp folder of the host (:func:`wall_paths`:
  ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``tempfile.gettempdir()``), so ``disk_mb`` is the call's
  total disk quota (a write past it fails with ENOSPC) and nothing it writes reaches the host or
  outlives the call (the tmpfs dies with the namespace). The program and its stdin/stdout/stderr
  files live elsewhere, out of its reach; HOME points at the working folder; everything is
  deleted afterwards. ``RLIMIT_FSIZE`` (``max_output_bytes``) caps every file it writes
  (a write past it kills it with SIGXFSZ); no core dumps. Where the kernel gives no mount
  namespace there are no walls (``walled=False``; :func:`walls_check` says why).
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
TMPFS_MB = 64  # default total disk quota of one call (working folder + private temp folders), MB
WALLS = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class SandboxResult:
    """returncode: the exit status (negative = killed by that signal); timed_out: the wall-clock
    limit was hit; stdout/stderr: decoded (UTF-8, errors replaced), at most max_output_bytes each;
    duration_s: wall time; network_isolated: whether the code ran without network; unprivileged:
    whether it ran as a user other than root (``nobody``, or the non-root caller); walled: whether
    it ran inside the walls (private tmpfs temp folders and working folder, one disk quota)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    network_isolated: bool
    unprivileged: bool = True
    walled: bool = False

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


# Runs first, in the namespaces, still as the caller, in the sandbox's own folder: mount the walls'
# tmpfs (``walls/``), bind its parts over the working folder and every wall path, make the folder
# reachable again where a wall covered it (a bind of ".", the folder under the wall), set the
# limits, drop to the unprivileged user, then exec the program. (Done in the child rather than with
# Popen(preexec_fn=...), which is unsafe in threaded callers.)
_BOOT = """
import ctypes, os, resource, sys
cpu, mem, fsize, nproc, uid, disk_mb = (int(x) for x in sys.argv[1:7])
exe, folder, program = sys.argv[7:10]
walls = sys.argv[10:]
libc = ctypes.CDLL(None, use_errno=True)
def mount(src, target, fstype, flags, opts):
    if libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                  opts.encode() if opts else None) != 0:
        sys.stderr.write(f"sandbox: could not mount {target}: {os.strerror(ctypes.get_errno())}\\n")
        os._exit(125)
MS_BIND, MS_REC = 4096, 16384
if disk_mb > 0:
    mount("tmpfs", "walls", "tmpfs", 0, f"size={disk_mb}m,mode=0711")
    os.mkdir("walls/work", 0o700)
    if uid >= 0:
        os.chown("walls/work", uid, uid)
    mount("walls/work", "work", None, MS_BIND, None)
    for i, wall in enumerate(walls):
        os.mkdir(f"walls/w{i}")
        os.chmod(f"walls/w{i}", 0o1777)
        os.makedirs(wall, exist_ok=True)  # a wall inside an earlier one (TMPDIR=/tmp/x) is made in its stand-in
        mount(f"walls/w{i}", wall, None, MS_BIND, None)
    if not os.path.isdir(folder):  # a wall covered the sandbox's own folder: bind it back under the wall
        os.makedirs(folder, 0o711)
        mount(".", folder, None, MS_BIND | MS_REC, None)
os.chdir(os.path.join(folder, "work"))
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


def wall_paths() -> tuple[str, ...]:
    """The host's temp folders the walls cover: /tmp, /var/tmp, /dev/shm and ``tempfile.gettempdir()``,
    those that exist, as real paths, each once, in that order."""
    found = [os.path.realpath(p) for p in (*WALLS, tempfile.gettempdir()) if os.path.isdir(p)]
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True)
class WallsCheck:
    """Whether this machine gives the sandbox its walls (a private mount namespace); ``missing``
    names what it lacks, one line ("" when available)."""

    available: bool
    missing: str = ""


@functools.cache
def walls_check() -> WallsCheck:
    """Probe once whether ``unshare`` gives a mount namespace here (:class:`WallsCheck`)."""
    if _unshare_prefix(True)[1]:
        return WallsCheck(True)
    exe = shutil.which("unshare")
    if exe is None:
        return WallsCheck(False, "a private mount namespace (no 'unshare' on PATH)")
    user = () if os.geteuid() == 0 else ("-r",)
    try:
        probe = subprocess.run([exe, *user, "-m", "true"], capture_output=True, text=True, timeout=10)
        why = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    return WallsCheck(False, f"a private mount namespace ('unshare {' '.join((*user, '-m'))}' fails: {why})")


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
    """tmp (0711) / code/main.py (readable), work/ (empty, the user's), io/ (the caller's only),
    walls/ (the mount point of the walls' tmpfs)."""
    os.chmod(tmp, 0o711)
    code_dir, work, io_dir = tmp / "code", tmp / "work", tmp / "io"
    code_dir.mkdir(mode=0o755)
    work.mkdir(mode=0o700)
    io_dir.mkdir(mode=0o700)
    (tmp / "walls").mkdir(mode=0o700)
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
    disk_mb: int = TMPFS_MB,
) -> SandboxResult:
    """Run Python source ``code`` under the limits in the module docstring; never raises for
    anything the code does (errors show in returncode/stderr). ``stdin`` is fed to the program.
    ``disk_mb``: the walls' total disk quota (MB). ``isolate_network=False`` skips the namespaces
    (network, mount, pid), and so the walls."""
    prefix, mounts = _unshare_prefix(True) if isolate_network else ((), False)
    exe, uid = _sandbox_user()
    unprivileged = uid >= 0 or os.geteuid() != 0
    exe = exe or sys.executable
    with tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-") as tmp:
        program, work, io_dir = _prepare(Path(tmp), code, stdin, uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        limits = [math.ceil(timeout_s) + 1, memory_mb * 1024 * 1024, max_output_bytes, max_processes, uid,
                  disk_mb if mounts else 0]  # fmt: skip
        walls: Sequence[str] = wall_paths() if mounts else ()
        start = time.monotonic()
        with open(io_dir / "stdin.txt", "rb") as fin, open(io_dir / "stdout.txt", "wb") as fout, \
                open(io_dir / "stderr.txt", "wb") as ferr:  # fmt: skip
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-c", _BOOT, *map(str, limits), exe, tmp, str(program), *walls],
                cwd=tmp, env=env, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True,
            )  # fmt: skip
            timed_out = _wait(proc, timeout_s)
        duration = time.monotonic() - start
        out = (io_dir / "stdout.txt").read_bytes()[:max_output_bytes].decode("utf-8", "replace")
        err = (io_dir / "stderr.txt").read_bytes()[:max_output_bytes].decode("utf-8", "replace")
    return SandboxResult(proc.returncode, out, err, timed_out, duration, "-n" in prefix, unprivileged, mounts)


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


__all__ = ["run_code", "SandboxResult", "WallsCheck", "walls_check", "wall_paths", "TMPFS_MB"]
