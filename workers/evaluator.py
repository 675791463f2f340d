"""HarnessEvaluator: one frozen copy of the model under evaluation, run through a standard
evaluation harness (lm-eval, :mod:`hybridflow.evals.harness`).

The evaluator is the only role of its pool (``placement.pools.<name>.roles: [evaluator]``, or
the pool a harness evaluation adds, ``trainer.eval.cpus``): it loads ``cfg.model.path``, which
the harness evaluation sets to the checkpoint (or model) it evaluates, never the live policy.
Training's pools never start it; :func:`flows.harness_eval.harness_evaluate` does, for one
evaluation, and takes it down after.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from hybridflow.config import ExperimentConfig
from workers.dispatch import dispatch


class HarnessEvaluator:
    """The model of ``cfg.model`` in eval mode on ``device`` (float32, or bfloat16 under bf16-true),
    with its tokenizer."""

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        from hybridflow.models import load_causal_lm, load_tokenizer

        self.cfg, self.rank, self.device = cfg, rank, device
        self.model = load_causal_lm(cfg.model, device=device, seed=cfg.trainer.seed).eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(cfg.model)

    @dispatch("rank_zero")
    def evaluate(self, tasks: list[str]) -> dict[str, Any]:
        """Run ``cfg.trainer.eval``'s harness on ``tasks``. Returns {"metrics": {"eval/<task>/<metric>":
        value}, "samples", "n_samples", "versions" (:class:`hybridflow.evals.harness.HarnessResult`),
        "eval_s": wall seconds}. Raises HarnessError (an unknown task, one that needs the network)."""
        from hybridflow.evals.harness import run_lm_eval

        ev = self.cfg.trainer.eval
        t0 = time.perf_counter()
        result = run_lm_eval(self.model, self.tokenizer, tasks, include_path=ev.include_path, limit=ev.limit,
                             batch_size=ev.batch_size, apply_chat_template=ev.apply_chat_template,
                             system_instruction=ev.system_instruction, log_samples=ev.log_samples,
                             seed=self.cfg.trainer.seed)
        return {**asdict(result), "eval_s": time.perf_counter() - t0}
