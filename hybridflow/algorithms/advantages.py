"""Outcome-reward advantage estimators with group baselines: grpo, rloo,
reinforce_plus_plus_baseline, opo, remax.

Registry contract::

    fn(token_level_rewards, response_mask, *, <the inputs it uses>, **options) -> (advantages, returns)

The inputs an estimator may declare are ``uid``, ``values``, ``gamma``, ``lam``,
``norm_by_std`` and ``reward_baselines``; the pipeline passes each estimator only the ones it
declares (:func:`hybridflow.algorithms.registry.declared_inputs`; all of them to one that takes
``**options``).

token_level_rewards: [batch, response_len] float32 (the outcome score usually sits on the last
response token); response_mask: [batch, response_len] bool; uid: one group label per sample (a
sequence of str/int or an int64 tensor; samples of one prompt share it). Outputs are
[batch, response_len] float32, zero outside the mask, and two distinct tensors.
The built-ins also take ``**options`` and ignore what they do not use, so a direct caller may
pass one set of inputs to every estimator. The sequence score is the sum of the rewards over the
response mask; group statistics are computed in float64. Every estimator here is an outcome
estimator: the per-sequence advantage is broadcast over the sequence's valid tokens.

Groups of one sample (a prompt sampled once, or the survivor of a filter) have no baseline:
as in verl, their baseline is 0 (and their std 1), so their advantage is their own score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hybridflow.algorithms.core import _as_bool, group_index, group_stats, masked_sum, masked_whiten
from hybridflow.algorithms.registry import register_advantage_estimator

GRPO_EPS = 1e-6  # added to the group std, as in verl / the GRPO reference code
Uid = Sequence[Any] | Tensor


def _check_shapes(rewards: Tensor, mask: Tensor) -> Tensor:
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} "
            "must both be [batch, response_len]"
        )
    return _as_bool(mask)


def _groups(uid: Uid | None, n: int, estimator: str, device: torch.device) -> tuple[Tensor, int]:
    if uid is None:
        raise ValueError(f"advantage estimator {estimator!r} needs uid (the group label of each sample)")
    if len(uid) != n:
        raise ValueError(f"uid has {len(uid)} labels for {n} samples")
    return group_index(uid, device=device)


def _spread(seq_values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """[batch] → ([batch, response_len] float32 on the mask, zero elsewhere) twice (no aliasing)."""
    adv = torch.where(mask, seq_values.to(torch.float32).unsqueeze(-1), 0.0)
    return adv, adv.clone()


def _group_baseline(scores: Tensor, ids: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, std) per group with verl's convention for groups of one: mean 0, std 1."""
    count, mean, std = group_stats(scores, ids, n_groups)
    single = count == 1
    return count, torch.where(single, 0.0, mean), torch.where(single, 1.0, std)


@register_advantage_estimator("grpo", min_samples_per_prompt=2)
def grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Uid | None = None,
    norm_by_std: bool = True,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath §4.1.2).

    A_i = (s_i − mean_g) / (std_g + 1e-6), std unbiased (n−1), broadcast over the response.
    norm_by_std=False is Dr. GRPO (Liu et al. 2025): A_i = s_i − mean_g.
    A group whose scores are all equal gets A = 0 exactly (never NaN); a group of one gets
    A = s_i / (1 + 1e-6) (s_i without std normalisation).
    Example: scores [1, 0, 0, 0] → mean 0.25, std 0.5 → [1.5, −0.5, −0.5, −0.5].
    """
    mask = _check_shapes(token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, dim=-1).to(torch.float64)
    ids, n_groups = _groups(uid, len(scores), "grpo", scores.device)
    _, mean, std = _group_baseline(scores, ids, n_groups)
    adv = scores - mean[ids]
    if norm_by_std:
        adv = adv / (std[ids] + GRPO_EPS)
    return _spread(adv, mask)


@register_advantage_estimator("rloo", min_samples_per_prompt=2)
def rloo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Uid | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = s_i − mean of the other samples' scores = n/(n−1)·(s_i − mean_g) for a group of n ≥ 2;
    a group of one gets A = s_i. Example: [1, 0, 0, 0] → [1, −1/3, −1/3, −1/3].
    """
    mask = _check_shapes(token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, dim=-1).to(torch.float64)
    ids, n_groups = _groups(uid, len(scores), "rloo", scores.device)
    count, mean, _ = _group_baseline(scores, ids, n_groups)
    n = count.to(torch.float64)
    scale = torch.where(count > 1, n / (n - 1).clamp(min=1), 1.0)
    return _spread(scale[ids] * (scores - mean[ids]), mask)


@register_advantage_estimator("reinforce_plus_plus_baseline", min_samples_per_prompt=2)
def reinforce_plus_plus_baseline(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Uid | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262).

    s_i − mean_g (groups of one: s_i), broadcast over the response, then whitened over all valid
    tokens of the batch (mean 0, unbiased std 1). returns equal the advantages (as verl).
    """
    mask = _check_shapes(token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, dim=-1).to(torch.float64)
    ids, n_groups = _groups(uid, len(scores), "reinforce_plus_plus_baseline", scores.device)
    _, mean, _ = _group_baseline(scores, ids, n_groups)
    centred, _ = _spread(scores - mean[ids], mask)
    adv = torch.where(mask, masked_whiten(centred, mask), 0.0)
    return adv, adv.clone()


@register_advantage_estimator("opo", min_samples_per_prompt=2)
def opo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Uid | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """On-Policy RL with the Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585).

    Baseline b_g = Σ_i |o_i|·s_i / Σ_i |o_i| (length-weighted group mean, |o_i| = valid tokens);
    A_i = s_i − b_g. Groups of one, and groups whose responses are all empty, get b = 0.
    """
    mask = _check_shapes(token_level_rewards, response_mask)
    scores = masked_sum(token_level_rewards, mask, dim=-1).to(torch.float64)
    lengths = torch.count_nonzero(mask, -1).to(torch.float64)
    ids, n_groups = _groups(uid, len(scores), "opo", scores.device)
    count = torch.bincount(ids, minlength=n_groups)
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=scores.device)
    weighted = zeros.index_add(0, ids, lengths * scores)
    total_len = zeros.index_add(0, ids, lengths)
    baseline = torch.where((count > 1) & (total_len > 0), weighted / total_len.clamp(min=1), 0.0)
    return _spread(scores - baseline[ids], mask)


@register_advantage_estimator("remax")
def remax(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    uid: Uid | None = None,
    reward_baselines: Tensor | None = None,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): the greedy response's reward is the baseline.

    reward_baselines: [batch] float32, the reward of the greedy (argmax) response to the same
    prompt (batch key ``reward_baselines``). returns_t = Σ_{s≥t} r_s over the mask (undiscounted
    reward-to-go); A_t = returns_t − b. Raises ValueError when reward_baselines is missing.
    """
    mask = _check_shapes(token_level_rewards, response_mask)
    if reward_baselines is None:
        raise ValueError("advantage estimator 'remax' needs reward_baselines ([batch], the greedy response's reward)")
    if reward_baselines.shape != (mask.shape[0],):
        raise ValueError(f"reward_baselines must be [{mask.shape[0]}], got {tuple(reward_baselines.shape)}")
    r = torch.where(mask, token_level_rewards, 0.0)
    to_go = r.flip(-1).cumsum(-1).flip(-1)
    returns = torch.where(mask, to_go, 0.0)
    adv = torch.where(mask, to_go - reward_baselines.to(to_go.dtype).unsqueeze(-1), 0.0)
    return adv, returns


__all__ = ["grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "remax", "GRPO_EPS"]
