"""Checks of the user code a config names: ``rollout.tools`` / ``rollout.environment``.

Not part of :class:`hybridflow.config.ExperimentConfig` validation (which imports no user code,
so a worker or task re-validating the config never re-imports it): :func:`check_user_code` runs
where a config enters: ``hybridflow config show``, ``hybridflow train``'s preflight, ``hybridflow
eval``'s plan, and :func:`flows.run_pools.run_pools` (train / evaluate / node-run flows) before
Ray starts. Every problem is one line naming the key.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridflow.agents.environments import load_environment
from hybridflow.agents.loading import AgentLoadError
from hybridflow.config import ConfigError, ExperimentConfig

TOOLS_ENVIRONMENT = "tools"


def environment_spec(rollout_cfg: Any) -> str:
    """The environment a multi-turn rollout uses by default: ``rollout.environment``, else ``tools``."""
    return rollout_cfg.environment if rollout_cfg.environment is not None else TOOLS_ENVIRONMENT


def check_rollout_agents(rollout_cfg: Any, plugins: list[str] | tuple[str, ...] = ()) -> None:
    """Raise ValueError (one line, naming the key) for a multi-turn config that cannot run:
    imports ``plugins``, then the environment and tools ``rollout_cfg`` names."""
    mt = rollout_cfg.multi_turn  # its limits are config validation's (ExperimentConfig._check_agents)
    for mod in plugins:
        importlib.import_module(mod)
    spec = environment_spec(rollout_cfg)
    try:
        load_environment(spec)
        if spec == TOOLS_ENVIRONMENT:
            from hybridflow.agents.tools import load_tools

            if not rollout_cfg.tools:
                raise AgentLoadError("rollout.environment='tools' needs rollout.tools (none listed)")
            tools = load_tools(rollout_cfg.tools)
            if mt.tool_format == "python" and "python" not in tools:
                raise AgentLoadError("rollout.multi_turn.tool_format='python' runs code blocks with the 'python' "
                                     "tool: add 'python' to rollout.tools")  # fmt: skip
            if "python" in tools:
                from hybridflow.agents.tools import python_tool_walls_problem

                if (problem := python_tool_walls_problem(mt.sandbox_walls)) is not None:
                    raise AgentLoadError(f"rollout.tools: {problem}")
        elif rollout_cfg.tools:
            raise AgentLoadError(
                f"rollout.tools is set but rollout.environment={spec!r} does not use it "
                "(tools run in the built-in 'tools' environment: leave rollout.environment unset)"
            )
    except AgentLoadError as e:
        raise ValueError(str(e)) from None


def check_user_code(cfg: ExperimentConfig) -> None:
    """Import and check the tools / environment of a multi-turn config (``trainer.plugins`` first).

    Nothing to do for a single-turn config. Raises ConfigError, one line ``config error: ...``
    naming the key (the line config validation gave before the check left it); an ImportError of
    a plugin module is reported the same way.
    """
    if not cfg.rollout.is_multi_turn:
        return
    try:
        check_rollout_agents(cfg.rollout, cfg.trainer.plugins)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"config error: {err}") from None


__all__ = ["TOOLS_ENVIRONMENT", "environment_spec", "check_rollout_agents", "check_user_code"]
