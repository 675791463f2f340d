"""The reward worker process: the reward call kind's child of :mod:`hybridflow.procpool`.

Runs as ``python -m hybridflow.rewards._worker FD`` (the loop, the pipe protocol and the error
outcomes: :mod:`hybridflow.procpool.child`). Setup: ``(spec, cfg_dict)``; the scorer is loaded
once (rule rewards by data_source when ``spec`` is None, else the user's function). Requests are
:class:`hybridflow.rewards.executor.RewardItem`; an outcome is "ok" (value = a
:class:`RewardScore`), "nan" (None / NaN / inf score) or "error" (value = a one-line message).
Ready info: the registered reward names and prefixes (:class:`RewardSources`).
"""

from __future__ import annotations

import math
from typing import Any

from hybridflow.procpool.child import Outcome, serve
from hybridflow.rewards.executor import RewardItem, RewardScore, RewardSources


class _Scorer:
    def __init__(self, spec: str | None, cfg_dict: dict[str, Any]) -> None:
        from hybridflow.config import RewardConfig

        self.cfg = RewardConfig.model_validate(cfg_dict)
        self.fn = None
        if spec is not None:
            from hybridflow.rewards.loader import load_reward_function

            self.fn = load_reward_function(spec)

    @property
    def batched(self) -> bool:
        return self.fn is not None and self.fn.batched

    def score_row(self, p: RewardItem) -> Any:
        if self.fn is None:
            from hybridflow.rewards.registry import default_compute_score

            return default_compute_score(p.data_source, p.solution_str, p.ground_truth, p.extra_info, reward_cfg=self.cfg)
        return self.fn.score_row(p.data_source, p.solution_str, p.ground_truth, p.extra_info)

    def score_batch(self, ps: list[RewardItem]) -> list[Any]:
        assert self.fn is not None
        return self.fn.score_batch([p.prompt for p in ps], [p.solution_str for p in ps], [p.data_source for p in ps],
                                   [p.ground_truth for p in ps], [p.extra_info for p in ps])  # fmt: skip


def normalise(value: Any) -> Outcome:
    """Turn a reward function's return value into (status, value) — see the module docstring."""
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return "error", f"returned a dict without 'score' (keys: {sorted(value)})"
        extra = {str(k): _scalar(v) for k, v in value.items() if k != "score"}
        value = value["score"]
    if value is None:
        return "nan", "returned None"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return "error", f"returned {type(value).__name__} {str(value)[:60]!r}, not a number"
    if not math.isfinite(score):
        return "nan", f"returned {score}"
    return "ok", RewardScore(score, extra)


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    try:
        return float(v)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(v)


class RewardHandler:
    """The reward call kind's handler (:class:`hybridflow.procpool.child.Handler`); setup = (spec, cfg_dict)."""

    def __init__(self, setup: tuple[str | None, dict[str, Any]]) -> None:
        from hybridflow.rewards.registry import reward_names, reward_prefixes

        self.scorer = _Scorer(*setup)
        self.batched = self.scorer.batched
        self.info = RewardSources(tuple(reward_names()), tuple(reward_prefixes()))  # after the function's import

    def call(self, request: RewardItem) -> Outcome:
        return normalise(self.scorer.score_row(request))

    def call_batch(self, requests: list[RewardItem]) -> list[Outcome]:
        return [normalise(v) for v in self.scorer.score_batch(requests)]


def main() -> None:
    serve(RewardHandler)


if __name__ == "__main__":
    main()
