"""Token-level estimators built on a backward recursion over time: gae, reinforce_plus_plus.

Same signature and output contract as :mod:`hybridflow.algorithms.advantages`. The recursion
runs over the response positions (a loop over time, vectorised over the batch) and stops at
the last position any sample uses. Positions outside the mask are skipped exactly as in verl:
they neither take a TD error nor break the chain, so masked rewards and values never change
an output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hybridflow.algorithms.advantages import _check_shapes
from hybridflow.algorithms.core import masked_whiten
from hybridflow.algorithms.registry import register_advantage_estimator


def _used_width(mask: Tensor) -> int:
    """1 + the last column where any row is valid (0 for an all-False mask)."""
    cols = mask.any(0).nonzero()
    return int(cols[-1]) + 1 if len(cols) else 0


@register_advantage_estimator("gae")
def gae(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438) for PPO.

    values: [batch, response_len] float32 critic values V(s_t) (required).
    δ_t = r_t + γ·V(s_next) − V(s_t); A_t = δ_t + γλ·A_next, where "next" is the next valid
    position (V = 0 and A = 0 after the last one). returns = A + V (before whitening);
    advantages are whitened over all valid tokens of the batch (as verl / TRL).
    Raises ValueError without values.
    """
    mask = _check_shapes(token_level_rewards, response_mask)
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values (the critic's V(s_t), [batch, response_len])")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} must match response_mask {tuple(mask.shape)}")
    width = _used_width(mask)
    # time-major and contiguous, so each step reads one row
    m_t = mask[:, :width].T.contiguous()
    r_t = torch.where(m_t, token_level_rewards[:, :width].T, 0.0).contiguous()
    v_t = torch.where(m_t, values[:, :width].T, 0.0).to(r_t.dtype).contiguous()
    adv_t = torch.zeros_like(r_t)
    next_value = torch.zeros_like(r_t[0]) if width else None
    last_adv = torch.zeros_like(r_t[0]) if width else None
    for t in range(width - 1, -1, -1):
        delta = r_t[t] + gamma * next_value - v_t[t]
        candidate = delta + (gamma * lam) * last_adv
        next_value = torch.where(m_t[t], v_t[t], next_value)
        last_adv = torch.where(m_t[t], candidate, last_adv)
        adv_t[t] = last_adv
    raw = torch.zeros_like(token_level_rewards, dtype=r_t.dtype)
    raw[:, :width] = adv_t.T
    v_full = torch.where(mask, values, 0.0).to(raw.dtype)
    returns = torch.where(mask, raw + v_full, 0.0)
    advantages = torch.where(mask, masked_whiten(raw, mask), 0.0)
    return advantages, returns


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted reward-to-go, whitened over the batch.

    returns_t = r_t + γ·returns_{t+1} along the valid positions; a masked position ends the
    chain (verl's "reset after EOS"). advantages = returns whitened over all valid tokens of the
    batch (global batch normalisation, no group baseline).
    """
    mask = _check_shapes(token_level_rewards, response_mask)
    width = _used_width(mask)
    m_t = mask[:, :width].T.contiguous()
    r_t = torch.where(m_t, token_level_rewards[:, :width].T, 0.0).contiguous()
    ret_t = torch.zeros_like(r_t)
    running = torch.zeros_like(r_t[0]) if width else None
    for t in range(width - 1, -1, -1):
        running = r_t[t] + gamma * running
        ret_t[t] = running
        running = torch.where(m_t[t], running, 0.0)
    returns = torch.zeros_like(token_level_rewards)
    returns[:, :width] = ret_t.T
    returns = torch.where(mask, returns, 0.0)
    advantages = torch.where(mask, masked_whiten(returns, mask), 0.0)
    return advantages, returns


__all__ = ["gae", "reinforce_plus_plus"]
