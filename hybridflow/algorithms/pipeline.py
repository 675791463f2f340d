"""The advantage node's arithmetic: scores → rewards (overlong shaping, KL-in-reward) → advantages.

Pure: no prefect / ray. The ``advantage`` task calls :func:`compute_advantages` on the batch
assembled from the reward, reference and values nodes; DAPO dynamic sampling calls
:func:`filter_zero_variance_groups` before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hybridflow.algorithms.core import _as_bool, group_index, masked_mean, masked_sum
from hybridflow.algorithms.kl import KLController, kl_penalty, make_kl_controller
from hybridflow.algorithms.registry import declared_inputs, get_advantage_estimator
from hybridflow.algorithms.sequences import overlong_penalty
from hybridflow.batch import Batch, BatchError

if TYPE_CHECKING:  # annotations only: the maths takes config sections, it never imports the config
    from hybridflow.config import AlgorithmConfig, OverlongBufferConfig


def _require(batch: Batch, keys: tuple[str, ...], why: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise BatchError(f"{why} needs batch keys {missing}; the batch has {batch.keys()}")


def _last_token_index(mask: Tensor) -> Tensor:
    """[batch] index of the last True position of each row (0 for an empty row)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, positions, 0).amax(-1)


def apply_overlong_penalty(
    rewards: Tensor, batch: Batch, buffer: OverlongBufferConfig, max_response_tokens: int
) -> tuple[Tensor, dict[str, float]]:
    """Add the DAPO overlong penalty to each response's last valid token.

    buffer: ``algorithm.overlong_buffer``; max_response_tokens: ``rollout.max_response_tokens``.
    Lengths come from the non-tensor ``response_length`` when present, else from the mask.
    """
    mask = _as_bool(batch["response_mask"])
    if "response_length" in batch.non_tensors:
        lengths = torch.tensor(batch["response_length"], dtype=torch.float32, device=mask.device)
    else:
        lengths = torch.count_nonzero(mask, -1).to(torch.float32)
    buf = buffer
    penalty = overlong_penalty(
        lengths,
        max_response_tokens=max_response_tokens,
        buffer_tokens=buf.buffer_tokens,
        penalty_factor=buf.penalty_factor,
    ).to(rewards.device)
    penalty = torch.where(mask.any(-1), penalty, 0.0)
    shaped = rewards.clone()
    shaped.scatter_add_(1, _last_token_index(mask).unsqueeze(-1), penalty.unsqueeze(-1).to(rewards.dtype))
    metrics = {
        "algorithm/overlong_penalty/mean": float(penalty.mean()) if len(penalty) else 0.0,
        "algorithm/overlong_fraction": float((penalty < 0).float().mean()) if len(penalty) else 0.0,
    }
    return shaped, metrics


def apply_kl_in_reward(
    rewards: Tensor, batch: Batch, estimator: str, kl_controller: KLController
) -> tuple[Tensor, dict[str, float]]:
    """token_level_rewards = rewards − β·KL(π_old‖π_ref) per valid token (Ziegler et al. 2019).

    β is the controller's value before this step; the controller is then updated with the
    batch's mean per-sequence KL and the number of trajectories (as verl).
    """
    _require(batch, ("old_log_probs", "ref_log_probs"), "algorithm.use_kl_in_reward")
    mask = _as_bool(batch["response_mask"])
    kld = torch.where(mask, kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], estimator), 0.0)
    beta = kl_controller.value
    current_kl = float(masked_mean(kld, mask, dim=-1).mean()) if len(kld) else 0.0
    kl_controller.update(current_kl, len(kld))
    metrics = {
        "critic/kl": current_kl,
        "critic/kl_coef": beta,
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": beta,
    }
    return rewards - beta * kld, metrics


def _zero_variance_groups(seq_scores: Tensor, uid: Any) -> Tensor:
    """[batch] bool: the row's group has all-equal scores (groups of one included)."""
    ids, n_groups = group_index(uid, device=seq_scores.device)
    hi = torch.full((n_groups,), -torch.inf, dtype=seq_scores.dtype, device=seq_scores.device)
    lo = torch.full((n_groups,), torch.inf, dtype=seq_scores.dtype, device=seq_scores.device)
    hi = hi.scatter_reduce(0, ids, seq_scores, "amax")
    lo = lo.scatter_reduce(0, ids, seq_scores, "amin")
    return (hi == lo)[ids]


def _group_metrics(rewards: Tensor, batch: Batch) -> dict[str, float]:
    if "uid" not in batch or len(batch) == 0:
        return {}
    seq = masked_sum(rewards, _as_bool(batch["response_mask"]), dim=-1)
    flat = _zero_variance_groups(seq, batch["uid"])
    ids, n_groups = group_index(batch["uid"], device=seq.device)
    per_group = torch.zeros(n_groups, dtype=torch.bool, device=seq.device).scatter(0, ids, flat)
    return {
        "algorithm/zero_variance_groups": float(per_group.float().mean()),
        "algorithm/num_groups": float(n_groups),
    }


def compute_advantages(
    batch: Batch, algorithm: AlgorithmConfig, *, max_response_tokens: int, kl_controller: KLController | None = None
) -> tuple[Batch, dict[str, float]]:
    """Scores → token_level_rewards → (advantages, returns), dispatched through the registry.

    algorithm: the config's ``algorithm`` section; max_response_tokens: ``rollout.max_response_tokens``
    (the overlong shaping's limit).

    batch: ``token_level_scores`` [B, R] float32 (the score on the last response token),
    ``response_mask``, non-tensor ``uid``; ``old_log_probs`` + ``ref_log_probs`` when
    ``algorithm.use_kl_in_reward``; ``values`` for estimators that need them; optional
    non-tensor ``response_length`` (overlong shaping) and tensor ``reward_baselines`` [B] (remax).
    Steps: DAPO overlong penalty (``algorithm.overlong_buffer.enable``), the zero-variance-group
    metric (on the rewards before KL), KL-in-reward (updates ``kl_controller``), then the
    estimator named ``algorithm.adv_estimator``, given those of uid, values, gamma, lam,
    norm_by_std, reward_baselines it declares (:func:`declared_inputs`).
    kl_controller: keep one for the run (see :func:`make_kl_controller`); None builds a fixed one
    from the config, and is refused for the adaptive controller (its state would be lost).
    Returns a new batch (the input is not modified) with ``token_level_rewards``, ``advantages``,
    ``returns`` set, and metrics: ``algorithm/zero_variance_groups`` (fraction of groups whose
    rewards are all equal — their group-relative advantages are 0, they carry no signal),
    ``algorithm/num_groups``, ``critic/kl``, ``critic/kl_coef`` (KL in reward),
    ``algorithm/overlong_*`` (overlong shaping).
    """
    algo = algorithm
    _require(batch, ("token_level_scores", "response_mask"), "compute_advantages")
    out = batch.shallow_copy()
    mask = _as_bool(out["response_mask"])
    rewards = out["token_level_scores"].to(torch.float32)
    metrics: dict[str, float] = {}
    if algo.overlong_buffer.enable:
        rewards, m = apply_overlong_penalty(rewards, out, algo.overlong_buffer, max_response_tokens)
        metrics.update(m)
    metrics.update(_group_metrics(rewards, out))
    if algo.use_kl_in_reward:
        if kl_controller is None:
            if algo.kl_ctrl.type != "fixed":
                raise ValueError("adaptive KL control needs the run's kl_controller (make_kl_controller(algorithm.kl_ctrl))")
            kl_controller = make_kl_controller(algo.kl_ctrl)
        rewards, m = apply_kl_in_reward(rewards, out, algo.kl_estimator, kl_controller)
        metrics.update(m)
    out.set("token_level_rewards", rewards.contiguous())
    inputs: dict[str, Any] = {
        "uid": out["uid"] if "uid" in out else None,
        "values": out["values"] if "values" in out else None,
        "gamma": algo.gamma,
        "lam": algo.lam,
        "norm_by_std": algo.norm_adv_by_std_in_grpo,
    }
    if "reward_baselines" in out:
        inputs["reward_baselines"] = out["reward_baselines"]
    estimator = get_advantage_estimator(algo.adv_estimator)
    advantages, returns = estimator(rewards, mask, **declared_inputs(estimator, inputs))
    out.set("advantages", advantages.to(torch.float32).contiguous())
    out.set("returns", returns.to(torch.float32).contiguous())
    return out, metrics


def filter_zero_variance_groups(batch: Batch, *, key: str = "token_level_scores") -> tuple[Batch, int]:
    """DAPO dynamic sampling (Yu et al. 2025, §3.2): drop groups whose scores are all equal.

    The per-sample score is the sum of ``key`` over ``response_mask``; groups come from ``uid``.
    Groups of one count as all-equal and are dropped. Returns (the kept rows in their original
    order, the number of groups dropped). The result may have 0 rows; the caller decides
    whether to sample more prompts.
    """
    _require(batch, (key, "response_mask", "uid"), "filter_zero_variance_groups")
    if len(batch) == 0:
        return batch, 0
    seq = masked_sum(batch[key], _as_bool(batch["response_mask"]), dim=-1)
    flat = _zero_variance_groups(seq, batch["uid"])
    ids, n_groups = group_index(batch["uid"], device=seq.device)
    dropped_groups = int(torch.zeros(n_groups, dtype=torch.bool, device=seq.device).scatter(0, ids, flat).sum())
    keep = (~flat).nonzero().squeeze(-1).cpu()
    return batch.index(keep), dropped_groups


__all__ = [
    "compute_advantages",
    "filter_zero_variance_groups",
    "apply_overlong_penalty",
    "apply_kl_in_reward",
]
