"""Environments for multi-turn rollouts: plain classes with ``reset`` and ``step``, no base class.

One instance per trajectory, built as ``Class(**row["extra_info"].get("env_kwargs", {}))``:

- ``reset(row) -> list[dict] | None``: chat messages to start the conversation from (None keeps
  the row's prompt). ``row`` has prompt (the chat messages), data_source, ground_truth,
  extra_info and uid.
- ``step(assistant_text) -> (observation, reward, done)`` or a :class:`StepResult`: observation
  is a string (sent as a user message), a list of chat messages or None; reward a float or None;
  done a bool. ``reset`` and ``step`` may be ``async def``.

Built-in environments register by name (:func:`register_environment`); ``rollout.environment``
is a registered name or a ``"pkg.mod:Class"`` / ``"path/file.py:Class"`` spec, and a row's
``extra_info["agent_name"]`` picks a registered environment for that row. The tools form is the
built-in environment ``tools`` (:class:`ToolEnvironment`). Environments pickle (their state
travels between the processes that execute steps, see :mod:`hybridflow.agents.remote`), unless the
class declares ``picklable = False``: its instances are then sticky, each kept for its whole
trajectory in the worker process that built it (sockets, subprocesses, live sessions), and
``close()``, when the class has one, is called when the trajectory ends.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.formats import ToolParseError, get_tool_format
from hybridflow.agents.loading import AgentLoadError, is_spec, load_object
from hybridflow.registry import Registry

Messages = list[dict[str, Any]]


@dataclass
class StepResult:
    """What ``step`` returns: observation (str | messages | None), reward (float | None), done, info."""

    observation: str | Messages | None = None
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def _load_builtins() -> None:
    """The other hubs' adapters (textarena, gymnasium, openenv, verifiers) register themselves on first lookup."""
    from hybridflow.agents import hub_openenv, hub_verifiers, hubs  # noqa: F401


ENVIRONMENTS: Registry[Callable[..., Any]] = Registry("environment", builtins=_load_builtins)
register_environment = ENVIRONMENTS.register  # class decorator: selectable by ``name`` (config or ``agent_name``)
environment_names = ENVIRONMENTS.names


def load_environment(spec: str, key: str = "rollout.environment") -> Callable[..., Any]:
    """The environment class for a registered name or a spec; AgentLoadError names ``key``."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS.get(spec)
    if not is_spec(spec):
        raise AgentLoadError(f"{key}={spec!r}: unknown environment; registered: {', '.join(environment_names())}, "
                             "or 'pkg.mod:Class' / 'path/file.py:Class'")  # fmt: skip
    cls = load_object(spec, key)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing or not callable(cls):
        raise AgentLoadError(f"{key}={spec!r}: an environment needs reset(row) and step(text); missing {missing}")
    return cls


_LOOP: list[asyncio.AbstractEventLoop] = []  # this process's loop for async environments (one, kept)


def call_maybe_async(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn``; run the coroutine to completion when it is ``async``, on one event loop kept for
    the process, so that what an async environment opened on it (a client session of a sticky
    instance) is still usable at its next step."""
    out = fn(*args)
    if not inspect.isawaitable(out):
        return out
    if not _LOOP or _LOOP[0].is_closed():
        _LOOP[:] = [asyncio.new_event_loop()]
    return _LOOP[0].run_until_complete(out)


def normalise_step(out: Any) -> StepResult:
    """A ``step`` return value → StepResult; TypeError with a one-line reason when malformed."""
    if isinstance(out, StepResult):
        res = out
    elif isinstance(out, tuple) and len(out) in (3, 4):
        res = StepResult(*out) if len(out) == 3 else StepResult(out[0], out[1], out[2], dict(out[3] or {}))
    else:
        raise TypeError(f"step returned {type(out).__name__}; expected (observation, reward, done) or StepResult")
    if res.observation is not None and not isinstance(res.observation, str | list):
        raise TypeError(f"step's observation is a {type(res.observation).__name__}; expected str, messages or None")
    if res.reward is not None:
        res.reward = float(res.reward)
    res.done = bool(res.done)
    return res


@register_environment("tools")
class ToolEnvironment:
    """The tools form as an environment: each assistant turn's tool calls are run and their
    results come back as ``tool`` messages; a turn without a call ends the trajectory (done).

    tools: the ``rollout.tools`` specs; tool_format: a registered format name; python_timeout_s,
    sandbox_walls, sandbox_disk_mb: the built-in ``python`` tool's limits (``rollout.multi_turn``). Malformed calls, unknown tools and tools that raise give
    an error observation (counted in info: parse_errors, tool_errors; calls per tool in tool_calls); a
    tool whose own time limit cut it short (:class:`~hybridflow.agents.tools.TimedOutOutput`, the
    ``python`` tool's sandbox timeout) counts in info's tool_timeouts.
    Reward is always None (the rule reward scores the final answer).
    """

    def __init__(self, tools: list[str], tool_format: str = "hermes", python_timeout_s: float = 5.0,
                 sandbox_walls: str = "required", sandbox_disk_mb: int = 64) -> None:  # fmt: skip
        self.tool_specs = list(tools)
        self.tool_format = tool_format
        self.python_timeout_s = python_timeout_s
        self.sandbox_walls, self.sandbox_disk_mb = sandbox_walls, sandbox_disk_mb

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, text: str) -> StepResult:
        from hybridflow.agents import tools as tool_mod

        tool_mod.PYTHON_TOOL_TIMEOUT_S = self.python_timeout_s
        tool_mod.PYTHON_TOOL_WALLS, tool_mod.PYTHON_TOOL_DISK_MB = self.sandbox_walls, self.sandbox_disk_mb
        tools = _cached_tools(tuple(self.tool_specs))
        try:
            calls = get_tool_format(self.tool_format).parse(text)
        except ToolParseError as e:
            msg = f"could not parse the tool call: {e}"
            return StepResult([{"role": "tool", "name": "error", "content": msg}], None, False, {"parse_errors": 1})
        if not calls:
            return StepResult(None, None, True, {})
        counts: Counter[str] = Counter()
        errors = timeouts = 0
        messages = []
        for call in calls:
            counts[call.name] += 1
            tool = tools.get(call.name)
            if tool is None:
                errors += 1
                content = f"error: unknown tool {call.name!r}; tools: {', '.join(tools)}"
            else:
                try:
                    raw = tool(**call.arguments)
                    timeouts += isinstance(raw, tool_mod.TimedOutOutput)
                    content = str(raw)
                except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation
                    errors += 1
                    content = f"error: {call.name} raised {type(e).__name__}: {str(e)[:200]}"
            messages.append({"role": "tool", "name": call.name, "content": content})
        return StepResult(messages, None, False, {"tool_calls": dict(counts), "tool_errors": errors,
                                                   "tool_timeouts": timeouts})


_TOOL_CACHE: dict[tuple[str, ...], dict[str, Callable[..., Any]]] = {}


def _cached_tools(specs: tuple[str, ...]) -> dict[str, Any]:
    if specs not in _TOOL_CACHE:
        from hybridflow.agents.tools import load_tool_function

        fns = [load_tool_function(spec, f"rollout.tools[{i}]") for i, spec in enumerate(specs)]
        _TOOL_CACHE[specs] = {fn.__name__: fn for fn in fns}
    return _TOOL_CACHE[specs]


__all__ = [
    "StepResult", "ToolEnvironment", "register_environment", "environment_names", "load_environment",
    "normalise_step", "call_maybe_async",
]  # fmt: skip
