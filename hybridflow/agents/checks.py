"""Config-time checks of ``rollout.tools`` / ``rollout.environment`` / ``rollout.multi_turn``.

Called by :class:`hybridflow.config.ExperimentConfig` validation, before any model loads; every
problem is one ValueError line naming the key (the config loader turns it into a ConfigError).
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridflow.agents.environments import load_environment
from hybridflow.agents.loading import AgentLoadError

TOOLS_ENVIRONMENT = "tools"


def environment_spec(rollout_cfg: Any) -> str:
    """The environment a multi-turn rollout uses by default: ``rollout.environment``, else ``tools``."""
    return rollout_cfg.environment if rollout_cfg.environment is not None else TOOLS_ENVIRONMENT


def check_rollout_agents(rollout_cfg: Any, plugins: list[str] | tuple[str, ...] = ()) -> None:
    """Raise ValueError (one line, naming the key) for a multi-turn config that cannot run."""
    mt = rollout_cfg.multi_turn
    if mt.max_tokens_per_turn is not None and mt.max_tokens_per_turn > rollout_cfg.max_response_tokens:
        raise ValueError(
            f"rollout.multi_turn.max_tokens_per_turn={mt.max_tokens_per_turn} is larger than "
            f"rollout.max_response_tokens={rollout_cfg.max_response_tokens} (the whole trajectory's budget)"
        )
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
        elif rollout_cfg.tools:
            raise AgentLoadError(
                f"rollout.tools is set but rollout.environment={spec!r} does not use it "
                "(tools run in the built-in 'tools' environment: leave rollout.environment unset)"
            )
    except AgentLoadError as e:
        raise ValueError(str(e)) from None
