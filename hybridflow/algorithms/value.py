"""Clipped value loss for the PPO critic."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algorithms.aggregation import aggregate_loss
from hybridflow.algorithms.core import _as_bool, masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range_value: float,
    loss_agg_mode: str,
    global_normalizer: float | Tensor | None = None,
    max_response_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (PPO, Schulman et al. 2017; the form used by verl, TRL, OpenAI baselines).

    values: [batch, response_len] float32, current critic predictions (carry the graph);
    old_values: same, the predictions stored when the batch was made (batch key ``values``);
    returns: same, the targets. Per token ½·max((V − R)², (clip(V, V_old ± ε) − R)²),
    aggregated by ``loss_agg_mode`` (``global_normalizer`` / ``max_response_tokens`` as for
    policy losses). Metrics: ``vf_loss``, ``vf_clipfrac`` (fraction of valid tokens where the
    clipped term is larger), ``vpred_mean``. Masked positions never change the result.
    """
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError("values, old_values, returns and response_mask must all have one shape")
    if clip_range_value <= 0:
        raise ValueError(f"clip_range_value must be > 0, got {clip_range_value}")
    mask = _as_bool(response_mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    v_old = torch.where(mask, old_values, zero)
    r = torch.where(mask, returns, zero)
    v_clipped = v_old + torch.clamp(v - v_old, -clip_range_value, clip_range_value)
    loss_unclipped = (v - r).square()
    loss_clipped = (v_clipped - r).square()
    token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss = aggregate_loss(
        token_loss, mask, loss_agg_mode, max_response_tokens=max_response_tokens, global_normalizer=global_normalizer
    )
    metrics = {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": float(masked_mean((loss_clipped > loss_unclipped).float(), mask)),
        "vpred_mean": float(masked_mean(v.detach(), mask)),
    }
    return loss, metrics


__all__ = ["value_loss"]
