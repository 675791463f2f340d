"""ReferenceWorker: log-probs of the frozen initial policy, for KL in the reward or the loss.

Either a separate frozen copy of the initial policy (built exactly as the policy is: same
model, same seed), or — when the policy is trained with LoRA and lives in this process — the
policy's own module with its adapters disabled (the base weights are frozen, so that *is*
the initial policy; no second copy, Hu et al. 2021).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from hybridflow.batch import Batch
from hybridflow.config import ExperimentConfig
from hybridflow.precision import resolved_precision
from workers.dispatch import dispatch
from workers.log_probs import sequence_log_probs
from workers.micro_batches import chunked_inference, disable_dropout
from workers.policy import PolicyWorker


class ReferenceWorker:
    """Reference policy on one rank. ``policy``: the PolicyWorker of the same process, if any
    (used only when ``cfg.model.lora_rank > 0``)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str = "cpu",
        policy: PolicyWorker | None = None,
    ):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.shares_policy = cfg.model.lora_rank > 0 and policy is not None
        if self.shares_policy:
            assert policy is not None
            self._policy = policy
            self.module: nn.Module | None = None
        else:
            from hybridflow.models import load_causal_lm

            # the initial policy without adapters (LoRA starts with B = 0, so they would be no-ops)
            module = disable_dropout(load_causal_lm(cfg.model, device=torch.device(device), seed=cfg.trainer.seed))
            module.requires_grad_(False)
            self.module = module.eval()

    def _model(self) -> tuple[nn.Module, AbstractContextManager]:
        if self.shares_policy:
            from hybridflow.models import adapter_disabled

            module = self._policy.inference_module  # unsharded, current weights
            return module, adapter_disabled(module)
        assert self.module is not None
        return self.module, nullcontext()

    @dispatch("dp_scatter")
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """Adds ``ref_log_probs`` [B, R] float32 nats (logits / rollout.temperature), 0 outside
        response_mask. Needs prompt_ids/prompt_mask/response_ids/response_mask (+ position_ids)."""
        module, ctx = self._model()
        temp = self.cfg.rollout.temperature

        def run(chunk: Batch) -> torch.Tensor:
            return sequence_log_probs(module, chunk, temperature=temp, lm_head=self.cfg.actor.lm_head,
                                      pack_rows=self.cfg.actor.pack_rows,
                                      precision=resolved_precision(self.cfg))[0].float().cpu()

        with ctx:
            parts = chunked_inference(module, batch, self.cfg.reference.micro_batch_trajectories, run)
        out = batch.shallow_copy()
        out.set("ref_log_probs", torch.cat(parts).masked_fill(~batch["response_mask"], 0.0))
        return out


__all__ = ["ReferenceWorker"]
