"""The pools' lifetime for one run: ``with run_pools(cfg, namespace, ckpt_root) as pools: ...``.

Entering checks the reward function (before Ray and the pools: a clear error, not a dead actor),
starts or joins Ray (:func:`flows.runtime.ensure_ray`) and creates every pool of
``cfg.placement.pools``; leaving destroys them, on success and on error alike, unless
``placement.keep_pools`` keeps them for the next run (a notebook, a sweep).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybridflow.config import ExperimentConfig


@contextmanager
def run_pools(cfg: ExperimentConfig, namespace: str, ckpt_root: str) -> Iterator[dict[str, Any]]:
    """Bring the run's pools up; yields {pool name: ``workers.pool.Pool``}.

    namespace: the run's Ray namespace (``workers.pool.namespace_for(run_id)``); ckpt_root: the
    run's ``checkpoints/`` (a restarted worker restores from it). Raises ConfigError (the
    tools / environment do not load), PreflightError (the reward function does not load),
    PoolError / PoolResourceError (a pool cannot be placed or started; the pools created before
    it are left to Ray, as a failed start always did).
    """
    from flows.preflight import check_reward_function
    from flows.runtime import ensure_ray
    from hybridflow.agents.checks import check_user_code
    from workers.pool import create_pools

    check_user_code(cfg)  # the tools / environment import (ConfigError), before Ray starts
    check_reward_function(cfg)
    ensure_ray(cfg)
    pools = create_pools(cfg, namespace=namespace, ckpt_root=ckpt_root)
    try:
        yield pools
    finally:
        if not cfg.placement.keep_pools:
            from workers.pool import destroy_pool

            for pool in pools.values():
                destroy_pool(pool)


__all__ = ["run_pools"]
