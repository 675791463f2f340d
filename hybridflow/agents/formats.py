"""Tool-call formats: how a model's turn text becomes tool calls. A registry by name.

- ``hermes`` (Qwen / Hermes function calling): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn.
- ``python`` (ToRL, Li et al. 2025; ReTool, Feng et al. 2025): every fenced ```` ```python ```` block
  is a call of the ``python`` tool with ``{"code": <block>}``; it needs no tool schema in the prompt,
  so it works with models never trained on function calling.

A format's ``parse(text)`` returns the calls in order ([] = the turn made no call) or raises
:class:`ToolParseError` with a short reason; the rollout turns that into the observation
"could not parse the tool call: <reason>" and counts it in ``tool/parse_errors``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


class ToolParseError(ValueError):
    """The turn tried to call a tool but the call is malformed."""


class ToolFormat(Protocol):
    def parse(self, text: str) -> list[ToolCall]: ...

    def system_prompt(self, schemas: list[dict[str, Any]]) -> str:
        """Instructions naming the tools, for chat templates that take no ``tools=`` ("" = none)."""
        ...


TOOL_FORMATS: Registry[Callable[[], ToolFormat]] = Registry("tool format")
register_tool_format = TOOL_FORMATS.register  # class decorator: ``rollout.multi_turn.tool_format=name``
tool_format_names = TOOL_FORMATS.names


def get_tool_format(name: str) -> ToolFormat:
    """An instance of the format registered as ``name``; UnknownNameError (a KeyError) lists the known ones."""
    return TOOL_FORMATS.get(name)()


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_tool_format("hermes")
class HermesFormat:
    def parse(self, text: str) -> list[ToolCall]:
        bodies = _HERMES.findall(text)
        if text.count("<tool_call>") != len(bodies):
            raise ToolParseError("<tool_call> without a closing </tool_call>")
        calls = []
        for body in bodies:
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                raise ToolParseError(f"not valid JSON ({e.msg} at char {e.pos})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ToolParseError('expected {"name": "<tool>", "arguments": {...}}')
            args = obj.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    raise ToolParseError("arguments is a string that is not JSON") from None
            if not isinstance(args, dict):
                raise ToolParseError(f"arguments must be an object, got {type(args).__name__}")
            calls.append(ToolCall(obj["name"], args))
        return calls

    def system_prompt(self, schemas: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(s) for s in schemas)
        return (
            "You may call functions. Their signatures:\n<tools>\n" + listed + "\n</tools>\n"
            "To call one, write <tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}</tool_call>. "
            "Its result comes back in the next message."
        )


_PY_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


@register_tool_format("python")
class PythonBlockFormat:
    def parse(self, text: str) -> list[ToolCall]:
        blocks = _PY_BLOCK.findall(text)
        if text.count("```python") != len(blocks):
            raise ToolParseError("a ```python block is not closed with ```")
        return [ToolCall("python", {"code": b}) for b in blocks]

    def system_prompt(self, schemas: list[dict[str, Any]]) -> str:
        return ""  # the task's own prompt shows the fenced-block convention


__all__ = ["ToolCall", "ToolParseError", "ToolFormat", "register_tool_format", "get_tool_format", "tool_format_names"]
