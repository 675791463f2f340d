"""Finding a role from inside a task: healthy (restarted ranks restored), at the weights version
the run expects, its worker methods bound."""

from __future__ import annotations

from tasks.common import RunContext
from workers.handles import RoleHandle
from workers.pool import ensure_healthy, get_pool, pool_for_role, wait_for_pools
from workers.runtime import ray_running


def pool_of(run: RunContext, role: str, *, at_version: int | None = None) -> RoleHandle:
    """The role handle of ``role`` in this run's pools (:class:`workers.handles.RoleHandle`:
    ``pool_of(run, "policy").generate_sequences(batch)``). Waits for a restarted actor to restore;
    ``at_version``: a trained role's weights are first brought to that weights_version by replaying
    the update ledger (:func:`tasks.versions.sync_to_version`; VersionError when they cannot be)."""
    from tasks.versions import sync_to_version

    cfg = run.cfg()
    name = pool_for_role(cfg, role)
    pool = ensure_healthy(cfg, get_pool(name, run.namespace, tuple(cfg.placement.pools[name].roles)),
                          ckpt_root=run.ckpt_root)
    handle = pool.role(role)
    sync_to_version(run, role, handle, at_version)
    return handle


def wait_for_run_pools(run: RunContext) -> float:
    """Before a node's retry: wait (``placement.retry_wait_s`` per pool) until every pool of the run
    has every rank back and ready (:func:`workers.pool.wait_for_pools`), whichever pool's actor died,
    including one the node reaches only through another (the tools pool behind a rollout). Returns
    the seconds waited (0.0 without Ray: a thread-runner test has no pools). Raises PoolError."""
    if not ray_running():
        return 0.0
    cfg = run.cfg()
    return wait_for_pools(cfg, run.namespace, ckpt_root=run.ckpt_root, wait_s=cfg.placement.retry_wait_s)
