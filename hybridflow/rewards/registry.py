"""Rule-reward registry keyed by ``data_source``, and verl's ``default_compute_score``.

A rule reward is registered for one or more data sources::

    @register_reward("openai/gsm8k", "gsm8k")
    def gsm8k_reward(solution_str, ground_truth, extra_info, cfg) -> dict: ...

and must return a dict with ``score`` (float) plus extra fields (``acc``, ``parsed``, ``pred``)
that become metrics. :func:`default_compute_score` dispatches by ``data_source`` as verl's
``verl.utils.reward_score.default_compute_score`` does, then mixes in the format reward
(:mod:`hybridflow.rewards.format`) by the weights in :class:`~hybridflow.config.RewardConfig`.
One implementation per name: registering a name twice raises. A reward may also claim a name
prefix (``register_reward("aime2024", prefixes=("aime",))``, as verl routes every
``data_source.startswith("aime")``): an exact name wins over a prefix, a longer prefix over a shorter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.config import RewardConfig

RuleReward = Callable[[str, Any, "dict[str, Any] | None", RewardConfig], dict[str, Any]]

_REWARDS: dict[str, RuleReward] = {}
_PREFIXES: dict[str, RuleReward] = {}
_DEFAULT_CFG: RewardConfig | None = None


class UnknownDataSourceError(NotImplementedError, KeyError):
    """No rule reward is registered for a data_source (verl raises NotImplementedError here)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register_reward(*data_sources: str, prefixes: tuple[str, ...] = ()) -> Callable[[RuleReward], RuleReward]:
    """Decorator registering a rule reward under each of ``data_sources`` (and each name prefix).

    Raises ValueError when a name or prefix is already registered or no name is given.
    """
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source name")

    def deco(fn: RuleReward) -> RuleReward:
        for table, names in ((_REWARDS, data_sources), (_PREFIXES, prefixes)):
            for name in names:
                if name in table:
                    raise ValueError(f"a reward for data_source {name!r} is already registered ({table[name].__name__})")
        _REWARDS.update(dict.fromkeys(data_sources, fn))
        _PREFIXES.update(dict.fromkeys(prefixes, fn))
        return fn

    return deco


def get_reward(data_source: str) -> RuleReward:
    """The rule reward for ``data_source`` (exact name, else longest registered prefix);
    UnknownDataSourceError lists the registered names."""
    _load_builtins()
    if data_source in _REWARDS:
        return _REWARDS[data_source]
    matching = [p for p in _PREFIXES if isinstance(data_source, str) and data_source.startswith(p)]
    if matching:
        return _PREFIXES[max(matching, key=len)]
    prefixed = "".join(f", {p}*" for p in sorted(_PREFIXES))
    raise UnknownDataSourceError(
        f"no reward registered for data_source {data_source!r}; registered: {', '.join(sorted(_REWARDS))}{prefixed} "
        "(register one with @hybridflow.rewards.register_reward or set reward.function)"
    )


def reward_names() -> list[str]:
    """All registered data_source names, sorted (prefixes are in :func:`reward_prefixes`)."""
    _load_builtins()
    return sorted(_REWARDS)


def reward_prefixes() -> list[str]:
    """All registered data_source prefixes, sorted."""
    _load_builtins()
    return sorted(_PREFIXES)


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
        from hybridflow.rewards import (  # noqa: F401
            arith,
            code,
            countdown,
            geo3k,
            gsm8k,
            math_dapo,
            math_reward,
            prime_math,
            search_qa,
        )


__all__ = [
    "register_reward",
    "get_reward",
    "reward_names",
    "reward_prefixes",
    "default_compute_score",
    "UnknownDataSourceError",
]
