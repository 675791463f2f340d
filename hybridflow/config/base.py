"""What every config section shares: the frozen base model, ConfigError, renamed keys, and the
names of the built-in estimators / losses (checked without importing torch)."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hybridflow.deprecation import deprecation_message

# Names of the estimators / losses that ship with hybridflow. Config validation checks
# against these without importing torch; a name outside them is looked up in the live
# registry (after importing `trainer.plugins`), so user-registered names work too.
BUILTIN_ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
)
BUILTIN_POLICY_LOSSES = ("ppo", "gspo", "reinforce", "cispo")
ESTIMATORS_NEEDING_VALUES = ("gae",)

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimatorName = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
Role = Literal["policy", "rollout", "reference", "critic", "reward", "tools", "judge", "evaluator"]


class ConfigError(ValueError):
    """A config problem, already formatted for humans (one line per problem)."""


# Deprecated key → its new name (dotted paths). The old key loads with a FutureWarning and a
# logged warning naming the new one; a config that sets both is a ConfigError.
RENAMED_KEYS = {"data.prompts_per_step": "data.prompts_per_iteration"}

_log = logging.getLogger("hybridflow.config")  # the name the loggers had before the split


def _rename_key(data: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``data`` (a nested config dict) with ``section.old_key`` renamed to ``section.new_key``.

    Raises ValueError when both are set."""
    section_name, old_leaf = old.split(".")
    new_leaf = new.split(".")[1]
    section = data.get(section_name)
    if not isinstance(section, dict) or old_leaf not in section:
        return data
    if new_leaf in section:
        raise ValueError(f"{old} and {new} are both set; {old} is the deprecated name of {new}: keep only {new}")
    msg = deprecation_message(f"config key {old}", new)
    warnings.warn(msg, FutureWarning, stacklevel=2)
    _log.warning(msg)
    return {**data, section_name: {(new_leaf if k == old_leaf else k): v for k, v in section.items()}}


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
