"""Generation shared by the roles that hold a rollout engine: the policy (the colocated hybrid
engine) and the rollout role (a separate copy of the policy for asynchronous training,
:mod:`workers.rollout_worker`).

A class using :class:`Generation` provides ``cfg``, ``rank``, ``engine``, ``stop_ids``,
``_multi_turn`` (or None) and a ``weights_version`` attribute or property. It reports
trajectories finished to ``self.progress`` (:mod:`workers.progress`; phase ``generating``, or
``validating``) and logs one line per call (``workers.generation``; the task forwards it to
Prefect, :mod:`workers.worker_logs`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import Tensor

from hybridflow.algorithms import position_ids_from_mask
from hybridflow.batch import Batch, is_padding
from hybridflow.metric_names import METRIC_NAMES
from workers import distributed as D
from workers import shared_prefix
from workers.dispatch import dispatch
from workers.progress import NO_PROGRESS, ProgressSink, Tick
from workers.rollout.capabilities import engine_capabilities

RANK_SEED_STRIDE = 1_000_003  # rank r samples with seed + r·stride
_log = logging.getLogger(__name__)


def _engine_generate(engine: Any, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Any, tick: Tick) -> Any:
    """``engine.generate`` with the progress callback when the engine declares ``progress`` (hf
    does: rows finished as they stop); otherwise (vllm, an engine that declares nothing) progress
    is reported once, at the end."""
    if engine_capabilities(engine).progress:
        return engine.generate(prompt_ids, prompt_mask, sampling, progress=tick)
    out = engine.generate(prompt_ids, prompt_mask, sampling)
    tick(len(out), len(out))
    return out


class Generation:
    """``generate_sequences`` for a worker with a rollout engine (see the module docstring)."""

    weights_version: int
    progress: ProgressSink = NO_PROGRESS  # a pool rank gets a FileProgress (workers.host.WorkerHost)

    @dispatch("dp_scatter")
    def generate_sequences(self, batch: Batch, *, seed: int, validate: bool = False) -> Batch:
        """One row per prompt → ``n`` rows per prompt (prompt-major) with the response fields.

        Input: prompt_ids, prompt_mask; non-tensors (uid, data_source, ground_truth, extra_info,
        raw_prompt, ...) are repeated. n = rollout.samples_per_prompt (training) or
        val_samples_per_prompt at val_temperature (``validate``). Adds response_ids,
        response_mask, rollout_log_probs, position_ids, finish_reason, response_length;
        rollout_version ([B] int64 per trajectory: the weights_version that generated it);
        meta: weights_version, metrics (timing_s/gen, response_length/*). Deterministic given
        ``seed`` (rank r uses seed + r·1000003).
        """
        from workers.rollout.base import sampling_params_from_config

        start = time.perf_counter()
        sampling = sampling_params_from_config(
            self.cfg.rollout, self.stop_ids, validation=validate, seed=seed + RANK_SEED_STRIDE * self.rank
        )
        tick = self.progress.tick("validating" if validate else "generating")
        self.engine.wake_up()
        try:
            if self._multi_turn is not None:  # tools / environment: workers/rollout/multi_turn.py
                out = self._multi_turn.generate(batch, sampling, progress=tick)
            else:
                out = _engine_generate(self.engine, batch["prompt_ids"], batch["prompt_mask"], sampling, tick)
        finally:
            self.engine.sleep()
        rows = batch.repeat_interleave(sampling.n)
        for key, value in [*out.tensors().items(), *getattr(out, "non_tensors", {}).items()]:
            rows.set(key, value.cpu() if isinstance(value, Tensor) else value)
        attn = shared_prefix.attention_mask(rows)
        rows.set("position_ids", position_ids_from_mask(attn))
        lengths = rows["response_mask"].sum(-1)
        rows.set("finish_reason", list(out.finish_reason))
        rows.set("response_length", lengths.tolist())
        rows.meta["weights_version"] = self.weights_version
        rows.set("rollout_version", torch.full((len(rows),), self.weights_version, dtype=torch.long))
        n = 0 if is_padding(batch) else len(rows)  # a padding stand-in counts for nothing
        rows.meta["metrics"] = self._generation_metrics(lengths[:n], out.finish_reason[:n], time.perf_counter() - start)
        rows.meta["metrics"].update(getattr(out, "metrics", {}))  # multi-turn: already without padding
        rows.meta["metrics"].update(self._engine_metrics())
        _log.info("rank %d %s %d trajectories in %.1f s: %d stopped, %d at the length limit, mean length %.1f",
                  self.rank, "validated" if validate else "generated", n, time.perf_counter() - start,
                  sum(r == "stop" for r in out.finish_reason[:n]), sum(r == "length" for r in out.finish_reason[:n]),
                  float(lengths[:n].float().mean()) if n else 0.0)
        return rows

    def _engine_metrics(self) -> dict[str, float]:
        """What the engine declares it reports (collective over the ranks): with ``compiled_step``
        set (``rollout.compile``) the compile seconds and shapes so far, with ``fused_decode``
        whether every rank's last single-turn call decoded fused (the reason logged once when not)."""
        caps, metrics = engine_capabilities(self.engine), {}
        compiled = self.engine.compiled_step if caps.compiled_step else None
        if compiled is not None:
            worst = D.all_reduce_max(torch.tensor([compiled.compile_seconds, compiled.compiles], dtype=torch.float64))
            metrics[METRIC_NAMES["rollout_compile_time_s"]] = float(worst[0])
            metrics[METRIC_NAMES["rollout_compiled_shapes"]] = float(worst[1])
        if caps.fused_decode:  # the hf engine: did single-turn calls run fused?
            reason = self.engine.fused_decode_reason
            fused = -D.all_reduce_max(torch.tensor([-float(reason is None)], dtype=torch.float64))
            metrics[METRIC_NAMES["rollout_fused_decode"]] = float(fused[0])
            if reason is not None and reason != getattr(self, "_fused_reason_logged", None):
                _log.info("rank %d: hf engine decodes through the model's forward: %s", self.rank, reason)
                self._fused_reason_logged = reason
        return metrics

    def _generation_metrics(self, lengths: Tensor, finish: list[str], seconds: float) -> dict[str, float]:
        n_len = sum(r == "length" for r in finish)
        sums = D.all_reduce_sum(torch.tensor([float(lengths.sum()), float(len(lengths)), float(n_len)],
                                             dtype=torch.float64))
        hi, neg_lo = (float(lengths.max()), -float(lengths.min())) if len(lengths) else (-math.inf, -math.inf)
        maxes = D.all_reduce_max(torch.tensor([hi, neg_lo, seconds], dtype=torch.float64))
        rows = max(float(sums[1]), 1.0)
        return {
            METRIC_NAMES["rollout_time_s"]: float(maxes[2]),
            "response_length/mean": float(sums[0]) / rows,
            "response_length/max": float(maxes[0]),
            "response_length/min": -float(maxes[1]),
            "response_length/clip_ratio": float(sums[2]) / rows,
        }


__all__ = ["Generation", "RANK_SEED_STRIDE"]
