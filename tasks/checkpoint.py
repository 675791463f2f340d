"""checkpoint node: each stateful pool writes its part of ``checkpoints/step_<k>``; the driver
state (sampler, versions, KL coef) goes in ``trainer_state.json``; ``latest`` moves last."""

from __future__ import annotations

from typing import Any

from tasks.common import NodeResult, RunContext, metrics_result
from tasks.node import node
from tasks.pools import pool_of


@node(name="checkpoint", cache=False, retries=1)
def checkpoint(run: RunContext, trainer_state: dict[str, Any]) -> NodeResult:
    from workers.checkpoint import begin_save, commit_save

    cfg = run.cfg()
    path = begin_save(run.ckpt_root, run.iteration)
    pool_of(run, "policy").call("policy", "save_checkpoint", path)
    if cfg.needs_critic:
        pool_of(run, "critic").call("critic", "save_checkpoint", path)
    commit_save(run.ckpt_root, run.iteration, trainer_state)
    return metrics_result("checkpoint", {"checkpoint/iteration": run.iteration})
