"""Typed experiment config: pydantic v2 models, frozen, ``extra="forbid"``.

One YAML file plus dotted overrides (``actor.lr=2e-6``) resolve to one
:class:`ExperimentConfig`. Invalid values fail here, before any model or heavy
library is loaded, with :class:`ConfigError` — one readable line per problem that
names the key path, the bad value and what is allowed.

This package imports only pydantic and yaml (no torch), so ``hybridflow config show``
and config validation are fast. One module per section (``model``, ``data``, ``rollout``,
``algorithm``, ``actor``, ``critic`` + ``reference``, ``reward``, ``placement``, ``trainer``,
``tracking``), the whole in :mod:`~hybridflow.config.experiment`, the shared base in
:mod:`~hybridflow.config.base`, loading and overrides in :mod:`~hybridflow.config.loading`.
Every name is re-exported here: import from ``hybridflow.config``.
"""

from hybridflow.config.actor import ActorConfig
from hybridflow.config.algorithm import AlgorithmConfig, KLControlConfig, OverlongBufferConfig
from hybridflow.config.base import (
    BUILTIN_ADV_ESTIMATORS,
    BUILTIN_POLICY_LOSSES,
    ESTIMATORS_NEEDING_VALUES,
    RENAMED_KEYS,
    ConfigError,
    KLEstimatorName,
    LossAggMode,
    Role,
)
from hybridflow.config.critic import CriticConfig, ReferenceConfig
from hybridflow.config.data import DataConfig
from hybridflow.config.experiment import ExperimentConfig
from hybridflow.config.loading import (
    _deep_merge,  # noqa: F401 - flows/train.py merges overrides onto a saved config with it
    config_from_dict,
    dump_config,
    flatten_config,
    load_config,
    parse_overrides,
)
from hybridflow.config.model import ModelConfig
from hybridflow.config.placement import PlacementConfig, PoolConfig
from hybridflow.config.reward import JudgeConfig, RewardConfig, RewardModelConfig
from hybridflow.config.rollout import MultiTurnConfig, RolloutConfig, ToolFormatName
from hybridflow.config.tracking import TrackingConfig
from hybridflow.config.trainer import TrainerConfig

__all__ = [
    "ConfigError",
    "ExperimentConfig",
    "load_config",
    "config_from_dict",
    "parse_overrides",
    "flatten_config",
    "dump_config",
    "BUILTIN_ADV_ESTIMATORS",
    "BUILTIN_POLICY_LOSSES",
    "ESTIMATORS_NEEDING_VALUES",
    "RENAMED_KEYS",
    "LossAggMode",
    "KLEstimatorName",
    "Role",
    "ToolFormatName",
    "ModelConfig",
    "DataConfig",
    "MultiTurnConfig",
    "RolloutConfig",
    "KLControlConfig",
    "OverlongBufferConfig",
    "AlgorithmConfig",
    "ActorConfig",
    "CriticConfig",
    "ReferenceConfig",
    "RewardModelConfig",
    "JudgeConfig",
    "RewardConfig",
    "PoolConfig",
    "PlacementConfig",
    "TrainerConfig",
    "TrackingConfig",
]
