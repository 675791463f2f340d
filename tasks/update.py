"""update_policy / update_critic nodes: exactly-once updates against the pool's weights_version.

The pool applies an update only at ``expected_version``. Each applied update is appended to a
ledger in the run directory (``updates_<role>.jsonl``: version before, batch uri, checksum), so
a pool that restarted from an older checkpoint is brought back to ``expected_version`` by
replaying the recorded batches in order — deterministic, so the weights equal an
uninterrupted run's. These nodes are not cached; Prefect retries them (a worker that died
mid-update is restarted by Ray), which is safe because a retry goes through the same version
check: at ``expected_version`` the update is applied, one version past it with the same batch
the recorded metrics come back, and nothing is ever applied twice.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from hybridflow.batch import BatchRef
from tasks.common import NodeResult, RunContext, metrics_result
from tasks.node import node
from tasks.pools import pool_of

METHODS = {"policy": ("update_policy", "actor"), "critic": ("update_critic", "critic")}


def _ledger_path(run: RunContext, role: str) -> str:
    return f"{run.run_dir}/updates_{role}.jsonl"


def read_ledger(run: RunContext, role: str) -> list[dict[str, Any]]:
    fs, path = fsspec.core.url_to_fs(_ledger_path(run, role))
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


def _append_ledger(run: RunContext, role: str, entry: dict[str, Any]) -> None:
    fs, path = fsspec.core.url_to_fs(_ledger_path(run, role))
    with fs.open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def weights_version(pool: Any, role: str) -> int:
    """The pool's weights_version (all ranks must agree)."""
    got = pool.call(role, "get_weights_version")
    versions = set(got) if isinstance(got, list) else {got}
    if len(versions) != 1:
        raise RuntimeError(f"{role} pool ranks disagree on weights_version: {sorted(versions)}")
    return versions.pop()


def sync_to_version(run: RunContext, role: str, pool: Any, expected_version: int | None) -> None:
    """Bring a pool that restarted from an older checkpoint (or none) to ``expected_version`` by
    replaying the ledger's recorded batches in order (deterministic: the weights equal an
    uninterrupted run's). Every node that uses a trained role's weights calls it first, so a
    restarted worker never generates, scores or saves with stale weights. None = no check.
    Raises RuntimeError when the pool is ahead of ``expected_version`` (with a different batch
    than the one being replayed, the update refuses) or the ledger lacks a needed update."""
    if expected_version is None:
        return
    method, _prefix = METHODS[role]
    current = weights_version(pool, role)
    ledger = {e["version_before"]: e for e in read_ledger(run, role)}
    while current < expected_version:
        entry = ledger.get(current)
        if entry is None:
            raise RuntimeError(
                f"{role} pool is at weights_version {current} but the run expects {expected_version}, "
                f"and the ledger has no update recorded at version {current}"
            )
        ref = BatchRef.from_dict(entry["ref"])
        pool.call(role, method, ref.load(), expected_version=current, batch_id=ref.checksum)
        current = weights_version(pool, role)


def apply_update(run: RunContext, role: str, batch_ref: BatchRef, expected_version: int) -> dict[str, float]:
    """Bring the pool to ``expected_version`` (replaying the ledger if it restarted from an older
    checkpoint), then apply this batch exactly once. Returns the update's metrics."""
    method, _prefix = METHODS[role]
    pool = pool_of(run, role)
    sync_to_version(run, role, pool, expected_version)
    ledger = {e["version_before"]: e for e in read_ledger(run, role)}
    metrics = pool.call(role, method, batch_ref.load(), expected_version=expected_version, batch_id=batch_ref.checksum)
    if not metrics.get(f"{_prefix}/update_skipped", 0.0):
        if expected_version not in ledger:
            _append_ledger(run, role, {"version_before": expected_version, "iteration": run.iteration,
                                       "ref": batch_ref.to_dict()})
    return metrics


def _run_update(run: RunContext, role: str, advantage: NodeResult, expected_version: int) -> NodeResult:
    from prefect import get_run_logger

    ref = BatchRef.from_dict(advantage["ref"])
    metrics = apply_update(run, role, ref, expected_version)
    get_run_logger().info("%s update at version %d: %s", role, expected_version,
                          ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())[:10]))
    return metrics_result(f"update_{role}", metrics)


@node(name="update_critic", cache=False, retries=2)
def update_critic(run: RunContext, advantage: NodeResult, critic_version: int) -> NodeResult:
    """Value-model update on the training batch (needs values, returns)."""
    return _run_update(run, "critic", advantage, critic_version)


@node(name="update_policy", cache=False, retries=2)
def update_policy(run: RunContext, advantage: NodeResult, policy_version: int) -> NodeResult:
    """Policy update on the training batch (needs old_log_probs, advantages, response_mask)."""
    return _run_update(run, "policy", advantage, policy_version)
