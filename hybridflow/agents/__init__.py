"""Multi-turn agents: tools, tool-call formats, environments (pure library; see docs/agents.md).

The rollout loop that drives them lives in ``workers/rollout/multi_turn.py``.
"""

from hybridflow.agents.environments import (
    StepResult,
    ToolEnvironment,
    environment_names,
    load_environment,
    normalise_step,
    register_environment,
)
from hybridflow.agents.formats import (
    ToolCall,
    ToolParseError,
    get_tool_format,
    register_tool_format,
    tool_format_names,
)
from hybridflow.agents.loading import AgentLoadError
from hybridflow.agents.tools import Tool, load_tool, load_tools

__all__ = [
    "AgentLoadError", "StepResult", "Tool", "ToolCall", "ToolEnvironment", "ToolParseError", "environment_names",
    "get_tool_format", "load_environment", "load_tool", "load_tools", "normalise_step", "register_environment",
    "register_tool_format", "tool_format_names",
]  # fmt: skip
