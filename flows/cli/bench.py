"""``hybridflow bench NAME [args ...]``: run ``bench/NAME.py`` (its ``main(argv)``) with the args.

Benchmarks live in the repository's ``bench/`` folder (not an installed package); each writes
JSON to ``bench/results/`` and its table into ``docs/benchmarks.md``. ``hybridflow bench list``
names them; ``hybridflow bench NAME --help`` shows a benchmark's own options.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
NOT_BENCHMARKS = {"__init__", "common", "harness"}  # helpers, not benchmarks


def available() -> list[str]:
    """Names of the benchmarks in bench/ (files other than helpers)."""
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in NOT_BENCHMARKS and not p.stem.startswith("_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    root = str(BENCH_DIR.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"bench.{args.name}", BENCH_DIR / f"{args.name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return int(module.main(list(args.args)) or 0)
