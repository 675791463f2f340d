"""Rule-reward registry keyed by ``data_source``, and verl's ``default_compute_score``.

A rule reward is registered for one or more data sources::

    @register_reward("openai/gsm8k", "gsm8k")
    def gsm8k_reward(solution_str, ground_truth, extra_info, cfg) -> dict: ...

and must return a dict with ``score`` (float) plus extra fields (``acc``, ``parsed``, ``pred``)
that become metrics. :func:`default_compute_score` dispatches by ``data_source`` as verl's
``verl.utils.reward_score.default_compute_score`` does, then mixes in the format reward
(:mod:`hybridflow.rewards.format`) by the weights in :class:`~hybridflow.config.RewardConfig`.
One implementation per name: registering a name twice raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.config import RewardConfig

RuleReward = Callable[[str, Any, "dict[str, Any] | None", RewardConfig], dict[str, Any]]

_REWARDS: dict[str, RuleReward] = {}
_DEFAULT_CFG: RewardConfig | None = None


class UnknownDataSourceError(NotImplementedError, KeyError):
    """No rule reward is registered for a data_source (verl raises NotImplementedError here)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register_reward(*data_sources: str) -> Callable[[RuleReward], RuleReward]:
    """Decorator registering a rule reward under each of ``data_sources``.

    Raises ValueError when a name is already registered or no name is given.
    """
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source name")

    def deco(fn: RuleReward) -> RuleReward:
        for name in data_sources:
            if name in _REWARDS:
                raise ValueError(f"a reward for data_source {name!r} is already registered ({_REWARDS[name].__name__})")
        for name in data_sources:
            _REWARDS[name] = fn
        return fn

    return deco


def get_reward(data_source: str) -> RuleReward:
    """The rule reward for ``data_source``; UnknownDataSourceError lists the registered names."""
    _load_builtins()
    try:
        return _REWARDS[data_source]
    except KeyError:
        raise UnknownDataSourceError(
            f"no reward registered for data_source {data_source!r}; registered: {', '.join(sorted(_REWARDS))} "
            "(register one with @hybridflow.rewards.register_reward or set reward.function)"
        ) from None


def reward_names() -> list[str]:
    """All registered data_source names, sorted."""
    _load_builtins()
    return sorted(_REWARDS)


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    reward_cfg: RewardConfig | None = None,
) -> dict[str, Any]:
    """verl-compatible entry point: score one response with the rule reward of its data_source.

    solution_str: the decoded response (no prompt). ground_truth: usually a string (a dict for
    TinyZero countdown rows). reward_cfg: extraction mode and format weighting; defaults to
    ``RewardConfig()``. Returns a dict: ``score`` = correctness_weight·correctness +
    format_weight·format (the format term only when format_weight > 0; then a ``format`` field
    holds the 0/1 format check), plus the reward's extra fields (``acc``, ``parsed``, ``pred``).
    Raises UnknownDataSourceError for an unregistered data_source, ValueError for an unusable
    ground truth.
    """
    cfg = reward_cfg if reward_cfg is not None else _default_cfg()
    result = dict(get_reward(data_source)(solution_str, ground_truth, extra_info, cfg))
    correctness = float(result["score"])
    score = cfg.correctness_weight * correctness
    if cfg.format_weight > 0:
        from hybridflow.rewards.format import format_score

        fmt = format_score(solution_str, cfg.format_style)
        result["format"] = fmt
        score += cfg.format_weight * fmt
    result["score"] = score
    return result


def _default_cfg() -> RewardConfig:
    global _DEFAULT_CFG
    if _DEFAULT_CFG is None:
        _DEFAULT_CFG = RewardConfig()
    return _DEFAULT_CFG


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    """Import the built-in reward modules (they register themselves) on first use."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from hybridflow.rewards import arith, countdown, gsm8k, math_reward  # noqa: F401


__all__ = [
    "register_reward",
    "get_reward",
    "reward_names",
    "default_compute_score",
    "UnknownDataSourceError",
]
