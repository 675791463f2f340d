"""advantage node: KL-in-reward / overlong shaping, then the configured estimator (pure maths
lives in hybridflow.algorithms.pipeline; this is glue)."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.types import AdvantageResult


@node(name="advantage", retries=1)
def advantage(
    run: RunContext,
    rollout: Batch,
    reward: Batch,
    reference: Batch | None = None,
    values: Batch | None = None,
    kl_coef: float | None = None,
) -> tuple[Batch, AdvantageResult]:
    """Joins the upstream fields and returns the training batch with token_level_rewards,
    advantages and returns. ``kl_coef`` is the KL controller's current β (adaptive control); the
    result's ``kl_coef_next`` is its β after this iteration, which the driver carries to the next."""
    from hybridflow.algorithms import make_kl_controller
    from hybridflow.algorithms.pipeline import compute_advantages
    from hybridflow.metrics import compute_data_metrics

    cfg = run.cfg()
    batch = rollout
    for extra in (reward, reference, values):
        if extra is not None:
            batch = batch.union(extra)
    ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
    if kl_coef is not None:
        ctrl.value = kl_coef
    batch, metrics = compute_advantages(
        batch, cfg.algorithm, max_response_tokens=cfg.rollout.max_response_tokens, kl_controller=ctrl
    )
    metrics.update(compute_data_metrics(batch, max_response_tokens=cfg.rollout.max_response_tokens))
    metrics["critic/kl_coef_next"] = ctrl.value  # logged as verl's metric too
    return batch, AdvantageResult(node="advantage", metrics=metrics, kl_coef_next=ctrl.value)
