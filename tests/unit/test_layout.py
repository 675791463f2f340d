"""hybridflow/layout.py: the run folder's names, spelled once; they are on disk in old run folders."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hybridflow import layout as L


def test_names_on_disk_do_not_change():
    """Old run folders resume only while these names stay what they were."""
    assert (L.CONFIG, L.RUN_INFO, L.RUN_LOCK, L.METRICS, L.VALIDATION, L.SUMMARY) == (
        "config.yaml", "run.json", "run.lock", "metrics.jsonl", "validation.jsonl", "summary.json")
    assert (L.EXECUTION_LOG, L.POOL_EVENTS, L.CHECKPOINTS, L.RESULTS, L.LATEST) == (
        "execution_log.jsonl", "pool_events.jsonl", "checkpoints", "prefect-results", "latest")
    assert L.iteration_name(7) == "iter_000007" and L.iteration_name(7, L.LEGACY_CHECKPOINT_PREFIX) == "step_000007"
    assert L.ledger_name("critic") == "updates_critic.jsonl"


@pytest.mark.parametrize("name, prefixes, expected", [
    ("iter_000007", (L.ITERATION_PREFIX,), 7),
    ("step_000012", (L.ITERATION_PREFIX, L.LEGACY_CHECKPOINT_PREFIX), 12),
    ("step_000012", (L.ITERATION_PREFIX,), None),
    ("iter_000007.tmp", (L.ITERATION_PREFIX,), None),
    ("iter_", (L.ITERATION_PREFIX,), None),
    ("latest", (L.ITERATION_PREFIX,), None),
])
def test_iteration_of_reads_back_iteration_name(name, prefixes, expected):
    assert L.iteration_of(name, prefixes) == expected


def test_layout_depends_on_nothing():
    tree = ast.parse(Path(L.__file__).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert [getattr(n, "module", None) for n in imports] == ["__future__"]


def test_the_layers_use_the_layout_names():
    """The run folder's names are spelled in hybridflow/layout.py only (the modules that used to spell them)."""
    root = Path(__file__).resolve().parents[2]
    spelled = {"pool_events.jsonl", "execution_log.jsonl", "prefect-results", "run.json", "run.lock",
               "config.yaml", "metrics.jsonl", "checkpoints"}
    problems = []
    for rel in ("workers/pool_events.py", "workers/checkpoint.py", "tasks/common.py", "tasks/versions.py",
                "flows/run_dir.py", "flows/run_lock.py"):
        tree = ast.parse((root / rel).read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.FunctionDef | ast.ClassDef) and n.body
                      and isinstance(n.body[0], ast.Expr)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and id(n) not in docstrings and n.value in spelled:
                problems.append(f"{rel}:{n.lineno} spells {n.value!r}")
    assert not problems, "\n".join(problems)
