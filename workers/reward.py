"""RewardWorker: decode responses, score them in the reward process pool, place token scores.

Scoring goes through :class:`hybridflow.rewards.RewardExecutor` (rule rewards selected by
``data_source``, or ``reward.function``), which turns every failure of reward code (raise,
NaN, timeout, crash) into ``reward.on_error`` and counts it. The score of a response goes on
its last valid token of ``token_level_scores`` (0 elsewhere), as verl's reward managers do.

Not implemented: a reward *model* (sequence classification); only rule / custom functions.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from hybridflow.batch import Batch, BatchError
from hybridflow.config import ExperimentConfig
from workers import distributed as D
from workers.dispatch import dispatch
from workers.policy import copy_batch


def place_scores(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32 with ``scores[i]`` at row i's last True position of ``response_mask``.

    A row without any response token gets its score at position 0 (outside the mask, so
    estimators ignore it). Example: mask [[T, T, F], [T, F, F]], scores [1, 0.5] →
    [[0, 1, 0], [0.5, 0, 0]].
    """
    lengths = response_mask.sum(-1)
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (lengths - 1).clamp(min=0)
    out[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return out


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return str(value)


class RewardWorker:
    """Rule / custom-function rewards on one rank of the reward pool (``reward.num_workers``
    processes each, started on the first call)."""

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        from hybridflow.models import load_tokenizer
        from hybridflow.rewards import RewardExecutor

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.tokenizer = load_tokenizer(cfg.model)
        self.executor = RewardExecutor(cfg.reward, plugins=cfg.trainer.plugins)

    def close(self) -> None:
        """Stop the reward processes."""
        self.executor.close()

    def __del__(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            try:
                executor.close()
            except Exception:  # interpreter shutdown: the pool may already be gone
                pass

    def _items(self, batch: Batch) -> list[Any]:
        from hybridflow.rewards import RewardItem

        missing = [k for k in ("response_ids", "response_mask", "data_source", "ground_truth") if k not in batch]
        if missing:
            raise BatchError(f"compute_rewards: batch lacks {missing} (has {batch.keys()})")
        ids, mask = batch["response_ids"], batch["response_mask"]
        texts = self.tokenizer.batch_decode([ids[i][mask[i]].tolist() for i in range(len(batch))],
                                            skip_special_tokens=True)
        n = len(batch)
        prompts = batch.non_tensors.get("raw_prompt") or [""] * n
        extra = batch.non_tensors.get("extra_info") or [None] * n
        uids = batch.non_tensors.get("uid") or [None] * n
        return [
            RewardItem(batch["data_source"][i], texts[i], batch["ground_truth"][i], extra[i], prompts[i] or "",
                       None if uids[i] is None else str(uids[i]))
            for i in range(n)
        ]

    @dispatch("dp_scatter")
    def compute_rewards(self, batch: Batch) -> Batch:
        """Adds ``token_level_scores`` [B, R] float32, non-tensors ``score`` (float per row),
        ``reward_failure`` (None | "error" | "nan" | "timeout" | "crash") and the reward's extra
        fields (e.g. ``acc``; a field whose name the batch already has is not overwritten).
        meta["metrics"]: critic/score/{mean,max,min}, critic/score/<data_source>/mean and the
        executor's reward/* metrics (counts of failures, per-source means), over all ranks.
        meta["logs"]: one line per failing row, for the task to forward.
        Raises BatchError for missing fields, UnknownDataSourceError for an unregistered source.
        """
        items = self._items(batch)
        res = self.executor.score(items)
        out = copy_batch(batch)
        out.set("token_level_scores", place_scores(res.scores, batch["response_mask"]))
        out.set("score", [float(s) for s in res.scores])
        out.set("reward_failure", list(res.failures))
        for key, values in res.extra.items():
            if key not in out:
                out.set(key, [_jsonable(v) for v in values])
        out.meta["metrics"] = {**batch.meta.get("metrics", {}), **self._metrics(items, res)}
        out.meta["logs"] = list(res.logs)
        return out

    def _metrics(self, items: list[Any], res: Any) -> dict[str, float]:
        """Metrics over the rows of every rank (all-gathered when the pool has several)."""
        from hybridflow.rewards.executor import _metrics as executor_metrics

        rows = list(zip(items, res.scores, res.failures, _row_extras(res, len(items)), strict=True))
        if D.is_distributed():
            gathered: list[Any] = [None] * D.dist.get_world_size()
            D.dist.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
        items, scores, failures, extras = (list(x) for x in zip(*rows, strict=True))
        metrics = executor_metrics(items, scores, failures, extras)
        metrics["critic/score/mean"] = sum(scores) / len(scores)
        metrics["critic/score/max"] = max(scores)
        metrics["critic/score/min"] = min(scores)
        for source in sorted({it.data_source for it in items}):
            vals = [s for it, s in zip(items, scores, strict=True) if it.data_source == source]
            metrics[f"critic/score/{source}/mean"] = sum(vals) / len(vals)
        return {k: v for k, v in metrics.items() if isinstance(v, float | int) and math.isfinite(v)}


def _row_extras(res: Any, n: int) -> list[dict[str, Any]]:
    return [{k: v[i] for k, v in res.extra.items() if v[i] is not None} for i in range(n)]


__all__ = ["RewardWorker", "place_scores"]
