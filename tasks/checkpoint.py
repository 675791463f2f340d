"""checkpoint node: each stateful pool writes its part of ``checkpoints/step_<k>``; the driver
state (sampler, versions, KL coef) goes in ``trainer_state.json``; ``latest`` moves last."""

from __future__ import annotations

from typing import Any

from tasks.common import NodeResult, RunContext, metrics_result
from tasks.node import node
from tasks.pools import pool_of


@node(name="checkpoint", cache=False, retries=1)
def checkpoint(run: RunContext, trainer_state: dict[str, Any]) -> NodeResult:
    from tasks.update import sync_to_version
    from workers.checkpoint import begin_save, commit_save

    cfg = run.cfg()
    policy = pool_of(run, "policy")
    # a worker that restarted since the last update must not save stale weights under this step
    sync_to_version(run, "policy", policy, trainer_state["policy_version"])
    critic = pool_of(run, "critic") if cfg.needs_critic else None
    if critic is not None:
        sync_to_version(run, "critic", critic, trainer_state["critic_version"])
    path = begin_save(run.ckpt_root, run.iteration)
    policy.call("policy", "save_checkpoint", path)
    if critic is not None:
        critic.call("critic", "save_checkpoint", path)
    commit_save(run.ckpt_root, run.iteration, trainer_state)
    return metrics_result("checkpoint", {"checkpoint/iteration": run.iteration})
