"""Run untrusted Python (model-written code) in a subprocess with time, memory and network limits.

:func:`run_code` writes ``code`` to ``main.py`` in a fresh temporary directory and runs it
with this interpreter in isolated mode (``python -I``: no user site-packages, no PYTHON*
environment variables) under:

- **time**: wall clock ``timeout_s`` (the whole process group is SIGKILLed), and
  ``RLIMIT_CPU`` = ceil(timeout_s) + 1 s of CPU time;
- **memory**: ``RLIMIT_AS`` = ``memory_mb`` of address space (allocations past it fail with
  MemoryError; note the interpreter itself needs ~20–30 MB);
- **output**: stdout/stderr go to files capped by ``RLIMIT_FSIZE`` (``max_output_bytes``);
- **files**: the working directory is the temp dir (deleted afterwards), HOME points there,
  the environment is reduced to PATH/HOME/LANG; no core dumps;
- **network**: a new network namespace with only a down loopback (``unshare -n``, with
  ``-r`` when not root) when the kernel allows it. Where it does not (some containers forbid
  user namespaces), the code RUNS WITH NETWORK ACCESS and the result says
  ``network_isolated=False`` — check it if that matters to you.

What it is not: a security boundary against a determined attacker (same user, same
filesystem view: the code can read whatever this user can read). Use a container or
gVisor/nsjail for that.
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


@dataclass(frozen=True)
class SandboxResult:
    """returncode: the exit status (negative = killed by that signal); timed_out: the wall-clock
    limit was hit; stdout/stderr: decoded (UTF-8, errors replaced), at most max_output_bytes each;
    duration_s: wall time; network_isolated: whether the code ran without network."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.cache
def _unshare_prefix() -> tuple[str, ...]:
    """The ``unshare`` command that works here (probed once), or () when none does."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    options = [("-n",), ("-rn",)] if os.geteuid() == 0 else [("-rn",)]
    for opts in options:
        try:
            probe = subprocess.run([exe, *opts, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return (exe, *opts)
    return ()


# Runs first in the sandboxed interpreter: set the limits, then exec the program under them.
# (Done in the child rather than with Popen(preexec_fn=...), which is unsafe in threaded callers.)
_BOOT = """
import os, resource, sys
cpu, mem, fsize = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""


def run_code(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    stdin: str | None = None,
    max_output_bytes: int = 1 << 20,
    isolate_network: bool = True,
) -> SandboxResult:
    """Run Python source ``code`` under the limits in the module docstring; never raises for
    anything the code does (errors show in returncode/stderr). ``stdin`` is fed to the program.
    ``isolate_network=False`` skips the network namespace."""
    prefix = _unshare_prefix() if isolate_network else ()
    with tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code)
        (work / "stdin.txt").write_text(stdin or "")
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.monotonic()
        with open(work / "stdin.txt", "rb") as fin, open(work / "stdout.txt", "wb") as fout, \
                open(work / "stderr.txt", "wb") as ferr:  # fmt: skip
            limits = [str(math.ceil(timeout_s) + 1), str(memory_mb * 1024 * 1024), str(max_output_bytes)]
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-c", _BOOT, *limits],
                cwd=tmp, env=env, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True,
            )  # fmt: skip
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended on its own just now
                    pass
                proc.wait()
        duration = time.monotonic() - start
        out = (work / "stdout.txt").read_bytes()[:max_output_bytes].decode("utf-8", "replace")
        err = (work / "stderr.txt").read_bytes()[:max_output_bytes].decode("utf-8", "replace")
    return SandboxResult(proc.returncode, out, err, timed_out, duration, bool(prefix))


__all__ = ["run_code", "SandboxResult"]
