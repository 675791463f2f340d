"""Finding a role from inside a task: healthy (restarted ranks restored), at the weights version
the run expects, its worker methods bound."""

from __future__ import annotations

from tasks.common import RunContext
from workers.handles import RoleHandle
from workers.pool import ensure_healthy, get_pool, pool_for_role


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
