"""The ``publish_weights`` node: the policy's new weights to the rollout pool (asynchronous training).

Glue over :class:`workers.weight_sync.WeightSync` (the transport: object store or collective,
versions kept, fall-back; docs/async.md). The node runs after ``update_policy`` when a rollout pool
is used; an update that was not applied (every step skipped, NaN/inf) publishes nothing. Not
cached, retried: publishing a version again is safe (the policy is first brought to the version
the update reports, by the ledger, and the rollout ranks file it again).
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from hybridflow.metric_names import METRIC_NAMES
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of
from tasks.types import UpdateResult
from workers.weight_sync import SyncReport, WeightSync, versions_kept


def weight_sync(run: RunContext, *, policy_version: int | None = None, rollout: Any = None) -> WeightSync:
    """This run's WeightSync: the rollout role's handle (``rollout``, or this run's), the policy's
    asked for when first needed (brought to ``policy_version`` by the update ledger; None: as it is)."""
    cfg = run.cfg()
    return WeightSync(policy=lambda: pool_of(run, "policy", at_version=policy_version),
                      rollout=pool_of(run, "rollout") if rollout is None else rollout, mode=cfg.weight_sync_mode,
                      keep=versions_kept(cfg.trainer.max_staleness), warn=_warn,
                      timeout_s=cfg.trainer.weight_sync_timeout_s)


def sync_metrics(report: SyncReport) -> dict[str, float]:
    """A publish as metrics: ``timing_s/weight_sync`` (seconds), ``perf/weight_sync_bytes``,
    ``perf/weight_sync_collective`` (1: broadcast, 0: object store)."""
    return {METRIC_NAMES["weight_sync_time_s"]: report.seconds, "perf/weight_sync_bytes": float(report.bytes),
            "perf/weight_sync_collective": float(report.collective)}


@node(name="publish_weights", cache=False, retries=2, roles=("policy", "rollout"))
def publish_weights(run: RunContext, update_policy: UpdateResult) -> dict[str, float]:
    """Publish the updated policy's weights (version ``update_policy.version``) to every rollout
    rank, after the iterations :meth:`~hybridflow.config.ExperimentConfig.publishes_after` names
    (``trainer.updates_per_sync``); nothing after the others, nor when the update was not applied and
    every update is published (its version went out before). Raises VersionError when the policy
    cannot be brought to that version."""
    cfg = run.cfg()
    if not cfg.publishes_after(run.iteration):
        return {}
    if not update_policy.applied and cfg.trainer.updates_per_sync == 1:
        return {}
    return sync_metrics(weight_sync(run, policy_version=update_policy.version).publish(update_policy.version))


def rollout_weights_at(run: RunContext, rollout: Any, version: int) -> None:
    """Make every rank of ``rollout`` (the rollout role's handle) generate with the policy weights of
    ``version`` (:meth:`workers.weight_sync.WeightSync.ensure`; VersionError when no one holds them)."""
    weight_sync(run, rollout=rollout).ensure(version)


def _warn(line: str) -> None:
    get_run_logger().warning(line)


__all__ = ["publish_weights", "rollout_weights_at", "sync_metrics", "weight_sync"]
