"""Policy losses: ppo (clipped surrogate, clip-higher, dual-clip), gspo, reinforce, cispo.

Common signature (the registry contract)::

    fn(log_probs, old_log_probs, advantages, response_mask, **settings) -> (loss, metrics)

settings: keywords named by the fields of :class:`PolicyLossSettings` (``clip_ratio_low=0.2``,
``clip_ratio_high=0.2``, ``clip_ratio_c=3.0``, ``loss_agg_mode="token-mean"``,
``global_normalizer=None``, ``max_response_tokens=None``, ``token_weights=None``).
``token_weights``: [batch, response_len] float, detached, or None; when given, a loss multiplies
its per-token loss by it before aggregating (the off-policy correction,
:mod:`hybridflow.algorithms.rollout_correction`; the worker passes it only when
``actor.rollout_correction`` is on, so a user loss that does not take it still works without it).
None changes nothing (bit-identical to no weights).

log_probs: [batch, response_len] float32 nats under the current policy (carries the graph);
old_log_probs: same, under the trainer's weights before the update (no gradient; the policy that
generated the data, or with a rollout correction the proximal policy); advantages: same;
response_mask: bool. loss: 0-d tensor, aggregated with :func:`aggregate_loss` (pass
``global_normalizer`` for micro-batches — see :mod:`hybridflow.algorithms.aggregation`).
metrics: python floats ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
(KL(π_old‖π) ≈ mean(old − new) over the valid tokens of this batch). The worker prefixes them
with ``actor/`` and adds the KL loss and entropy terms itself.
Built-in losses reject unknown options (a misspelt option must not be silently ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from hybridflow.algorithms.aggregation import aggregate_loss
from hybridflow.algorithms.core import _as_bool, masked_mean
from hybridflow.algorithms.registry import register_policy_loss

LOG_RATIO_CLAMP = 20.0  # |log π/π_old| is clamped here before exp, as verl, so the ratio stays finite
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class PolicyLossSettings:
    """The keyword settings every policy loss accepts (the registry contract's ``**settings``).

    clip_ratio_low / clip_ratio_high: ε_low / ε_high of the ratio clip (unitless);
    clip_ratio_c: the dual-clip constant c (> 1, PPO only); loss_agg_mode and
    global_normalizer / max_response_tokens: as :func:`aggregate_loss` (micro-batch contract).
    token_weights: [batch, response_len] per-token loss weights (detached; positions outside the
    mask ignored) applied before aggregation, or None (no weighting).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    global_normalizer: float | Tensor | None = None
    max_response_tokens: int | None = None
    token_weights: Tensor | None = None

    def aggregate(self, token_loss: Tensor, mask: Tensor) -> Tensor:
        """[batch, response_len] per-token loss (× ``token_weights`` when set) → 0-d loss, by ``loss_agg_mode``."""
        if self.token_weights is not None:
            token_loss = token_loss * _safe(self.token_weights.detach().to(token_loss), mask)
        return aggregate_loss(
            token_loss, mask, self.loss_agg_mode,
            max_response_tokens=self.max_response_tokens, global_normalizer=self.global_normalizer,
        )


_SETTING_NAMES = frozenset(f.name for f in fields(PolicyLossSettings))


def _prepare(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, settings: dict
) -> tuple[Tensor, PolicyLossSettings]:
    unknown = sorted(set(settings) - _SETTING_NAMES)
    if unknown:
        raise TypeError(f"unknown policy-loss options: {unknown}")
    if not (log_probs.shape == old_log_probs.shape == advantages.shape == mask.shape) or log_probs.dim() != 2:
        raise ValueError(
            "log_probs, old_log_probs, advantages, response_mask must all be [batch, response_len]; got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    weights = settings.get("token_weights")
    if weights is not None and tuple(weights.shape) != tuple(mask.shape):
        raise ValueError(f"token_weights must be [batch, response_len] = {tuple(mask.shape)}; got {tuple(weights.shape)}")
    return _as_bool(mask), PolicyLossSettings(**settings)


def _safe(x: Tensor, mask: Tensor) -> Tensor:
    """Zero at masked positions, so NaN/inf there cannot reach the loss or its gradient."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _metrics(loss: Tensor, clipfrac: Tensor, clipfrac_lower: Tensor, log_ratio: Tensor, mask: Tensor) -> dict:
    return {
        "pg_loss": float(loss.detach()),
        "pg_clipfrac": float(clipfrac),
        "pg_clipfrac_lower": float(clipfrac_lower),
        "ppo_kl": float(masked_mean(-log_ratio.detach(), mask)),
    }


def ppo_token_losses(
    ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token dual-clip PPO loss and the two clip indicators (all [batch, response_len]).

    ℓ = max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)); for A < 0 additionally ℓ = min(ℓ, −A·c)
    (dual clip, Ye et al. 2020, arXiv:1912.09729). Returns (ℓ, clipped, dual_clipped) where
    clipped marks tokens whose clipped term won and dual_clipped those capped by c.
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss1 = torch.maximum(unclipped, clipped_loss)
    cap = -advantages * clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(loss1, cap), loss1)
    return loss, clipped_loss > unclipped, (loss1 > cap) & negative


@register_policy_loss("ppo")
def ppo(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **settings: Any,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO clip-higher (ε_high > ε_low,
    Yu et al. 2025) and dual clip for negative advantages (Ye et al. 2020).

    ρ = exp(clamp(log π − log π_old, ±20)). Per-token loss: see :func:`ppo_token_losses`.
    Worked values (ε = 0.2, c = 3): (ρ 5, A +1) → −1.2; (5, −1) → 3.0; (0.5, +1) → −0.5;
    (1.5, −1) → 1.5. pg_clipfrac: fraction of valid tokens where the ε-clip is active;
    pg_clipfrac_lower: where the dual clip (c) is active. Raises ValueError if c ≤ 1.
    """
    mask, s = _prepare(log_probs, old_log_probs, advantages, response_mask, settings)
    if s.clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {s.clip_ratio_c}")
    log_ratio = torch.clamp(_safe(log_probs - old_log_probs, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = _safe(advantages, mask)
    token_loss, clipped, dual = ppo_token_losses(
        torch.exp(log_ratio), adv, s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c
    )
    loss = s.aggregate(token_loss, mask)
    clipfrac = masked_mean(clipped.float(), mask)
    return loss, _metrics(loss, clipfrac, masked_mean(dual.float(), mask), log_ratio, mask)


@register_policy_loss("gspo")
def gspo(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **settings: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), GSPO-token form.

    Sequence ratio s_i = exp(mean_t (log π − log π_old)) over the valid tokens; each token uses
    s_i·π/sg(π) (value s_i, gradient of its own log-prob), log clamped at 10. Per-token loss
    max(−A·s, −A·clip(s, 1−ε_low, 1+ε_high)); no dual clip (clip_ratio_c unused,
    pg_clipfrac_lower = 0). The paper uses small ε (e.g. 3e-4 / 4e-4) and seq-mean-token-mean;
    the aggregation follows ``loss_agg_mode`` so the accumulation contract holds. ``token_weights``
    multiply each token's term (the sequence ratio itself stays unweighted).
    """
    mask, s = _prepare(log_probs, old_log_probs, advantages, response_mask, settings)
    token_log_ratio = _safe(log_probs - old_log_probs, mask)
    lengths = torch.count_nonzero(mask, -1).unsqueeze(-1).clamp(min=1).to(log_probs.dtype)
    seq_log_ratio = token_log_ratio.sum(-1, keepdim=True) / lengths
    safe_lp = _safe(log_probs, mask)
    log_s = torch.clamp(safe_lp - safe_lp.detach() + seq_log_ratio.detach(), max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_s)
    adv = _safe(advantages, mask)
    unclipped = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    token_loss = torch.maximum(unclipped, clipped_loss)
    loss = s.aggregate(token_loss, mask)
    clipfrac = masked_mean((clipped_loss > unclipped).float(), mask)
    return loss, _metrics(loss, clipfrac, torch.zeros(()), token_log_ratio, mask)


@register_policy_loss("reinforce")
def reinforce(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **settings: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Importance-weighted REINFORCE (Williams 1992) without clipping.

    Per-token loss −A·ρ with ρ = exp(clamp(log π − log π_old, ±20)). On-policy (π = π_old) the
    value is −A and the gradient −A·∇log π, the plain policy gradient. Clip ratios are unused;
    pg_clipfrac and pg_clipfrac_lower are 0.
    """
    mask, s = _prepare(log_probs, old_log_probs, advantages, response_mask, settings)
    log_ratio = torch.clamp(_safe(log_probs - old_log_probs, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_loss = -_safe(advantages, mask) * torch.exp(log_ratio)
    loss = s.aggregate(token_loss, mask)
    zero = torch.zeros(())
    return loss, _metrics(loss, zero, zero, log_ratio, mask)


@register_policy_loss("cispo")
def cispo(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **settings: Any,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO, clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv:2506.13585).

    Per-token loss −sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π: the weight is clipped and detached,
    so every token keeps a gradient (PPO zeroes clipped tokens). The loss value includes log π
    and is not comparable with PPO's; its gradient is the quantity of interest.
    pg_clipfrac: fraction of valid tokens with ρ outside the band; clip_ratio_c unused.
    """
    mask, s = _prepare(log_probs, old_log_probs, advantages, response_mask, settings)
    log_ratio = torch.clamp(_safe(log_probs - old_log_probs, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    token_loss = -weight * _safe(advantages, mask) * _safe(log_probs, mask)
    loss = s.aggregate(token_loss, mask)
    clipfrac = masked_mean((weight != ratio).float(), mask)
    return loss, _metrics(loss, clipfrac, torch.zeros(()), log_ratio, mask)


__all__ = ["ppo", "gspo", "reinforce", "cispo", "ppo_token_losses", "PolicyLossSettings", "LOG_RATIO_CLAMP"]
