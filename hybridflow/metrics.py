"""Iteration metrics with verl's names (our concepts → those names: :mod:`hybridflow.metric_names`),
and metric-name sanitising for MLflow.

Pure torch / python (no mlflow import): the tracking layer calls :func:`sanitize_metric_name`
on every key before logging.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

MLFLOW_MAX_NAME_LENGTH = 250
_BAD_CHARS = re.compile(r"[^\w\-. /:]")  # MLflow's own pattern (\w is Unicode-aware)


def _stats(prefix: str, x: Tensor, which: tuple[str, ...] = ("mean", "max", "min")) -> dict[str, float]:
    """``prefix/mean|max|min`` of a 1-d tensor; nothing for an empty one (no NaN metrics)."""
    if x.numel() == 0:
        return {}
    x = x.detach().to(torch.float64)
    fns = {"mean": torch.mean, "max": torch.max, "min": torch.min}
    return {f"{prefix}/{w}": float(fns[w](x)) for w in which}


def _explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 − Var(returns − values) / Var(returns) over valid tokens (verl ``critic/vf_explained_var``)."""
    var_r = torch.var(returns, unbiased=False)
    if var_r == 0:
        return 0.0
    return float(1.0 - torch.var(returns - values, unbiased=False) / var_r)


def compute_data_metrics(
    batch: Any, *, max_response_tokens: int, max_prompt_tokens: int | None = None
) -> dict[str, float]:
    """Batch statistics under verl's metric names (``compute_data_metrics`` in verl).

    batch: a :class:`hybridflow.batch.Batch` (or a mapping of tensors) with ``response_mask``
    and any of ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``,
    ``values``, ``prompt_mask``. Per-sequence keys: ``critic/score/*`` = Σ token_level_scores,
    ``critic/rewards/*`` = Σ token_level_rewards over the response. Per-token keys (valid tokens
    only): ``critic/advantages/*``, ``critic/returns/*``, ``critic/values/*``,
    ``critic/vf_explained_var``. Lengths in tokens: ``response_length/mean|max|min``,
    ``response_length/clip_ratio`` = fraction of responses with exactly ``max_response_tokens``
    tokens (hit the limit), ``prompt_length/mean|max|min`` (and ``clip_ratio`` when
    ``max_prompt_tokens`` is given). Keys whose inputs are absent or empty are left out.
    """
    mask = batch["response_mask"]
    mask = mask if mask.dtype == torch.bool else mask != 0

    def has(key: str) -> bool:
        return key in batch

    out: dict[str, float] = {}
    for key, name in (("token_level_scores", "critic/score"), ("token_level_rewards", "critic/rewards")):
        if has(key):
            out.update(_stats(name, torch.where(mask, batch[key], 0.0).sum(-1)))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if has(key):
            out.update(_stats(name, batch[key][mask]))
    if has("values") and has("returns") and mask.any():
        out["critic/vf_explained_var"] = _explained_variance(
            batch["values"][mask].double(), batch["returns"][mask].double()
        )
    lengths = torch.count_nonzero(mask, -1).to(torch.float64)
    out.update(_stats("response_length", lengths))
    if lengths.numel():
        out["response_length/clip_ratio"] = float((lengths >= max_response_tokens).double().mean())
    if has("prompt_mask"):
        prompt_lengths = batch["prompt_mask"].sum(-1).to(torch.float64)
        out.update(_stats("prompt_length", prompt_lengths))
        if max_prompt_tokens is not None and prompt_lengths.numel():
            out["prompt_length/clip_ratio"] = float((prompt_lengths >= max_prompt_tokens).double().mean())
    return out


def compute_throughput_metrics(
    total_tokens: int,
    seconds: float,
    n_params: int | None = None,
    flops_per_s_peak: float | None = None,
    *,
    n_devices: int = 1,
) -> dict[str, float]:
    """Throughput and model-FLOPs utilisation of one training step.

    total_tokens: prompt + response tokens processed in the step; seconds: wall time of the step.
    ``perf/total_num_tokens``; ``perf/throughput`` = tokens / s / n_devices (per device, as verl);
    with n_params and flops_per_s_peak (peak FLOP/s of ONE device), ``perf/mfu/actor`` =
    6·N·tokens / s / (peak · n_devices) — the 6N-per-token dense-transformer training estimate
    (Kaplan et al. 2020), forward + backward, ignoring attention FLOPs.
    Raises ValueError for seconds ≤ 0 or n_devices < 1.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    out = {
        "perf/total_num_tokens": float(total_tokens),
        "perf/throughput": total_tokens / seconds / n_devices,
    }
    if n_params is not None and flops_per_s_peak:
        out["perf/mfu/actor"] = 6.0 * n_params * total_tokens / seconds / (flops_per_s_peak * n_devices)
    return out


def sanitize_metric_name(name: str) -> str:
    """A metric name MLflow accepts, as close to ``name`` as possible.

    MLflow allows word characters (letters, digits, _) and ``_ - . space / :``, rejects names that are not a normalised
    relative path (leading ``/``, ``//``, ``.`` or ``..`` segments, trailing ``/``) and names longer
    than 250 characters. Other characters become ``_``; bad path segments are dropped or
    replaced; '/' separators are kept, so ``actor/pg_loss`` is unchanged.
    """
    cleaned = _BAD_CHARS.sub("_", name)[:MLFLOW_MAX_NAME_LENGTH]
    parts = []
    for part in cleaned.split("/"):
        if part == "":
            continue  # leading, trailing or doubled '/'
        parts.append("_" * len(part) if part in {".", ".."} else part)
    result = "/".join(parts) or "_"
    if result.startswith(".."):  # normpath keeps it, but MLflow rejects names starting with '..'
        result = "_" + result[1:]
    return result

__all__ = ["compute_data_metrics", "compute_throughput_metrics", "sanitize_metric_name"]
