"""``actor``: the policy update (loss, batch sizes, optimizer, rollout correction)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from hybridflow.config.base import (
    BUILTIN_POLICY_LOSSES,
    KLEstimatorName,
    LossAggMode,
    _Section,
)


class ActorConfig(_Section):
    lr: float = Field(1e-6, gt=0, description="Adam learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up.")
    policy_loss: str = Field(
        "ppo", description=f"Policy loss registry name; built-in: {', '.join(BUILTIN_POLICY_LOSSES)}."
    )
    loss_agg_mode: LossAggMode = Field("token-mean", description="How per-token losses are aggregated (DAPO §3.3).")
    mini_batch_trajectories: int = Field(16, gt=0, description="Trajectories per optimizer step.")
    micro_batch_trajectories: int = Field(4, gt=0, description="Trajectories per forward/backward (grad accumulation).")
    ppo_epochs: int = Field(1, gt=0, description="Passes over the step's trajectories.")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO ε_low (Schulman et al. 2017).")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO ε_high; > ε_low is DAPO's clip-higher.")
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip constant c for negative advantages (Ye et al. 2020).")
    use_kl_loss: bool = Field(False, description="Add kl_loss_coef·KL(π‖π_ref) to the loss (GRPO).")
    kl_loss_coef: float = Field(0.001, ge=0, description="KL loss coefficient.")
    kl_loss_type: KLEstimatorName = Field("low_var_kl", description="KL estimator for the KL loss.")
    entropy_coef: float = Field(0.0, description="Entropy bonus coefficient (subtracted from the loss).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    shuffle: bool = Field(False, description="Shuffle trajectories between mini-batches.")
    lm_head: Literal["auto", "chunked", "full"] = Field(
        "auto",
        description="How the policy's log-probs (and entropies) come from its last hidden states "
        "(workers/log_probs.py): 'chunked' = the LM head's matmul and log-softmax in row chunks, forward and "
        "backward, so the [rows, response_len, vocab] logits never exist at once (the idea of Liger Kernel's "
        "fused linear cross-entropy, Hsu et al. 2024, arXiv:2410.10989; verl use_fused_kernels); an error at "
        "the first forward for a model whose head it cannot reproduce (DDP/FSDP2 or PEFT wrapper, a head that "
        "is not a plain Linear, logit softcapping or scaling, an architecture not known to be plain); "
        "'full' = the model's own full logits; 'auto' = 'chunked' where it can, else 'full'.",
    )
    pack_rows: Literal["auto", "on", "off"] = Field(
        "auto",
        description="The layout of the trainer's forward passes (policy log-probs and update, reference "
        "log-probs; workers/packed_rows.py): 'on' = the rows' real tokens packed without padding, first-fit "
        "decreasing into rows as wide as the longest, positions restarting per row and attention kept within "
        "each (verl use_remove_padding; transformers' packed position ids, sdpa/eager/flex/flash-attention); "
        "an error at the first forward for a model that cannot take packed rows; 'off' = padded rows, with "
        "each distinct prompt computed once where prompts repeat; 'auto' = packed where that computes fewer "
        "token positions than the layout 'off' would run. YAML's on/off (booleans) are taken as 'on'/'off'.",
    )

    @field_validator("pack_rows", mode="before")
    @classmethod
    def _pack_rows_from_yaml_bool(cls, v: Any) -> Any:
        # YAML 1.1 reads `pack_rows: off` as False and `on` as True
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v
    old_log_probs: Literal["auto", "recompute", "rollout"] = Field(
        "auto",
        description="Where old_log_probs come from: 'recompute' = a trainer forward pass after rollout "
        "(verl's default); 'rollout' = the rollout engine's own log-probs (saves that forward; the "
        "rollout-vs-trainer gap is then measured on the first mini-batch of the update); 'auto' = "
        "'rollout' for the in-process hf engine (same weights and precision: |diff| < 1e-4), else 'recompute' "
        "(always 'recompute' with a rollout_correction).",
    )
    rollout_correction: Literal["auto", "none", "tis", "decoupled"] = Field(
        "none",
        description="Off-policy correction of the policy loss by the behaviour (rollout) log-probs, per token "
        "('auto' = 'tis' when the rollout dtype differs from the trainer's parameter dtype, else 'none'; "
        "ExperimentConfig.rollout_correction is the resolved value, resolved with the precision) "
        "(hybridflow/algorithms/rollout_correction.py): 'tis' = truncated importance sampling, weight "
        "min(π_old/π_rollout, tis_threshold), detached (verl algorithm.rollout_correction rollout_is='token', "
        "slime --use-tis); 'decoupled' = AReaL's decoupled PPO (Fu et al. 2025, arXiv:2505.24298): the "
        "recomputed old_log_probs are the proximal policy, weight π_prox/π_rollout (behav_weight_cap). "
        "Needs rollout_log_probs and recomputed old_log_probs.",
    )
    tis_threshold: float = Field(
        2.0, gt=0, description="Truncation C of rollout_correction='tis' (verl rollout_is_threshold, default 2)."
    )
    max_token_staleness: int | None = Field(
        None, ge=0, description="trainer.async_mode=stream: tokens sampled by weights more than this many versions "
        "older than the weights the update starts from get weight 0 in the policy loss (they still count in its "
        "normaliser; slime's off-policy token mask); rollout_corr/stale_token_fraction counts them. Needs "
        "rollout_token_versions (streaming). None = no token is masked for its age.",
    )
    behav_weight_cap: float | None = Field(
        None, gt=0,
        description="rollout_correction='decoupled' only: tokens whose weight π_prox/π_rollout exceeds it get "
        "weight 0 (AReaL behav_imp_weight_cap: rejected, not truncated; they still count in the loss "
        "normaliser). None = no cap.",
    )
