"""``hybridflow bench NAME [args ...]``: run ``bench/NAME.py`` (its ``main(argv)``) with the args.

Benchmarks live in the repository's ``bench/`` folder (not an installed package); each writes
JSON to ``bench/results/`` and its table into ``docs/benchmarks.md``. ``hybridflow bench list``
names them; ``hybridflow bench NAME --help`` shows a benchmark's own options.

A benchmark runs in the environment the pools' actors start with: glibc malloc keeps freed
memory (``workers.allocator.KEEP_FREED_MEMORY_ENV``, ``placement.pools.NAME.keep_freed_memory``,
default on), so an engine or an update measured in the benchmark's own process runs as it does in a
pool, and a baseline measured beside it (bare ``generate``, a bare torch step, TRL's trainer)
gets the same allocator. glibc reads these variables only when a process starts, so the command
re-executes itself once with them set (only as the ``hybridflow`` command itself: a program that
calls ``flows.cli.main(argv)`` in-process keeps its own environment and process);
``hybridflow bench --allocator default NAME`` measures with glibc's defaults instead (the
variables removed if the caller's environment had them). Results record the setting
(``environment.allocator``, read from the environment the process started with).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
NOT_BENCHMARKS = {"__init__", "common", "harness"}  # helpers, not benchmarks
REEXEC_GUARD = "HYBRIDFLOW_BENCH_REEXECUTED"  # set in the re-executed process: it never re-executes again


def available() -> list[str]:
    """Names of the benchmarks in bench/ (files other than helpers)."""
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in NOT_BENCHMARKS and not p.stem.startswith("_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allocator", choices=["keep-freed", "default"], default="keep-freed",
                   help="glibc malloc settings of the benchmark's process: the pools' (keep-freed, the default) "
                        "or glibc's defaults")
    p.add_argument("name", help="benchmark to run: a file bench/NAME.py ('list' shows them)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see NAME --help)")


def run(args: argparse.Namespace) -> int:
    names = available()
    if args.name == "list":
        print("\n".join(names))
        return 0
    if args.name not in names:
        print(f"unknown benchmark {args.name!r}; available: {', '.join(names) or '(none)'}", file=sys.stderr)
        return 2
    if getattr(args, "_command_line", False):  # never replace a process that called main(argv) in-process
        _start_with_allocator(getattr(args, "allocator", None))
    root = str(BENCH_DIR.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"bench.{args.name}", BENCH_DIR / f"{args.name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from flows.services import stop_on_sigterm

    stop_on_sigterm()  # SIGTERM and SIGHUP unwind like Ctrl-C: the benchmark's finally blocks stop what it started
    return int(module.main(list(args.args)) or 0)


def _start_with_allocator(allocator: str | None) -> None:
    """Re-execute this command once with the environment ``allocator`` asks for: the pools' malloc
    settings (``keep-freed``) or none of them (``default``: removed if the caller had set them).
    Nothing happens when the environment already matches, for None, or in the re-executed process
    (``REEXEC_GUARD`` set), so it cannot loop."""
    from workers.allocator import KEEP_FREED_MEMORY_ENV

    if allocator not in ("keep-freed", "default") or os.environ.get(REEXEC_GUARD):
        return
    env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY_ENV}
    if allocator == "keep-freed":
        env |= KEEP_FREED_MEMORY_ENV
    if all(os.environ.get(k) == env.get(k) for k in KEEP_FREED_MEMORY_ENV):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env | {REEXEC_GUARD: "1"})
