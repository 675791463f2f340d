"""Per-token loss → scalar, and the gradient-accumulation contract.

Four modes (verl ``agg_loss``; DAPO §3.3 for token-mean, Dr. GRPO for sum-norm). For a
mini-batch of sequences i with valid tokens t (mask True), per-token loss ℓ_it, n_i valid
tokens, S = number of sequences with n_i ≥ 1, N = Σ n_i, L = max_response_tokens:

=========================  =======================================  ===============
mode                       value                                    normaliser
=========================  =======================================  ===============
token-mean                 Σ_i Σ_t ℓ_it / N                          N (tokens)
seq-mean-token-mean        Σ_i (Σ_t ℓ_it / n_i) / S                  S (sequences)
seq-mean-token-sum         Σ_i (Σ_t ℓ_it) / S                        S
seq-mean-token-sum-norm    Σ_i (Σ_t ℓ_it / L) / S                    S
=========================  =======================================  ===============

Each value is (a sum of per-sequence terms) / (a normaliser). The sum splits over
micro-batches; the normaliser does not. So gradient accumulation is exact when every
micro-batch divides by the normaliser of the *whole* mini-batch and the micro-batch
losses are summed (not averaged) before ``optimizer.step()``:

    plan = accumulation_plan(minibatch_mask, 4, "token-mean")
    for mb in plan:
        loss, metrics = policy_loss(lp[mb.rows], old[mb.rows], adv[mb.rows], mask[mb.rows],
                                    **mb.loss_kwargs)
        loss.backward()            # gradients add up to the full mini-batch gradient

``accumulation_plan`` is the only place micro-batch row ranges come from, and each one
carries its normaliser, so the normaliser cannot be forgotten. Data parallel: each rank
holds part of the mini-batch; pass ``sum_across_ranks`` (e.g. an all-reduce SUM of a
float) and ``world_size``. DDP/FSDP *average* gradients over ranks, so the plan uses
normaliser = (Σ_ranks local normaliser) / world_size; the averaged gradient is then
the gradient of the global mini-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hybridflow.algorithms.core import _as_bool, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")


def _per_sequence(loss_mat: Tensor, mask: Tensor, mode: str, max_response_tokens: int | None) -> Tensor:
    """[batch] per-sequence terms whose sum is the numerator (0 for rows without tokens)."""
    seq_sum = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sum
    if mode == "seq-mean-token-mean":
        return seq_sum / torch.count_nonzero(mask, -1).clamp(min=1).to(loss_mat.dtype)
    if max_response_tokens is None or max_response_tokens <= 0:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs max_response_tokens > 0 (a constant, "
            f"e.g. rollout.max_response_tokens), got {max_response_tokens!r}"
        )
    return seq_sum / float(max_response_tokens)


def loss_normalizer(response_mask: Tensor, mode: str, max_response_tokens: int | None = None) -> float:
    """The denominator of ``mode`` for a whole mini-batch (see the module table).

    response_mask: [batch, response_len] bool of the FULL mini-batch (this rank's part under DP).
    Returns the number of valid tokens for token-mean, else the number of sequences with at
    least one valid token, as a float. ``max_response_tokens`` is checked for sum-norm (it
    scales the numerator, not this count), so callers can pass one set of keyword arguments.
    """
    _check_mode(mode)
    m = _as_bool(response_mask)
    if mode == "seq-mean-token-sum-norm" and (max_response_tokens is None or max_response_tokens <= 0):
        raise ValueError(f"seq-mean-token-sum-norm needs max_response_tokens > 0, got {max_response_tokens!r}")
    if mode == "token-mean":
        return float(torch.count_nonzero(m))
    return float(torch.count_nonzero(m.any(-1)))


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    max_response_tokens: int | None = None,
    global_normalizer: float | Tensor | None = None,
) -> Tensor:
    """Aggregate per-token losses to a 0-d tensor (module docstring has the formulas).

    loss_mat: [batch, response_len] float; mask: same shape, bool (True = counts).
    mode: one of LOSS_AGG_MODES. max_response_tokens: required by seq-mean-token-sum-norm
    (a constant, so the scale does not depend on padding).
    global_normalizer: None = this batch is the whole mini-batch (normalise by its own count);
    otherwise the mini-batch normaliser from :func:`loss_normalizer` / :func:`accumulation_plan`,
    and this batch is one micro-batch of it. A normaliser of 0 (no valid tokens anywhere) gives 0.
    Masked positions never change the result, even when they hold NaN or inf.
    Raises ValueError for an unknown mode or a missing max_response_tokens.
    """
    _check_mode(mode)
    m = _as_bool(mask)
    if mode == "token-mean":
        total = masked_sum(loss_mat, m)
        local = torch.count_nonzero(m)
    else:
        total = _per_sequence(loss_mat, m, mode, max_response_tokens).sum()
        local = torch.count_nonzero(m.any(-1))
    if global_normalizer is None:
        return total / local.clamp(min=1).to(total.dtype)
    if not isinstance(global_normalizer, Tensor) and global_normalizer < 0:
        raise ValueError(f"global_normalizer must be >= 0, got {global_normalizer}")
    denom = torch.as_tensor(global_normalizer, dtype=total.dtype, device=total.device)
    return torch.where(denom > 0, total / denom.clamp(min=torch.finfo(total.dtype).tiny), total * 0)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a mini-batch: its rows and the loss arguments it must use.

    rows: slice into the mini-batch (the same rows as ``Batch.chunk(micro)[k]``).
    loss_kwargs: ``loss_agg_mode``, ``global_normalizer``, ``max_response_tokens`` — splat into
    any registered policy loss, :func:`value_loss` or :func:`kl_loss`.
    """

    rows: slice
    loss_agg_mode: str
    global_normalizer: float
    max_response_tokens: int | None

    @property
    def loss_kwargs(self) -> dict[str, Any]:
        return {
            "loss_agg_mode": self.loss_agg_mode,
            "global_normalizer": self.global_normalizer,
            "max_response_tokens": self.max_response_tokens,
        }

    def aggregate(self, loss_mat: Tensor, mask: Tensor) -> Tensor:
        """:func:`aggregate_loss` of this micro-batch's per-token values (e.g. entropy)."""
        return aggregate_loss(
            loss_mat,
            mask,
            self.loss_agg_mode,
            max_response_tokens=self.max_response_tokens,
            global_normalizer=self.global_normalizer,
        )


def accumulation_plan(
    response_mask: Tensor,
    micro_batch_trajectories: int,
    loss_agg_mode: str,
    *,
    max_response_tokens: int | None = None,
    sum_across_ranks: Callable[[float], float] | None = None,
    world_size: int = 1,
) -> list[MicroBatch]:
    """Split a mini-batch into consecutive micro-batches that each carry the global normaliser.

    response_mask: [batch, response_len] bool of this rank's whole mini-batch.
    micro_batch_trajectories: rows per micro-batch (the last may be smaller).
    sum_across_ranks: data parallel only — returns the sum of a float over all ranks (an
    all-reduce SUM); every rank must call the plan (it is a collective then).
    world_size: number of ranks whose gradients DDP/FSDP average; the normaliser is divided
    by it so averaged gradients equal the global mini-batch gradient.
    Summing the micro-batch losses (each built with ``mb.loss_kwargs``) over micro-batches and
    ranks/world_size reproduces the full mini-batch loss. Raises ValueError on bad sizes.
    """
    if micro_batch_trajectories <= 0:
        raise ValueError(f"micro_batch_trajectories must be > 0, got {micro_batch_trajectories}")
    if world_size <= 0:
        raise ValueError(f"world_size must be > 0, got {world_size}")
    local = loss_normalizer(response_mask, loss_agg_mode, max_response_tokens)
    total = sum_across_ranks(local) if sum_across_ranks is not None else local
    normalizer = float(total) / world_size
    n = response_mask.shape[0]
    return [
        MicroBatch(slice(s, min(s + micro_batch_trajectories, n)), loss_agg_mode, normalizer, max_response_tokens)
        for s in range(0, n, micro_batch_trajectories)
    ]


__all__ = [
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "loss_normalizer",
    "MicroBatch",
    "accumulation_plan",
]
