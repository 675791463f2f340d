"""``critic`` (value model update) and ``reference`` (reference model)."""

from __future__ import annotations

from pydantic import Field

from hybridflow.config.base import (
    LossAggMode,
    _Section,
)


class CriticConfig(_Section):
    model_path: str | None = Field(None, description="Value model; None = the policy model's backbone + a value head.")
    lr: float = Field(1e-5, gt=0, description="Critic learning rate.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    mini_batch_trajectories: int = Field(16, gt=0, description="Trajectories per critic optimizer step.")
    micro_batch_trajectories: int = Field(4, gt=0, description="Trajectories per critic forward/backward.")
    ppo_epochs: int = Field(1, gt=0, description="Critic passes over the step's trajectories.")
    clip_range_value: float = Field(0.5, gt=0, description="Value clipping range.")
    loss_agg_mode: LossAggMode = Field("token-mean", description="Aggregation of the value loss.")
    max_grad_norm: float = Field(1.0, gt=0, description="Critic gradient clipping.")


class ReferenceConfig(_Section):
    micro_batch_trajectories: int = Field(8, gt=0, description="Trajectories per reference forward.")
