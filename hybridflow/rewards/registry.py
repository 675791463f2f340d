"""Rule-reward registry keyed by ``data_source``, and verl's ``default_compute_score``.

A rule reward is registered for one or more data sources::

    @register_reward("openai/gsm8k", "gsm8k")
    def gsm8k_reward(solution_str, ground_truth, extra_info, cfg) -> dict: ...

and must return a dict with ``score`` (float) plus extra fields (``acc``, ``parsed``, ``pred``)
that become metrics. :func:`default_compute_score` dispatches by ``data_source`` as verl's
``verl.utils.reward_score.default_compute_score`` does, then mixes in the format reward
(:mod:`hybridflow.rewards.format`) by the weights in :class:`~hybridflow.config.RewardConfig`.
One implementation per name (:class:`hybridflow.registry.Registry`): registering a name twice raises. A reward may also claim a name
prefix (``register_reward("aime2024", prefixes=("aime",))``, as verl routes every
``data_source.startswith("aime")``): an exact name wins over a prefix, a longer prefix over a shorter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.registry import Registry, UnknownNameError

RuleReward = Callable[[str, Any, "dict[str, Any] | None", RewardConfig], dict[str, Any]]


class UnknownDataSourceError(NotImplementedError, UnknownNameError):
    """No rule reward is registered for a data_source (verl raises NotImplementedError here; also
    a KeyError and a ValueError, as every registry's unknown name)."""


def _load_builtins() -> None:
    """Import the built-in reward modules (they register themselves) on first lookup."""
    from hybridflow.rewards import (  # noqa: F401
        arith,
        code,
        countdown,
        environment,
        geo3k,
        gsm8k,
        math_dapo,
        math_reward,
        prime_math,
        reasoning_gym,
        search_qa,
    )


REWARDS: Registry[RuleReward] = Registry("reward for data_source", builtins=_load_builtins)
REWARD_PREFIXES: Registry[RuleReward] = Registry("reward for data_source prefix", builtins=_load_builtins)
_DEFAULT_CFG: RewardConfig | None = None


def register_reward(*data_sources: str, prefixes: tuple[str, ...] = ()) -> Callable[[RuleReward], RuleReward]:
    """Decorator registering a rule reward under each of ``data_sources`` (and each name prefix).

    Raises DuplicateNameError (a ValueError, naming the module that registered it) when a name or
    prefix is already registered — before any of them is recorded; ValueError when no name is given.
    """
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source name")

    def deco(fn: RuleReward) -> RuleReward:
        for registry, names in ((REWARDS, data_sources), (REWARD_PREFIXES, prefixes)):
            for name in names:
                registry.check_free(name)
        for registry, names in ((REWARDS, data_sources), (REWARD_PREFIXES, prefixes)):
            for name in names:
                registry.add(name, fn)
        return fn

    return deco


def get_reward(data_source: str) -> RuleReward:
    """The rule reward for ``data_source`` (exact name, else longest registered prefix);
    UnknownDataSourceError lists the registered names."""
    if data_source in REWARDS:
        return REWARDS.get(data_source)
    matching = [p for p in REWARD_PREFIXES.names() if isinstance(data_source, str) and data_source.startswith(p)]
    if matching:
        return REWARD_PREFIXES.get(max(matching, key=len))
    prefixed = "".join(f", {p}*" for p in REWARD_PREFIXES.names())
    raise UnknownDataSourceError(
        f"no reward registered for data_source {data_source!r}; registered: {', '.join(REWARDS.names())}{prefixed} "
        "(register one with @hybridflow.rewards.register_reward or set reward.function)"
    )


reward_names = REWARDS.names  # all registered data_source names, sorted (prefixes: reward_prefixes)
reward_prefixes = REWARD_PREFIXES.names  # all registered data_source prefixes, sorted


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


__all__ = [
    "register_reward",
    "get_reward",
    "reward_names",
    "reward_prefixes",
    "default_compute_score",
    "UnknownDataSourceError",
]
