"""Log-probs of the response tokens under a policy module, and the trainer-vs-rollout log-prob gap
(``rollout/logprob_diff_*``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridflow.algorithms import entropy_from_logits, log_probs_from_logits
from hybridflow.batch import Batch
from workers import distributed as D
from workers import shared_prefix


def sequence_log_probs(
    model: nn.Module, batch: Batch, *, temperature: float, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens under ``model`` on logits / temperature.

    batch: prompt_ids/prompt_mask [B, P] (left padded), response_ids/response_mask [B, R];
    position_ids [B, P+R] when present, else from the attention mask. Tensors are moved to
    the model's device. Returns ([B, R] float32 nats, [B, R] float32 entropy or None), on the
    model's device; positions outside response_mask hold numbers the caller masks out.
    entropy_grad: keep the entropy in the autograd graph (for an entropy bonus).
    """
    response_logits = shared_prefix.response_logits(model, batch)
    device = response_logits.device
    log_probs = log_probs_from_logits(response_logits, batch["response_ids"].to(device), temperature=temperature)
    entropy = None
    if with_entropy:
        src = response_logits if entropy_grad else response_logits.detach()
        entropy = entropy_from_logits(src, temperature=temperature)
    return log_probs, entropy


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the (possibly DDP/FSDP/PEFT-wrapped) causal LM's forward takes ``logits_to_keep``."""
    return bool(shared_prefix.forward_kwargs(model)[1])


class LogprobGap:
    """|trainer − rollout| log-prob statistics over response tokens (``rollout/logprob_diff_*``):
    :meth:`add` per chunk on this rank, :meth:`metrics` reduces over ranks (collective)."""

    def __init__(self) -> None:
        self.total, self.tokens, self.max = 0.0, 0.0, 0.0

    def add(self, log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> None:
        """log_probs / rollout_log_probs [B, R] nats, mask [B, R] bool (True = response token)."""
        mask = mask.to(log_probs.device)
        diff = (log_probs.detach().float() - rollout_log_probs.to(log_probs.device)).abs().masked_fill(~mask, 0.0)
        self.total += float(diff.sum())
        self.tokens += float(mask.sum())
        self.max = max(self.max, float(diff.max()) if diff.numel() else 0.0)

    def metrics(self) -> dict[str, float]:
        tot = D.all_reduce_sum(torch.tensor([self.total, self.tokens], dtype=torch.float64)).tolist()
        mx = D.all_reduce_max(torch.tensor([self.max], dtype=torch.float64)).tolist()
        return {"rollout/logprob_diff_max": mx[0], "rollout/logprob_diff_mean": tot[0] / max(tot[1], 1.0)}


__all__ = ["sequence_log_probs", "accepts_logits_to_keep", "LogprobGap"]
