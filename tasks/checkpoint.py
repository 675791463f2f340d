"""checkpoint node: each stateful pool writes its part of ``checkpoints/iter_<k>``; the driver
state (sampler, versions, KL coef) goes in ``trainer_state.json``; ``latest`` moves last."""

from __future__ import annotations

from typing import Any

from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of
from tasks.types import NodeResult


@node(name="checkpoint", cache=False, retries=1, roles=("policy", "critic"))
def checkpoint(run: RunContext, trainer_state: dict[str, Any]) -> NodeResult:
    """Save the pools at the driver's versions (a worker that restarted since the last update is
    brought to them first, so no stale weights are saved under this iteration)."""
    from workers.checkpoint import begin_save, commit_save

    cfg = run.cfg()
    handles = [pool_of(run, "policy", at_version=trainer_state["policy_version"])]
    if cfg.needs_critic:
        handles.append(pool_of(run, "critic", at_version=trainer_state["critic_version"]))
    path = begin_save(run.ckpt_root, run.iteration)
    for handle in handles:
        handle.save_checkpoint(path)
    commit_save(run.ckpt_root, run.iteration, trainer_state)
    return NodeResult(node="checkpoint", metrics={"checkpoint/iteration": run.iteration})
