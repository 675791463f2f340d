"""The rule reward of rows that an environment scores (``hybridflow data textarena``:
data_source ``textarena/<env_id>``; ``verifiers/<name>`` (``hybridflow data verifiers``); ``gymnasium/<id>``
and ``openenv/<name>`` for user rows of the gymnasium and openenv adapters).

There is nothing for a rule to check in such a row: the game's outcome is the environment's reward
(the trajectory's summed ``step`` rewards, see docs/agents.md "Rewards"). With ``reward.combine:
replace`` (the default) that reward is the score; with ``add`` this rule adds 0.0. A trajectory whose
environment gave no reward (it failed: ``env_error``) scores 0.0 here.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.registry import register_reward


@register_reward("textarena", "gymnasium", "openenv", "verifiers",
                 prefixes=("textarena/", "gymnasium/", "openenv/", "verifiers/"))
def environment_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """Always {"score": 0.0}: the environment's reward is the score (module docstring)."""
    return {"score": 0.0}
