"""``algorithm``: the advantage estimator, KL control and DAPO overlong shaping."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.config.base import (
    BUILTIN_ADV_ESTIMATORS,
    KLEstimatorName,
    _Section,
)


class KLControlConfig(_Section):
    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="KL-in-reward coefficient control; adaptive per Ziegler et al. 2019."
    )
    kl_coef: float = Field(0.001, ge=0, description="Initial KL coefficient β.")
    target_kl: float = Field(0.1, gt=0, description="Adaptive controller's target KL (nats per token).")
    horizon: int = Field(10000, gt=0, description="Adaptive controller's horizon.")


class OverlongBufferConfig(_Section):
    enable: bool = Field(False, description="DAPO soft overlong punishment (Yu et al. 2025, §3.4).")
    buffer_tokens: int = Field(16, ge=0, description="Length of the punishment ramp before max_response_tokens.")
    penalty_factor: float = Field(1.0, ge=0, description="Penalty at the end of the ramp.")


class AlgorithmConfig(_Section):
    adv_estimator: str = Field(
        "grpo", description=f"Advantage estimator registry name; built-in: {', '.join(BUILTIN_ADV_ESTIMATORS)}."
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="GRPO divides by the group std (Shao et al. 2024); False = Dr. GRPO (Liu et al. 2025)."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE λ (Schulman et al. 2016).")
    use_kl_in_reward: bool = Field(False, description="Subtract β·KL(π‖π_ref) from token rewards (Ziegler et al. 2019).")
    kl_estimator: KLEstimatorName = Field(
        "k1", description="KL estimator for KL-in-reward (Schulman 2020: k1, k2, k3)."
    )
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, description="KL coefficient control.")
    filter_groups: bool = Field(
        False, description="Drop groups whose rewards all agree (DAPO dynamic sampling, Yu et al. 2025)."
    )
    overlong_buffer: OverlongBufferConfig = Field(
        default_factory=OverlongBufferConfig, description="DAPO overlong reward shaping."
    )
    allow_kl_in_reward_and_loss: bool = Field(
        False, description="Allow both KL-in-reward and KL loss (double counting KL); off unless explicitly wanted."
    )
