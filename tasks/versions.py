"""The one owner of weights versions: exactly-once updates, the ledger, replay, the driver's count.

A trained role (``policy``, ``critic``) has a ``weights_version``: the number of updates applied
to its weights. Three parties agree on it:

- the **worker** applies an update only at the version the driver expects and answers a retry
  of the update it last applied with the recorded metrics (``workers.training.VersionedUpdates``);
- the **ledger** (``<run_dir>/updates_<role>.jsonl``: version before, iteration, batch ref) records
  every applied update, so a worker that restarted from an older checkpoint (or none) is brought
  back by replaying the recorded batches in order — deterministic, so its weights equal an
  uninterrupted run's (:func:`sync_to_version`);
- the **driver** counts the versions it expects (:func:`record_updates`, from the update nodes'
  :class:`~tasks.types.UpdateResult`), saves them in the checkpoint's trainer state and passes them
  into the next iteration (flow inputs ``policy_version`` / ``critic_version``).

A node that needs a trained role's weights asks for a handle already at version v
(``tasks.pools.pool_of(run, "policy", at_version=v)``); only the update nodes apply updates
(:func:`apply_update`). Retrying an update (Prefect ``retries``, a worker that died mid-update and
was restarted by Ray) is safe: it goes through the same version check.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from hybridflow.batch import BatchRef
from hybridflow.jsonl import append_line
from hybridflow.layout import ledger_name
from tasks.common import RunContext
from tasks.types import UpdateResult
from workers.outcome import UpdateOutcome
from workers.weight_sync import VersionError, weights_version

# role -> (worker update method, metric prefix)
TRAINED_ROLES = {"policy": ("update_policy", "actor"), "critic": ("update_critic", "critic")}


def ledger_path(run_dir: str, role: str) -> str:
    return f"{run_dir}/{ledger_name(role)}"


def read_ledger(run_dir: str, role: str) -> list[dict[str, Any]]:
    """The ledger's entries in order: ``{"version_before": int, "iteration": int, "ref": BatchRef dict}``."""
    fs, path = fsspec.core.url_to_fs(ledger_path(run_dir, role))
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


def _append_ledger(run_dir: str, role: str, entry: dict[str, Any]) -> None:
    fs, path = fsspec.core.url_to_fs(ledger_path(run_dir, role))
    append_line(fs, path, json.dumps(entry))


def _update(handle: Any, role: str, ref: BatchRef, expected_version: int) -> UpdateOutcome:
    """The role's update on ``ref``'s batch at ``expected_version`` (the worker's exactly-once call)."""
    batch, kwargs = ref.load(), {"expected_version": expected_version, "batch_id": ref.checksum}
    if role == "policy":
        return handle.update_policy(batch, **kwargs)
    if role == "critic":
        return handle.update_critic(batch, **kwargs)
    raise ValueError(f"{role!r} is not a trained role ({', '.join(TRAINED_ROLES)})")


def sync_to_version(run: RunContext, role: str, handle: Any, expected_version: int | None, *,
                    for_update: bool = False) -> None:
    """Bring ``handle``'s pool to ``expected_version`` by replaying the ledger from its current
    version (None: no check). Raises VersionError when the pool is ahead of ``expected_version``
    or the ledger has no update recorded at a version the replay needs. ``for_update``: one
    version ahead is left to the worker (the retry of the update it last applied returns that
    update's metrics; another batch is refused there)."""
    if expected_version is None:
        return
    current = weights_version(handle)
    if current > expected_version + (1 if for_update else 0):
        raise VersionError(f"{role} pool is at weights_version {current}, ahead of the {expected_version} "
                           "the run expects (another run, or a checkpoint newer than the driver's state?)")
    ledger = {e["version_before"]: e for e in read_ledger(run.run_dir, role)}
    while current < expected_version:
        entry = ledger.get(current)
        if entry is None:
            raise VersionError(
                f"{role} pool is at weights_version {current} but the run expects {expected_version}, "
                f"and the ledger {ledger_path(run.run_dir, role)} has no update recorded at version {current}"
            )
        _update(handle, role, BatchRef.from_dict(entry["ref"]), current)
        current = weights_version(handle)


def apply_update(run: RunContext, role: str, handle: Any, batch_ref: BatchRef, expected_version: int) -> UpdateResult:
    """Apply the update on ``batch_ref`` exactly once at ``expected_version`` (the handle must be
    brought to it first, :func:`sync_to_version`) and record it in the ledger. Returns the UpdateResult:
    ``applied`` False when every optimizer step was skipped (NaN/inf), ``version`` after it."""
    sync_to_version(run, role, handle, expected_version, for_update=True)
    outcome = _update(handle, role, batch_ref, expected_version)
    applied = outcome.applied
    if applied and expected_version not in {e["version_before"] for e in read_ledger(run.run_dir, role)}:
        _append_ledger(run.run_dir, role, {"version_before": expected_version, "iteration": run.iteration,
                                           "ref": batch_ref.to_dict()})
    return UpdateResult(node=f"update_{role}", metrics=dict(outcome.metrics), applied=applied,
                        version=expected_version + 1 if applied else expected_version)


def record_updates(state: Any, results: dict[str, Any]) -> None:
    """The driver's bookkeeping after an iteration: ``state.policy_version`` /
    ``state.critic_version`` := the version each update node reports (unchanged when it did not run)."""
    for role in TRAINED_ROLES:
        res = results.get(f"update_{role}")
        if isinstance(res, UpdateResult):
            setattr(state, f"{role}_version", res.version)


__all__ = ["TRAINED_ROLES", "VersionError", "apply_update", "ledger_path", "read_ledger", "record_updates",
           "sync_to_version", "weights_version"]
