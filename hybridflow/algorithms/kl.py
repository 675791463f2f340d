"""KL estimators, KL controllers (for KL-in-reward) and the KL loss term.

Estimators follow Schulman, "Approximating KL divergence" (2020). With Δ = log π − log π_ref
per token (both in nats):

========================  =====================================  ==============================
name (aliases)            value                                   notes
========================  =====================================  ==============================
k1 (kl)                   Δ                                       unbiased, can be negative
k2 (mse)                  ½Δ²                                     ≥ 0, biased
k3 (low_var_kl)           exp(−Δ) + Δ − 1, clamped to [−10, 10]  ≥ 0, unbiased, low variance;
                                                                  Δ clamped to ±20 before exp
abs                       |Δ|                                     ≥ 0
========================  =====================================  ==============================

Example: log π = ln 0.2, log π_ref = ln 0.5 → k1 −0.916291, k2 0.419794, k3 0.583709.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from hybridflow.algorithms.aggregation import aggregate_loss

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _k1(delta: Tensor) -> Tensor:
    return delta


def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


def _k3(delta: Tensor) -> Tensor:
    neg = torch.clamp(-delta, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)  # log π_ref − log π
    return torch.clamp(torch.exp(neg) - neg - 1, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
    "abs": torch.abs,
}


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str) -> Tensor:
    """Per-token KL(π‖π_ref) estimate (Schulman 2020); see the module table.

    log_probs, ref_log_probs: [batch, response_len] float32, nats. estimator: k1|kl, k2|mse,
    k3|low_var_kl, abs. Returns [batch, response_len] float32; positions outside the response
    mask are the caller's to mask. Gradients flow into both inputs.
    Raises ValueError for an unknown estimator (listing the known ones).
    """
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}") from None
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} differ")
    return fn(log_probs - ref_log_probs)


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kl_loss_type: str,
    loss_agg_mode: str,
    global_normalizer: float | Tensor | None = None,
    *,
    max_response_tokens: int | None = None,
) -> Tensor:
    """The KL-loss term of GRPO (Shao et al. 2024): aggregate_loss(kl_penalty(...)) as a 0-d tensor.

    The worker adds ``actor.kl_loss_coef × kl_loss(...)`` to the policy loss. Arguments as in
    :func:`kl_penalty` and :func:`aggregate_loss`; pass the micro-batch's ``global_normalizer``
    (and ``max_response_tokens`` for seq-mean-token-sum-norm) like for the policy loss.
    Masked positions never change the result.
    """
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    kl = kl_penalty(torch.where(mask, log_probs, zero), torch.where(mask, ref_log_probs, zero), kl_loss_type)
    return aggregate_loss(
        kl, mask, loss_agg_mode, max_response_tokens=max_response_tokens, global_normalizer=global_normalizer
    )


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """Constant KL coefficient β (``value``); ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, §2.2).

    After each step: e = clip(KL/target − 1, −0.2, 0.2); β ← β·(1 + e·n_steps/horizon).
    current_kl: mean per-token KL in nats; n_steps: trajectories in the step (verl passes the
    batch size). Keep one instance for the whole run and checkpoint ``state_dict()``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def make_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller that ``cfg.algorithm.kl_ctrl`` (a KLControlConfig) describes."""
    factories = {
        "fixed": lambda c: FixedKLController(c.kl_coef),
        "adaptive": lambda c: AdaptiveKLController(c.kl_coef, c.target_kl, c.horizon),
    }
    try:
        return factories[kl_ctrl.type](kl_ctrl)
    except KeyError:
        raise ValueError(f"unknown kl_ctrl.type {kl_ctrl.type!r}; known: {', '.join(factories)}") from None


__all__ = [
    "KL_ESTIMATORS",
    "kl_penalty",
    "kl_loss",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]
