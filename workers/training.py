"""The optimisation loop shared by the policy and the critic, and exactly-once versioning.

:class:`Optimization` owns one model's AdamW optimizer, LR schedule and step counter and runs
one update over a batch: ``epochs`` passes × mini-batches (one optimizer step each) ×
micro-batches (gradient accumulation). Every micro-batch loss is divided by the normaliser
of the WHOLE mini-batch summed over data-parallel ranks (then divided by world size, as
DDP/FSDP average gradients) — :func:`hybridflow.algorithms.aggregation.accumulation_plan` —
so the accumulated gradient equals the full mini-batch gradient whatever the micro-batch
size or the number of ranks.

Data parallel: each rank holds its part of the step's trajectories; the number of
mini-batches is global (``ceil(global rows / mini_batch_trajectories)``), each rank splits
its rows into that many near-equal consecutive chunks, and all ranks run the same number of
forward/backward passes per mini-batch (a rank with fewer micro-batches runs zero-weighted
extra passes) so DDP/FSDP collectives stay in step.

Numerical faults: when any rank's micro-batch loss or the global gradient norm is NaN/inf,
that optimizer step is skipped (gradients dropped, weights and optimizer state untouched)
and counted in ``<prefix>/bad_updates``; ``<prefix>/update_skipped`` is 1 when no step of
the update was applied.

:class:`VersionedUpdates` (:mod:`workers.outcome`, re-exported here) is the exactly-once contract of ``update_policy`` /
``update_critic`` (docs/architecture.md, "Recovery and exactly-once updates"; the driver side is :mod:`tasks.versions`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from hybridflow.algorithms.aggregation import MicroBatch, accumulation_plan
from hybridflow.batch import Batch, is_padding
from workers import distributed as D
from workers.micro_batches import by_length
from workers.outcome import UpdateOutcome, VersionedUpdates, VersionMismatchError  # noqa: F401 (re-exported)
from workers.progress import Countdown, Tick

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimSettings:
    """AdamW (β = 0.9, 0.999; ε = 1e-8) with linear warm-up and a constant or cosine LR.

    total_steps: optimizer steps the cosine schedule spans (ignored for constant).
    """

    lr: float
    weight_decay: float
    warmup_steps: int
    schedule: Literal["constant", "cosine"]
    total_steps: int
    max_grad_norm: float


def lr_at(step: int, s: OptimSettings) -> float:
    """LR of the optimizer step that follows ``step`` applied steps.

    Warm-up: lr·(step+1)/warmup_steps for step < warmup_steps (the first step already moves,
    unlike HF's schedule which starts at 0). Then constant lr, or cosine
    lr·½(1 + cos(π·p)) with p = (step − warmup)/(total − warmup) clamped to [0, 1].
    Example: lr 1e-6, warmup 4 → steps 0..3 use 2.5e-7, 5e-7, 7.5e-7, 1e-6.
    """
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.schedule == "constant":
        return s.lr
    span = max(1, s.total_steps - s.warmup_steps)
    progress = min(1.0, max(0.0, (step - s.warmup_steps) / span))
    return s.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class MicroResult:
    """What a loss function returns for one micro-batch.

    loss: 0-d tensor to backpropagate (already divided by the global normaliser).
    loss_terms: contributions that SUM over the micro-batches of a mini-batch to the
    mini-batch value (e.g. ``pg_loss``, ``kl_loss``, ``entropy`` aggregated with the plan).
    averages: per-micro-batch token-mean statistics (e.g. clip fractions), averaged over
    micro-batches weighted by their response tokens (= the token mean over the mini-batches).
    maxima: per-micro-batch maxima (e.g. the largest importance weight), reduced by max over
    the micro-batches of every step and over ranks.
    A key with a ``/`` is a full metric name (e.g. verl's ``rollout_corr/...``); others get the prefix.
    """

    loss: Tensor
    loss_terms: dict[str, float] = field(default_factory=dict)
    averages: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)


LossFn = Callable[[nn.Module, Batch, MicroBatch], MicroResult]


@dataclass
class _Tally:
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, values: dict[str, float], weight: float = 1.0) -> None:
        """Accumulate ``weight``-weighted values (their mean is sums / counts)."""
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * weight
            self.counts[k] = self.counts.get(k, 0.0) + weight

    def add_max(self, values: dict[str, float]) -> None:
        """Keep the running maximum of each value in ``sums`` (``-inf`` = nothing seen)."""
        for k, v in values.items():
            self.sums[k] = max(self.sums.get(k, -math.inf), float(v))


def _metric_name(prefix: str, key: str) -> str:
    return key if "/" in key else f"{prefix}/{key}"


class Optimization:
    """One trained model's optimizer, LR schedule and update loop.

    model: the wrapped training module (plain, DDP or FSDP2); its parameters with
    ``requires_grad`` are optimised (LoRA: only the adapters). group_by_prompt: order each
    mini-batch's rows by prompt, then length (for a loss that computes each distinct prompt of
    a micro-batch once), instead of by length alone.
    """

    def __init__(self, model: nn.Module, settings: OptimSettings, *, world_size: int = 1, prefix: str = "actor",
                 group_by_prompt: bool = False):
        self.model = model
        self.group_by_prompt = group_by_prompt  # micro-batches hold few prompts (the loss shares their forward)
        self.settings = settings
        self.world_size = world_size
        self.prefix = prefix
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"{prefix}: the model has no trainable parameters")
        # the fused kernel is ~4x faster than the per-parameter loop on CPU (0.15 s vs 0.67 s per
        # step for 135M params, bench/train.py); sharded DTensor parameters keep the default
        fused = all(type(p) is nn.Parameter or type(p) is Tensor for p in self.params) and all(
            p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
            for p in self.params
        )
        self.optimizer = torch.optim.AdamW(
            self.params, lr=settings.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=settings.weight_decay,
            fused=fused or None,
        )
        self.steps_applied = 0

    # ---- the update ------------------------------------------------------------------------
    def update(self, batch: Batch, loss_fn: LossFn, **kwargs: Any) -> dict[str, float]:
        """The metrics of :meth:`apply` (same arguments)."""
        return dict(self.apply(batch, loss_fn, **kwargs).metrics)

    def apply(
        self,
        batch: Batch,
        loss_fn: LossFn,
        *,
        mini_batch_trajectories: int,
        micro_batch_trajectories: int,
        epochs: int,
        loss_agg_mode: str,
        max_response_tokens: int | None,
        shuffle_seed: int | None = None,
        progress: Tick | None = None,
    ) -> UpdateOutcome:
        """Run ``epochs`` × mini-batch steps over this rank's ``batch``; returns the UpdateOutcome:
        ``applied`` False when every optimizer step was skipped (NaN/inf, the same on every rank),
        metrics reduced over ranks (``<prefix>/...``). ``shuffle_seed``: permute rows each epoch (None = keep order).
        ``progress``: called with (micro-batches run, micro-batches of the update) on this rank.

        Every rank must call it (collective). A padding stand-in (:func:`hybridflow.batch.is_padding`,
        a rank with no rows of its own) trains on no rows: it only runs the zero-weighted passes
        that keep collectives in step. Raises ValueError on an empty batch.
        """
        if len(batch) == 0:
            raise ValueError(f"{self.prefix}: update on an empty batch")
        start = time.perf_counter()
        own_rows = 0 if is_padding(batch) else len(batch)
        global_rows = int(D.all_reduce_sum(torch.tensor([own_rows], dtype=torch.float64)).item())
        n_mini = max(1, math.ceil(global_rows / mini_batch_trajectories))
        tally, terms, maxima, steps, bad, norms = _Tally(), _Tally(), _Tally(), 0, 0, []
        per_epoch = sum(-(-len(c) // micro_batch_trajectories) for c in torch.arange(own_rows).tensor_split(n_mini))
        count = Countdown(progress, epochs * per_epoch)
        for epoch in range(epochs):
            order = torch.arange(own_rows)
            if shuffle_seed is not None:
                gen = torch.Generator().manual_seed(shuffle_seed * 1000 + epoch)
                order = torch.randperm(own_rows, generator=gen)
            for rows in order.tensor_split(n_mini):
                ok, norm = self._step(batch, rows, loss_fn, micro_batch_trajectories, loss_agg_mode,
                                      max_response_tokens, (tally, terms, maxima), count)
                steps += 1
                bad += 0 if ok else 1
                if ok:
                    norms.append(norm)
        out = self._reduced_metrics((tally, terms, maxima), steps, bad, norms, start)
        _log.info("%s update: %d optimizer steps (%d skipped), %d micro-batches of %d rows on this rank, %.1f s",
                  self.prefix, steps - bad, bad, count.done, own_rows, out[f"timing_s/update_{self.prefix}"])
        return UpdateOutcome(applied=bad != steps, metrics=out)

    def _reduced_metrics(self, tallies: tuple[_Tally, _Tally, _Tally], steps: int, bad: int, norms: list[float],
                         start: float) -> dict[str, float]:  # fmt: skip
        """The metrics of an update of ``steps`` optimizer steps (``bad`` skipped) that began at
        ``start`` (``time.perf_counter()``), reduced over ranks."""
        tally, terms, maxima = tallies
        p = self.prefix
        out = {_metric_name(p, k): v / steps for k, v in terms.sums.items()}  # mean over steps of per-step sums
        out[f"{p}/grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
        out = D.all_reduce_mean(out)
        out.update(_global_means(tally, p))
        out.update(_global_maxima(maxima, p))
        out[f"{p}/lr"] = lr_at(max(0, self.steps_applied - 1), self.settings)
        out[f"{p}/bad_updates"] = float(bad)
        out[f"{p}/optimizer_steps"] = float(steps - bad)
        out[f"{p}/update_skipped"] = float(bad == steps)
        out[f"timing_s/update_{p}"] = time.perf_counter() - start
        return out

    def _step(self, batch: Batch, rows: Tensor, loss_fn: LossFn, micro: int, loss_agg_mode: str,
              max_response_tokens: int | None, tallies: tuple[_Tally, _Tally, _Tally],
              count: Countdown) -> tuple[bool, float]:  # fmt: skip
        """One optimizer step on the mini-batch ``batch[rows]``; returns (applied, grad norm).

        The mini-batch's rows are ordered (:func:`by_length`: by length, or by prompt then length
        with ``group_by_prompt``) and each micro-batch is trimmed of the
        columns that are padding in all its rows (:meth:`Batch.trim_padding`), so a micro-batch
        of short responses is not computed at the longest response's width. The gradient is the
        same sum over rows (every micro-batch divides by the whole mini-batch's normaliser).
        """
        mini = batch.index(by_length(batch, rows, group_by_prompt=self.group_by_prompt))
        plan = accumulation_plan(
            mini["response_mask"],
            micro,
            loss_agg_mode,
            max_response_tokens=max_response_tokens,
            sum_across_ranks=lambda x: float(D.all_reduce_sum(torch.tensor([x], dtype=torch.float64)).item()),
            world_size=self.world_size,
        )
        self.optimizer.zero_grad(set_to_none=True)
        finite = self._accumulate(batch, mini, plan, loss_fn, loss_agg_mode, max_response_tokens, tallies, count)
        return self._apply_step(finite)

    def _accumulate(self, batch: Batch, mini: Batch, plan: list[MicroBatch], loss_fn: LossFn, loss_agg_mode: str,
                    max_response_tokens: int | None, tallies: tuple[_Tally, _Tally, _Tally],
                    count: Countdown) -> bool:  # fmt: skip
        """Backward of every micro-batch of ``plan`` over ``mini`` (gradients summed, synchronised
        on the last one); True when every loss on this rank was finite. A rank with fewer
        micro-batches than the most any rank has runs zero-weighted passes on ``batch[0]`` so the
        collectives stay in step."""
        n_micro = int(D.all_reduce_max(torch.tensor([len(plan)], dtype=torch.float64)).item())
        tally, terms, maxima = tallies  # token-weighted means, per-step sums, maxima
        finite = True
        for k in range(n_micro):
            with D.no_sync(self.model, enabled=k < n_micro - 1):
                if k < len(plan):
                    micro_batch = mini.index(range(plan[k].rows.start, plan[k].rows.stop)).trim_padding()
                    res = loss_fn(self.model, micro_batch, plan[k])
                    finite &= bool(torch.isfinite(res.loss.detach()).item())
                    # token-weighted: a micro-batch's token-mean statistics count by its tokens, so the
                    # result does not depend on how rows were grouped into micro-batches
                    tally.add(res.averages, weight=float(micro_batch["response_mask"].sum()))
                    terms.add(res.loss_terms)
                    maxima.add_max(res.maxima)
                    res.loss.backward()
                    count.advance()
                else:  # keep collectives in step with ranks that have more micro-batches
                    dummy = batch.index([0])
                    res = loss_fn(self.model, dummy, MicroBatch(slice(0, 1), loss_agg_mode, 1.0, max_response_tokens))
                    (res.loss * 0.0).backward()
                    # zero weight, but the same metric keys on every rank (the reductions need them)
                    tally.add(res.averages, weight=0.0)
                    terms.add(dict.fromkeys(res.loss_terms, 0.0))
                    maxima.add_max(dict.fromkeys(res.maxima, -math.inf))
        return finite

    def _apply_step(self, finite: bool) -> tuple[bool, float]:
        """Clip and apply the accumulated gradient unless a loss on any rank, or the gradient norm,
        is not finite (then the gradient is dropped); returns (applied, grad norm)."""
        all_finite = D.all_reduce_max(torch.tensor([0.0 if finite else 1.0])).item() == 0.0
        norm = D.clip_grad_norm(self.params, self.settings.max_grad_norm)
        if not (all_finite and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return False, norm
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.steps_applied, self.settings)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_applied += 1
        return True, norm

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state (this rank's shards under FSDP2, as local tensors) + step counter."""
        sd = self.optimizer.state_dict()
        state = {
            idx: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in s.items()}
            for idx, s in sd["state"].items()
        }
        return {"optimizer": {"state": state, "param_groups": sd["param_groups"]}, "steps_applied": self.steps_applied}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` on an identically built (and sharded) model."""
        state = {}
        for idx, s in sd["optimizer"]["state"].items():
            param = self.params[int(idx)]
            state[int(idx)] = {k: _like_param(v, param) for k, v in s.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": sd["optimizer"]["param_groups"]})
        self.steps_applied = int(sd["steps_applied"])


def _like_param(value: Any, param: Tensor) -> Any:
    """Re-wrap a saved local shard as a DTensor like ``param`` (FSDP2); other values as they are."""
    if not isinstance(value, Tensor) or value.dim() == 0 or not hasattr(param, "device_mesh"):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


def _global_means(tally: _Tally, prefix: str) -> dict[str, float]:
    """Token-weighted mean of each averaged statistic over all micro-batches of all ranks."""
    keys = sorted(tally.sums)
    both = {f"s/{k}": tally.sums[k] for k in keys} | {f"c/{k}": tally.counts[k] for k in keys}
    world = D.dist.get_world_size() if D.is_distributed() else 1
    reduced = {k: v * world for k, v in D.all_reduce_mean(both).items()}  # sums over ranks
    return {_metric_name(prefix, k): reduced[f"s/{k}"] / max(reduced[f"c/{k}"], 1.0) for k in keys}


def _global_maxima(maxima: _Tally, prefix: str) -> dict[str, float]:
    """Max of each statistic over all micro-batches of all ranks (NaN where none had a row)."""
    keys = sorted(maxima.sums)
    if not keys:
        return {}
    reduced = D.all_reduce_max(torch.tensor([maxima.sums[k] for k in keys], dtype=torch.float64)).tolist()
    return {_metric_name(prefix, k): v if v != -math.inf else math.nan for k, v in zip(keys, reduced, strict=True)}


__all__ = ["VersionMismatchError", "OptimSettings", "lr_at", "MicroResult", "Optimization", "UpdateOutcome",
           "VersionedUpdates"]
