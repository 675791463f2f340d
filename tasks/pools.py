"""Finding a role's pool from inside a task, healthy (restarted ranks restored) before use."""

from __future__ import annotations

from tasks.common import RunContext
from workers.pool import Pool, ensure_healthy, get_pool, pool_for_role


def pool_of(run: RunContext, role: str) -> Pool:
    """The healthy pool that hosts ``role`` for this run (waits for a restarted actor to restore)."""
    cfg = run.cfg()
    name = pool_for_role(cfg, role)
    pool = get_pool(name, run.namespace, tuple(cfg.placement.pools[name].roles))
    return ensure_healthy(cfg, pool, ckpt_root=run.ckpt_root)
