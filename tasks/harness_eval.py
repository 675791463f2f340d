"""lm_eval task: one harness evaluation on the evaluator pool (:class:`workers.evaluator.HarnessEvaluator`)."""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks.common import RunContext
from tasks.pools import pool_of


@task(name="lm_eval", retries=0, persist_result=False)
def harness_eval(run: RunContext, tasks: list[str]) -> dict[str, Any]:
    """Evaluate the evaluator pool's model on lm-eval ``tasks`` under ``run``'s ``trainer.eval``.
    Returns the evaluator's result dict ({"metrics", "samples", "n_samples", "versions", "eval_s"}).
    No retries: an evaluation that fails is reported, and training does not wait for it."""
    return pool_of(run, "evaluator").evaluate(tasks)
