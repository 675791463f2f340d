"""Masked statistics and group bookkeeping shared by estimators, losses and metrics.

Masks are ``bool`` (any dtype is accepted and converted) and True means "counts".
All reductions are vectorised; positions outside the mask never influence a result,
even when they hold NaN or inf (they are selected away with ``torch.where``, not
multiplied by zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

WHITEN_EPS = 1e-8  # added to the variance before rsqrt, as verl's masked_whiten


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is True (over all elements, or along ``dim``).

    x: any float shape; mask: same shape (or broadcastable), bool.
    Values outside the mask are ignored even if non-finite.
    """
    m = _as_bool(mask)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    picked = torch.where(m, x, zero)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True.

    x: float tensor, e.g. [batch, response_len]; mask: same shape, bool.
    dim: None = one mean over every masked element (0-d result); an int = mean along that dim.
    An empty mask (or an empty row along ``dim``) gives 0.0, never NaN.
    """
    m = _as_bool(mask)
    count = torch.count_nonzero(m) if dim is None else torch.count_nonzero(m, dim)  # bool .sum() is ~20x slower
    return masked_sum(x, m, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked elements (0-d).

    unbiased: Bessel correction n/(n−1), as ``torch.var`` and verl's masked_var.
    Unlike verl (which raises), fewer than two masked elements give variance 0.0 —
    a batch with one response token must not crash a training run.
    """
    m = _as_bool(mask)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = torch.count_nonzero(m).to(x.dtype)
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True) -> Tensor:
    """Normalise ``x`` to zero mean and unit variance over the masked elements.

    Returns (x − mean)·rsqrt(var + 1e-8) (var unbiased), same shape as ``x``; with
    ``shift_mean=False`` the mean is added back (only the scale changes).
    Positions outside the mask are transformed too; callers zero them.
    """
    m = _as_bool(mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def group_index(uid: Sequence[Any] | Tensor, device: torch.device | str | None = None) -> tuple[Tensor, int]:
    """Map group labels to dense ids 0..G−1 in order of first appearance.

    uid: a sequence of hashable labels (str, int, ...) or a 1-d integer tensor, one per sample.
    Returns (ids [batch] int64, number of groups G).
    """
    if isinstance(uid, Tensor):
        if uid.dim() != 1:
            raise ValueError(f"uid must be 1-d, got shape {tuple(uid.shape)}")
        uniq, inverse = torch.unique(uid, return_inverse=True)
        n = len(uniq)
        # renumber by first appearance, so ids do not depend on the label values
        pos = torch.arange(len(inverse), device=inverse.device)
        first = torch.full((n,), len(inverse), dtype=torch.long, device=inverse.device)
        first = first.scatter_reduce(0, inverse, pos, "amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(n, device=first.device)
        return rank[inverse].to(device or uid.device), n
    table: dict[Any, int] = {}
    ids_list = [table.setdefault(u, len(table)) for u in uid]
    return torch.tensor(ids_list, dtype=torch.long, device=device), len(table)


def group_stats(x: Tensor, ids: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group count, mean and unbiased std of a 1-d tensor, computed in float64.

    x: [batch] float; ids: [batch] int64 in 0..n_groups−1.
    Returns (count [G] int64, mean [G] float64, std [G] float64); std is 0 for groups of one.
    Two-pass (mean first, then squared deviations) for accuracy.
    """
    x64 = x.to(torch.float64)
    count = torch.bincount(ids, minlength=n_groups)
    total = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, ids, x64)
    mean = total / count.clamp(min=1)
    sq = torch.zeros_like(mean).index_add_(0, ids, (x64 - mean[ids]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count, mean, std


__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "group_index", "group_stats"]
