"""The names of a run folder's files and folders: the one module that spells them.

Layout of ``<trainer.run_dir>/<run_id>/``::

    config.yaml            CONFIG         the resolved experiment config (a resume runs it)
    run.json               RUN_INFO       identity: run_id, MLflow run, Prefect flow run, overrides
    run.lock               RUN_LOCK       the run's lock (flows/run_lock.py)
    metrics.jsonl          METRICS        one {"iteration", "metrics"} line per iteration
    validation.jsonl       VALIDATION     one {"iteration", "metrics"} line per validation
    summary.json           SUMMARY        the end-of-run summary
    execution_log.jsonl    EXECUTION_LOG  one line per node body that ran (tasks/common.py)
    pool_events.jsonl      POOL_EVENTS    one line per (re)start and stop of a pool rank
    iter_000007/           iteration_name(7): that iteration's node outputs, <node>.{safetensors,json}
    updates_policy.jsonl   ledger_name("policy"): the exactly-once ledger of a trained role
    checkpoints/           CHECKPOINTS: iter_000010/ (legacy step_000010/) ... and LATEST
    prefect-results/       RESULTS        Prefect result storage: the node-level cache

Pure names, no imports: every layer (workers, tasks, flows) reads them before any server or model
starts. These names are on disk in existing run folders: changing one breaks their resume.
"""

from __future__ import annotations

CONFIG = "config.yaml"
RUN_INFO = "run.json"
RUN_LOCK = "run.lock"
METRICS = "metrics.jsonl"
VALIDATION = "validation.jsonl"
SUMMARY = "summary.json"
EXECUTION_LOG = "execution_log.jsonl"
POOL_EVENTS = "pool_events.jsonl"
CHECKPOINTS = "checkpoints"
RESULTS = "prefect-results"

ITERATION_PREFIX = "iter_"  # iter_000007: node outputs of RL iteration 7, and its checkpoint folder
LEGACY_CHECKPOINT_PREFIX = "step_"  # the checkpoint folder as runs before issue 14 named it: always read
LATEST = "latest"  # checkpoints/latest: a text file naming the newest committed checkpoint folder
BATCH_SUFFIXES = (".safetensors", ".json")  # a saved node output: <node>.safetensors + <node>.json

#: The version of this layout and of what its files hold, recorded in run.json as ``run_format``
#: (with ``hybridflow_version``) when a run starts. A resume reads formats 1..RUN_FORMAT (a run.json
#: without ``run_format``, written before it was recorded, is format 1: the layout has not changed
#: since) and refuses any other in one line (flows/preflight_inputs.py ``check_run_format``). Raise
#: it, with a migration there, when a change makes older folders read differently.
RUN_FORMAT = 1


def iteration_name(iteration: int, prefix: str = ITERATION_PREFIX) -> str:
    """``iter_000007`` for 7 (six digits, zero padded; ``prefix`` for the legacy checkpoint name)."""
    return f"{prefix}{iteration:06d}"


def iteration_of(name: str, prefixes: tuple[str, ...] = (ITERATION_PREFIX,)) -> int | None:
    """7 for ``iter_000007`` (a name, not a path; any of ``prefixes``); None for any other name."""
    for prefix in prefixes:
        digits = name.removeprefix(prefix)
        if digits != name and digits.isdigit():
            return int(digits)
    return None


def ledger_name(role: str) -> str:
    """``updates_<role>.jsonl``: the exactly-once ledger of a trained role (tasks/versions.py)."""
    return f"updates_{role}.jsonl"


__all__ = [
    "CONFIG", "RUN_INFO", "RUN_LOCK", "METRICS", "VALIDATION", "SUMMARY", "EXECUTION_LOG", "POOL_EVENTS",
    "CHECKPOINTS", "RESULTS", "ITERATION_PREFIX", "LEGACY_CHECKPOINT_PREFIX", "LATEST", "BATCH_SUFFIXES",
    "iteration_name", "iteration_of", "ledger_name",
]
