"""RewardWorker: decode responses, score them (rule / custom functions and/or a reward model), place token scores.

Rule and custom rewards go through :class:`hybridflow.rewards.RewardExecutor` (rule rewards
selected by ``data_source``, or ``reward.function``), which turns every failure of reward
code (raise, NaN, timeout, crash) into ``reward.on_error`` and counts it.

A reward *model* (``reward.model.path``; sequence classification with one label, verl's
RewardModelWorker) is loaded once per rank when the worker starts and scores each response
re-tokenized with its own tokenizer (:class:`hybridflow.models.RewardModelScorer`):
``reward.model.combine="add"`` → score = rule score + weight·rm score; ``"replace"`` → score =
weight·rm score, and the rule / custom functions are not called.

The final score of a response goes on its last valid token of ``token_level_scores`` (0
elsewhere), as verl's reward managers do.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from hybridflow.batch import Batch, BatchError, is_padding
from hybridflow.config import ExperimentConfig
from hybridflow.precision import resolved_precision
from workers import distributed as D
from workers.dispatch import dispatch


def place_scores(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32 with ``scores[i]`` at row i's last True position of ``response_mask``.

    A row without any response token gets its score at position 0 (outside the mask, so
    estimators ignore it). Example: mask [[T, T, F], [T, F, F]], scores [1, 0.5] →
    [[0, 1, 0], [0.5, 0, 0]].
    """
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    width = response_mask.shape[1]  # the last True index (multi-turn masks have gaps), 0 for none
    last = torch.where(response_mask.any(-1), width - 1 - response_mask.flip(-1).int().argmax(-1), 0)
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
        self.executor = RewardExecutor(cfg.reward, plugins=cfg.trainer.plugins)  # processes start on first use
        self.reward_model = None
        if cfg.reward.model.path is not None:
            from hybridflow.models import RewardModelScorer

            self.reward_model = RewardModelScorer.from_config(
                cfg.reward.model, dtype=resolved_precision(cfg).param_dtype, device=device, seed=cfg.trainer.seed
            )

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

        rules_run = self._rules_run()
        needed = ("response_ids", "response_mask", "data_source", *(("ground_truth",) if rules_run else ()))
        missing = [k for k in needed if k not in batch]
        if missing:
            raise BatchError(f"compute_rewards: batch lacks {missing} (has {batch.keys()})")
        texts = response_texts(self.tokenizer, batch)
        n = len(batch)
        prompts = batch.non_tensors.get("raw_prompt") or [""] * n
        truths = batch.non_tensors.get("ground_truth") or [None] * n
        extra = batch.non_tensors.get("extra_info") or [None] * n
        uids = batch.non_tensors.get("uid") or [None] * n
        return [
            RewardItem(batch["data_source"][i], texts[i], truths[i], extra[i], prompts[i] or "",
                       None if uids[i] is None else str(uids[i]))
            for i in range(n)
        ]

    def _rules_run(self) -> bool:
        """Whether the rule / custom functions are called (not with a reward model or a judge in 'replace' mode)."""
        judge = self.cfg.reward.judge
        if judge.enable and judge.combine == "replace":
            return False
        return self.reward_model is None or self.cfg.reward.model.combine == "add"

    def _rule_results(self, items: list[Any]) -> Any:
        from hybridflow.rewards import RewardResults

        if self._rules_run():
            return self.executor.score(items)
        n = len(items)
        return RewardResults(scores=[0.0] * n, extra={}, failures=[None] * n, metrics={}, logs=[], messages=[None] * n)

    @dispatch("dp_scatter")
    def compute_rewards(self, batch: Batch) -> Batch:
        """Adds ``token_level_scores`` [B, R] float32, non-tensors ``score`` (final float per row),
        ``reward_failure`` (None | "error" | "nan" | "timeout" | "crash"), ``reward_error`` (None |
        one line: what went wrong on that row) and the reward's extra
        fields (e.g. ``acc``; a field whose name the batch already has is not overwritten); with a
        reward model also ``rm_score`` (its raw logit per row, before ``reward.model.weight``).
        meta["metrics"]: critic/score/{mean,max,min}, critic/score/<data_source>/mean, the
        executor's reward/* metrics (counts of failures, per-source means of the final score) and,
        with a reward model, reward/rm_score/{mean,max,min}, reward/rm_truncated (rows cut to
        reward.model.max_length) and reward/rule_score/mean ('add'), over all ranks; with the judge
        node's ``judge_score`` in the batch ([0, 1] per row, None → ``reward.on_error``), the score
        combined by ``reward.judge.weight`` / ``combine`` after the reward model's, and
        reward/judge_rule_agreement when the rules ran too.
        meta["logs"]: one line per failing row, for the task to forward.
        Raises BatchError for missing fields, UnknownDataSourceError for an unregistered source.
        """
        items = self._items(batch)
        res = self._rule_results(items)
        scores = [float(s) for s in res.scores]
        rm = None
        if self.reward_model is not None:
            rm = self.reward_model.score(row_prompts(self.tokenizer, batch), [it.solution_str for it in items])
            scores = combine_scores(scores, rm.scores, self.cfg.reward.model.weight, self.cfg.reward.model.combine)
        judged = "judge_score" in batch  # the judge node's scores ([0, 1], None = unparsed / overlong)
        if judged:
            judge = self.cfg.reward.judge
            on_error = self.cfg.reward.on_error
            scores = combine_scores(scores, [on_error if j is None else j for j in batch["judge_score"]],
                                    judge.weight, judge.combine)
        if "env_reward" in batch:  # multi-turn environments' summed rewards (reward.combine)
            add = self.cfg.reward.combine == "add"
            scores = [s if e is None else e + (s if add else 0.0) for s, e in zip(scores, batch["env_reward"], strict=True)]
        out = batch.shallow_copy()
        out.set("token_level_scores", place_scores(scores, batch["response_mask"]))
        out.set("score", scores)
        out.set("reward_failure", list(res.failures))
        out.set("reward_error", list(res.messages) or [None] * len(items))
        if rm is not None:
            out.set("rm_score", list(rm.scores))
        for key, values in res.extra.items():
            if key not in out:
                out.set(key, [_jsonable(v) for v in values])
        counted = not is_padding(batch)  # a padding stand-in's rows are not counted (the gathers still run)
        metrics = self._metrics(items, scores, res, counted)
        if rm is not None:
            metrics.update(self._rm_metrics(rm, [float(s) for s in res.scores], counted))
        if judged and self._rules_run():
            metrics.update(_agreement_metrics(batch["judge_score"], [float(s) for s in res.scores], counted))
        out.meta["metrics"] = {**batch.meta.get("metrics", {}), **metrics}
        out.meta["logs"] = list(res.logs)
        return out

    def _metrics(self, items: list[Any], scores: list[float], res: Any, counted: bool = True) -> dict[str, float]:
        """Metrics of the final scores over the rows of every rank (all-gathered when the pool has several)."""
        from hybridflow.rewards.executor import reward_metrics

        rows = list(zip(items, scores, res.failures, _row_extras(res, len(items)), strict=True))
        rows = D.gather_rows(rows if counted else [])
        items, scores, failures, extras = (list(x) for x in zip(*rows, strict=True))
        metrics = reward_metrics(items, scores, failures, extras)
        metrics["critic/score/mean"] = sum(scores) / len(scores)
        metrics["critic/score/max"] = max(scores)
        metrics["critic/score/min"] = min(scores)
        for source in sorted({it.data_source for it in items}):
            vals = [s for it, s in zip(items, scores, strict=True) if it.data_source == source]
            metrics[f"critic/score/{source}/mean"] = sum(vals) / len(vals)
        return _finite(metrics)

    def _rm_metrics(self, rm: Any, rule_scores: list[float], counted: bool = True) -> dict[str, float]:
        """reward/rm_score/{mean,max,min} (raw logits), reward/rm_truncated (count of rows cut to
        max_length) and, in 'add' mode, reward/rule_score/mean — over every rank's rows."""
        rows = D.gather_rows(list(zip(rm.scores, rm.truncated, rule_scores, strict=True)) if counted else [])
        rm_scores = [r[0] for r in rows]
        metrics = {
            "reward/rm_score/mean": sum(rm_scores) / len(rm_scores),
            "reward/rm_score/max": max(rm_scores),
            "reward/rm_score/min": min(rm_scores),
            "reward/rm_truncated": float(sum(r[1] for r in rows)),
        }
        if self._rules_run():
            metrics["reward/rule_score/mean"] = sum(r[2] for r in rows) / len(rows)
        return _finite(metrics)


def response_texts(tokenizer: Any, batch: Batch) -> list[str]:
    """Each row's response as text: ``response_ids`` under ``response_mask`` decoded with the policy
    ``tokenizer`` (special tokens dropped); a multi-turn row (``messages``) gives its last assistant turn."""
    ids, mask = batch["response_ids"], batch["response_mask"]
    texts = tokenizer.batch_decode([ids[i][mask[i]].tolist() for i in range(len(batch))], skip_special_tokens=True)
    if "messages" in batch:  # multi-turn: the final text is the last assistant turn
        texts = [next((m["content"] for m in reversed(msgs) if m["role"] == "assistant"), t)
                 for msgs, t in zip(batch["messages"], texts, strict=True)]  # fmt: skip
    return texts


def row_prompts(tokenizer: Any, batch: Batch) -> list[Any]:
    """Each row's prompt for a model that scores it (reward model, judge): ``raw_chat`` (the dataset's
    chat messages, for the scorer's own template), else ``raw_prompt`` (text), else the prompt ids
    decoded with the policy ``tokenizer`` (special tokens kept: they carry the format).
    Raises BatchError when the batch has none of them."""
    chats = batch.non_tensors.get("raw_chat")
    texts = batch.non_tensors.get("raw_prompt")
    if chats is not None or texts is not None:  # chat messages where the row has them, else text
        n = len(batch)
        chats, texts = chats or [None] * n, texts or [None] * n
        if all(c is not None or t is not None for c, t in zip(chats, texts, strict=True)):
            return [c if c is not None else t for c, t in zip(chats, texts, strict=True)]
    if "prompt_ids" not in batch:
        raise BatchError("a reward model or judge needs raw_prompt or prompt_ids in the batch")
    ids, mask = batch["prompt_ids"], batch["prompt_mask"].bool()
    return tokenizer.batch_decode([ids[i][mask[i]].tolist() for i in range(len(batch))])


def combine_scores(rule_scores: list[float], rm_scores: list[float], weight: float, combine: str) -> list[float]:
    """Final per-row scores: "add" → rule + weight·rm; "replace" → weight·rm (rule scores ignored).
    Example: rule [1, 0], rm [0.5, -2], weight 2, add → [2.0, -4.0]; replace → [1.0, -4.0].
    Raises ValueError for another ``combine``."""
    if combine == "add":
        return [float(r) + weight * float(m) for r, m in zip(rule_scores, rm_scores, strict=True)]
    if combine == "replace":
        return [weight * float(m) for m in rm_scores]
    raise ValueError(f"reward.model.combine={combine!r}; allowed: add, replace")


def _agreement_metrics(judge_scores: list[float | None], rule_scores: list[float], counted: bool) -> dict[str, float]:
    """reward/judge_rule_agreement (:func:`hybridflow.rewards.judge.judge_rule_agreement`) over every
    rank's rows; absent when the judge scored none."""
    from hybridflow.rewards.judge import judge_rule_agreement

    rows = D.gather_rows(list(zip(judge_scores, rule_scores, strict=True)) if counted else [])
    agreement = judge_rule_agreement([r[0] for r in rows], [r[1] for r in rows])
    return {} if agreement is None else {"reward/judge_rule_agreement": agreement}


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, float | int) and math.isfinite(v)}


def _row_extras(res: Any, n: int) -> list[dict[str, Any]]:
    return [{k: v[i] for k, v in res.extra.items() if v[i] is not None} for i in range(n)]


__all__ = ["RewardWorker", "combine_scores", "place_scores", "response_texts", "row_prompts"]
