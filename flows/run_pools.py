"""The pools' lifetime, one way for every command: ``with open_pools(cfg, roles, ...) as pools: ...``.

Train brings up every pool of ``cfg.placement.pools`` for the run; evaluate only the pools of
the ``validate`` node's roles (policy, reward); ``hybridflow node run`` the one debug pool of
the node's roles. Entering checks the reward function when a reward pool is among them (before
Ray and the pools: a clear error, not a dead actor), starts or joins Ray
(:func:`flows.runtime.ensure_ray`) and creates the pools; leaving destroys them, on success and
on error alike, unless ``keep`` (train: ``placement.keep_pools``) keeps them for the next run (a
notebook, a sweep).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from hybridflow.config import ExperimentConfig


def pools_for(cfg: ExperimentConfig, roles: Collection[str] | None) -> list[str]:
    """The names of the pools of ``cfg.placement.pools`` that hold any of ``roles`` (None: all but the
    evaluator's, which only a harness evaluation starts, with the checkpoint it evaluates), in config order."""
    if roles is None:
        return [name for name, p in cfg.placement.pools.items() if p.roles != ["evaluator"]]
    return [name for name, p in cfg.placement.pools.items() if set(p.roles) & set(roles)]


@contextmanager
def open_pools(cfg: ExperimentConfig, roles: Collection[str] | None = None, *, namespace: str,
               ckpt_root: str | None = None, keep: bool = False) -> Iterator[dict[str, Any]]:
    """Bring up the pools holding ``roles`` (None: every pool; empty: none, and no Ray); yields
    {pool name: ``workers.pool.Pool``}.

    namespace: the Ray namespace (``workers.pool.namespace_for(run_id)``); ckpt_root: the run's
    ``checkpoints/`` (a restarted worker restores from it; None: the model path is the weights);
    keep: leave the pools up at exit. Raises PreflightError (the reward function does not load),
    ConfigError (the tools / environment do not load), PoolError / PoolResourceError (a pool cannot be placed or started; the pools created before
    it are destroyed unless ``keep``), PrecisionError (fp16-true on a CPU).
    Every pool follows one precision: the run's (``model.resolved_precision``, set by the train
    flow's ``open_run``), else decided here once for all of them.
    """
    from flows.preflight import check_reward_function
    from flows.runtime import ensure_ray
    from hybridflow.agents.checks import check_user_code
    from workers.pool import create_pool, destroy_pool

    names = pools_for(cfg, roles)
    if not names:
        yield {}
        return
    check_user_code(cfg)  # the tools / environment import (ConfigError), before Ray starts
    if cfg.model.resolved_precision is None:  # a command without a run (evaluate, node run): decide here
        from hybridflow.precision import with_resolved_precision
        from hybridflow.precision_probe import decide_precision

        cfg = with_resolved_precision(cfg, decide_precision(cfg))
    if any("reward" in cfg.placement.pools[n].roles for n in names):
        check_reward_function(cfg)
    ensure_ray(cfg)
    pools: dict[str, Any] = {}
    try:
        for name in names:
            pools[name] = create_pool(cfg, name, namespace=namespace, ckpt_root=ckpt_root)
        yield pools
    finally:
        if not keep:
            for pool in pools.values():
                destroy_pool(pool)


__all__ = ["open_pools", "pools_for"]
