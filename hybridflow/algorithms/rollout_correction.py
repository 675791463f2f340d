"""Off-policy correction weights: truncated importance sampling and AReaL's decoupled PPO.

The trajectories of an update were sampled by a *behaviour* policy (the rollout engine's
weights and numerics: ``rollout_log_probs``) that may differ from the trainer's weights before
the update (``old_log_probs``, recomputed): a different precision or engine, or an older policy
version in asynchronous training. Both corrections weight each token's policy loss by
``w = π_old / π_behav = exp(old_log_probs − rollout_log_probs)``, detached, before the loss is
aggregated (``PolicyLossSettings.token_weights``), so every loss-aggregation mode and the
micro-batch contract are unchanged:

- ``tis`` — truncated importance sampling, ``w = min(π_old/π_behav, C)`` (C = ``actor.tis_threshold``):
  verl ``verl/trainer/ppo/rollout_corr_helper.py`` ``compute_rollout_correction_weights``
  (``rollout_is="token"``, ``rollout_is_threshold``), slime ``--use-tis``.
- ``decoupled`` — AReaL's decoupled PPO objective (Fu et al. 2025, arXiv:2505.24298):
  ``−w · min(r·A, clip(r, 1−ε, 1+ε)·A)`` with ``r = π_θ/π_prox`` (the loss's own ratio, the
  recomputed old_log_probs being the proximal policy) and ``w = π_prox/π_behav``. With
  ``behav_weight_cap`` set, a token whose w exceeds the cap gets weight 0 — it is *rejected*,
  not truncated, and still counts in the normaliser — as AReaL's ``behav_imp_weight_cap`` in
  ``ppo_actor_loss_fn`` (inclusionAI/AReaL ``areal/utils/functional.py``:
  ``behav_mask = (behav_imp_weight <= behav_imp_weight_cap) & loss_mask``;
  ``pg_loss = pg_loss * where(behav_mask, behav_imp_weight, 0)``; divided by the loss-mask count).

Metrics keep verl's names (``rollout_corr/``, :data:`hybridflow.metric_names.METRIC_NAMES`) and,
as verl's, describe the weight *before* truncation or cap: mean and max over the valid tokens,
and the fraction of valid tokens above the threshold (tis) or the cap (decoupled; 0 without one)
— the tokens whose weight was truncated or rejected.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybridflow.algorithms.core import _as_bool, masked_mean
from hybridflow.algorithms.policy_losses import LOG_RATIO_CLAMP
from hybridflow.metric_names import METRIC_NAMES

IS_MEAN = METRIC_NAMES["importance_weight_mean"]
IS_MAX = METRIC_NAMES["importance_weight_max"]
IS_CLIPPED = METRIC_NAMES["importance_weight_clipped_fraction"]


def _tis(raw: Tensor, tis_threshold: float, behav_weight_cap: float | None) -> tuple[Tensor, Tensor]:
    return torch.clamp(raw, max=tis_threshold), raw > tis_threshold


def _decoupled(raw: Tensor, tis_threshold: float, behav_weight_cap: float | None) -> tuple[Tensor, Tensor]:
    if behav_weight_cap is None:
        return raw, torch.zeros_like(raw, dtype=torch.bool)
    rejected = raw > behav_weight_cap
    return torch.where(rejected, torch.zeros((), dtype=raw.dtype, device=raw.device), raw), rejected


# mode → (raw weight, tis_threshold, behav_weight_cap) -> (applied weight, truncated-or-rejected)
CORRECTIONS: dict[str, Callable[[Tensor, float, float | None], tuple[Tensor, Tensor]]] = {
    "tis": _tis,
    "decoupled": _decoupled,
}


def rollout_correction_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    mode: str,
    *,
    tis_threshold: float = 2.0,
    behav_weight_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token off-policy correction weights (see the module docstring for the two modes).

    old_log_probs: [batch, response_len] float nats under the trainer's weights before the update
    (the proximal policy); rollout_log_probs: same, under the behaviour policy that sampled the
    tokens; response_mask: [batch, response_len] bool. mode: "tis" or "decoupled".
    tis_threshold: C of tis (> 0); behav_weight_cap: decoupled's cap (> 0) or None.

    The log-ratio is clamped to ±LOG_RATIO_CLAMP (as the PPO ratio) before exp, so w is finite;
    masked positions never matter (even NaN/inf there).
    Returns (weights [batch, response_len] float32, detached, 0 outside the mask;
    metrics {rollout_corr/rollout_is_mean, rollout_corr/rollout_is_max,
    rollout_corr/rollout_is_ratio_fraction_high} as python floats; with no valid token all 0.0).
    Worked (tis, C = 2): π_behav 0.2, π_old 0.5 → w = min(2.5, 2) = 2.0.
    Raises ValueError for another mode ("none" applies no weights: pass ``token_weights=None``),
    a threshold or cap ≤ 0, or mismatched shapes.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; known: {sorted(CORRECTIONS)} ('none' = no weights)")
    if tis_threshold <= 0 or (behav_weight_cap is not None and behav_weight_cap <= 0):
        raise ValueError(f"tis_threshold and behav_weight_cap must be > 0, got {tis_threshold}, {behav_weight_cap}")
    if not old_log_probs.shape == rollout_log_probs.shape == response_mask.shape or old_log_probs.dim() != 2:
        raise ValueError(
            "old_log_probs, rollout_log_probs, response_mask must all be [batch, response_len]; got "
            f"{tuple(old_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(response_mask.shape)}"
        )
    mask = _as_bool(response_mask)
    with torch.no_grad():
        diff = old_log_probs.detach().float() - rollout_log_probs.detach().float().to(old_log_probs.device)
        zero = torch.zeros((), dtype=torch.float32, device=diff.device)
        log_ratio = torch.clamp(torch.where(mask, diff, zero), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        raw = torch.exp(log_ratio)
        weights, clipped = CORRECTIONS[mode](raw, tis_threshold, behav_weight_cap)
        weights = torch.where(mask, weights, zero)
        metrics = {
            IS_MEAN: float(masked_mean(raw, mask)),
            IS_MAX: float(torch.where(mask, raw, zero).max()) if raw.numel() else 0.0,
            IS_CLIPPED: float(masked_mean(clipped.float(), mask)),
        }
    return weights, metrics


STALE_TOKEN_FRACTION = "rollout_corr/stale_token_fraction"


def fresh_token_mask(token_versions: Tensor, response_mask: Tensor, policy_version: int,
                     max_token_staleness: int) -> tuple[Tensor, float]:
    """The off-policy token mask of streaming rollouts (``actor.max_token_staleness``; slime's
    off-policy token masking): token_versions [B, R] int64 (the weights version that sampled each
    token, ``rollout_token_versions``), response_mask [B, R] bool; a token is kept (True) when
    ``policy_version − version ≤ max_token_staleness``. Returns (mask [B, R] bool, the share of
    response tokens masked, a float in [0, 1]). Raises ValueError on shape mismatch."""
    if token_versions.shape != response_mask.shape:
        raise ValueError(f"rollout_token_versions {tuple(token_versions.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} differ")
    keep = (policy_version - token_versions) <= max_token_staleness
    total = int(response_mask.sum())
    stale = int((~keep & response_mask).sum())
    return keep, (stale / total if total else 0.0)


__all__ = ["rollout_correction_weights", "fresh_token_mask", "CORRECTIONS", "IS_MEAN", "IS_MAX", "IS_CLIPPED",
           "STALE_TOKEN_FRACTION"]
