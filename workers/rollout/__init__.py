"""Rollout engines behind one protocol (hf, vllm). See docs/engines.md.

``get_rollout_engine(name)`` imports the built-in engines on first use; vLLM itself is only
imported when a vLLM engine is built.
"""

from workers.rollout.base import (
    DEFAULT_CAPABILITIES,
    EngineCapabilities,
    FinishReason,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    engine_capabilities,
    get_rollout_engine,
    register_rollout_engine,
    rollout_engine_names,
    sampling_params_from_config,
)

__all__ = [
    "DEFAULT_CAPABILITIES",
    "EngineCapabilities",
    "FinishReason",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "engine_capabilities",
    "get_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_names",
    "sampling_params_from_config",
]
