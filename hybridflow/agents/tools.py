"""Tools: typed Python functions with docstrings (TRL's form), and the built-in ones.

A tool is named in ``rollout.tools`` as ``"pkg.mod:fn"``, ``"path/file.py:fn"`` or a built-in name
(``calculator``, ``python``). Its JSON schema (OpenAI function format) comes from its type hints
and Google-style docstring through ``transformers.utils.get_json_schema``; a function without
them fails when the config is loaded. Tools return a string (anything else is ``str()``-ed).
"""

from __future__ import annotations

import ast
import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.agents.loading import AgentLoadError, is_spec, load_object

#: Seconds the built-in ``python`` tool lets code run (set by the tools environment from
#: ``rollout.multi_turn.tool_timeout_s``, minus a margin for start-up).
PYTHON_TOOL_TIMEOUT_S = 5.0
PYTHON_TOOL_MEMORY_MB = 512
#: The ``python`` tool's walls and disk quota (set by the tools environment from
#: ``rollout.multi_turn.sandbox_walls`` / ``sandbox_disk_mb``).
PYTHON_TOOL_WALLS = "required"
PYTHON_TOOL_DISK_MB = 64
_warned_no_walls = False


class TimedOutOutput(str):
    """A tool's output cut short by the tool's own time limit (the built-in ``python`` tool's sandbox
    timeout): the text is what the model sees; the tools environment counts it in ``tool/timeouts``
    as it counts a call that outlived ``rollout.multi_turn.tool_timeout_s``. A user tool may return one."""


class SandboxWallsError(RuntimeError):
    """The machine gives the ``python`` tool's sandbox no walls and ``sandbox_walls`` is 'required'."""


def python_tool_walls_problem(walls: str) -> str | None:
    """One line when the ``python`` tool may not run here with ``walls`` ('required' | 'optional'):
    the machine gives no private mount namespace and walls are required; else None."""
    from hybridflow.rewards.sandbox import walls_check

    check = walls_check()
    if check.available or walls == "optional":
        return None
    return (f"the 'python' tool's sandbox needs {check.missing}; give the machine mount namespaces or set "
            "rollout.multi_turn.sandbox_walls=optional to run it without walls (its writes then reach the host)")  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "123 * 45".
    """
    return _format_number(_eval_arith(ast.parse(expression, mode="eval").body))


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints (stdout, then stderr).

    Args:
        code: The Python program to run.
    """
    global _warned_no_walls
    from hybridflow.rewards.sandbox import run_code, walls_check

    if (problem := python_tool_walls_problem(PYTHON_TOOL_WALLS)) is not None:
        raise SandboxWallsError(problem)
    if not walls_check().available and not _warned_no_walls:
        _warned_no_walls = True
        logging.getLogger(__name__).warning("the 'python' tool runs WITHOUT walls (sandbox_walls=optional): %s "
                                            "is missing; its writes to /tmp, /var/tmp, /dev/shm reach the host",
                                            walls_check().missing)  # fmt: skip
    res = run_code(code, timeout_s=PYTHON_TOOL_TIMEOUT_S, memory_mb=PYTHON_TOOL_MEMORY_MB, max_output_bytes=1 << 16,
                   disk_mb=PYTHON_TOOL_DISK_MB)  # fmt: skip
    out = res.stdout + (res.stderr if res.stderr else "")
    if res.timed_out:
        return TimedOutOutput(out + f"\n[timed out after {PYTHON_TOOL_TIMEOUT_S:g} s]")
    return out if out.strip() else "[no output]"


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip


def _eval_arith(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval_arith(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_arith(node.left), _eval_arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def _format_number(v: float | int) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return str(v)


@dataclass(frozen=True)
class Tool:
    """name: what the model calls it; fn: the function; schema: OpenAI function schema
    ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


def load_tool_function(spec: str, key: str = "rollout.tools") -> Callable[..., Any]:
    """The function of a built-in name or a spec, without building its schema (what the processes
    executing tools need; the schema was checked when the config loaded). AgentLoadError as load_tool."""
    if spec in BUILTIN_TOOLS:
        fn = BUILTIN_TOOLS[spec]
    elif is_spec(spec):
        fn = load_object(spec, key)
    else:
        raise AgentLoadError(f"{key}={spec!r}: unknown tool; built-in: {', '.join(sorted(BUILTIN_TOOLS))}, "
                             "or 'pkg.mod:fn' / 'path/file.py:fn'")  # fmt: skip
    if not callable(fn):
        raise AgentLoadError(f"{key}={spec!r}: a {type(fn).__name__}, not a function")
    return fn


def load_tool(spec: str, key: str = "rollout.tools") -> Tool:
    """A built-in name or a spec → Tool. Raises AgentLoadError (one line naming ``key``) for an
    unknown name, an import failure, something not callable, or a missing docstring / type hint."""
    fn = load_tool_function(spec, key)
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AgentLoadError(f"{key}={spec!r}: needs type hints and a docstring with Args: ({msg})") from None
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(specs: list[str], key: str = "rollout.tools") -> dict[str, Tool]:
    """Tools by name, in order; a duplicate name raises AgentLoadError."""
    out: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        tool = load_tool(spec, f"{key}[{i}]")
        if tool.name in out:
            raise AgentLoadError(f"{key}[{i}]={spec!r}: a tool named {tool.name!r} is already listed")
        out[tool.name] = tool
    return out


__all__ = ["SandboxWallsError", "python_tool_walls_problem", "Tool", "load_tool", "load_tool_function", "load_tools", "calculator", "python", "BUILTIN_TOOLS"]
