"""Environment ``reset`` / ``step`` calls as a call kind of the crash-proof process pool.

:class:`EnvRunner` sends each :class:`EnvCall` to a :class:`hybridflow.procpool.ProcessPool` of
environment workers (``python -m hybridflow.agents._worker``), so a call that raises, hangs past
``timeout_s`` (its process group is SIGKILLed) or kills its process (``os._exit``, segfault,
OOM) comes back as an :class:`EnvOutcome` with status ``error`` / ``timeout`` / ``crash``, and the
pool replaces the worker. An environment instance lives between calls as a pickle: every call
returns the pickled instance (:attr:`EnvResult.state`), and the next ``step`` of that trajectory
unpickles it (in whichever worker runs it). The pickles are made by our own worker processes from
the user's environment class; model-written code never runs in them (the ``python`` tool runs in
the sandbox), and the parent never unpickles them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.agents.caps import cap_output, capped_prints
from hybridflow.agents.environments import Messages, call_maybe_async, load_environment, normalise_step
from hybridflow.agents.loading import AgentLoadError
from hybridflow.procpool import CallKind, ProcessPool, Unit, WorkerStartError

ENV_CALLS = CallKind("environment", "hybridflow.agents._worker", "its plugins", AgentLoadError, WorkerStartError)
_PRELOAD = ("hybridflow.agents.tools", "hybridflow.rewards.sandbox")  # imported by each worker, off the call clock


@dataclass(frozen=True)
class EnvCall:
    """One call on an environment (the environment call kind's request).

    op "reset": build ``env`` (a registered name or a spec) with ``kwargs`` and call ``reset(row)``
    (row: prompt, data_source, ground_truth, extra_info, uid). op "step": unpickle ``state`` (a
    previous call's :attr:`EnvResult.state`) and call ``step(text)`` with the assistant's text.
    max_output_bytes: every string the call returns (observation, message contents) is cut to
    this many bytes in the worker (:mod:`hybridflow.agents.caps`); 0 = no cap.
    """

    op: Literal["reset", "step"]
    env: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    state: bytes | None = None
    text: str = ""
    max_output_bytes: int = 0

    @classmethod
    def reset(cls, env: str, kwargs: dict[str, Any], row: dict[str, Any], max_output_bytes: int = 0) -> EnvCall:
        return cls("reset", env, kwargs=kwargs, row=row, max_output_bytes=max_output_bytes)

    @classmethod
    def step(cls, env: str, state: bytes, text: str, max_output_bytes: int = 0) -> EnvCall:
        return cls("step", env, state=state, text=text, max_output_bytes=max_output_bytes)


@dataclass(frozen=True)
class EnvResult:
    """What a call returned (the environment call kind's response). state: the environment instance
    after the call, pickled by the worker. reset: ``messages`` (the conversation to start from; None
    keeps the row's prompt). step: observation (str | messages | None), reward (float | None), done,
    info (counters such as tool_calls, tool_errors, parse_errors). truncated: how many of the
    returned strings were cut to the call's ``max_output_bytes``."""

    state: bytes
    messages: Messages | None = None
    observation: str | Messages | None = None
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    truncated: int = 0


@dataclass(frozen=True)
class EnvOutcome:
    """One call's outcome: status "ok" with its ``result``, or "error" (the environment raised or
    returned something malformed), "timeout" (past ``timeout_s``; its worker killed) or "crash" (its
    process died) with a one-line ``message``."""

    status: Literal["ok", "error", "timeout", "crash"]
    result: EnvResult | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def env_call(call: EnvCall) -> EnvResult:
    """Worker side: run ``call`` (see :class:`EnvCall`); raises what the environment raises, and
    TypeError for a malformed reset / step return value. Outputs are cut to ``call.max_output_bytes``
    here, before they are pickled back, and so are its prints to the worker's log."""
    if call.max_output_bytes <= 0:
        return _env_call(call)
    with capped_prints(call.max_output_bytes):
        return _env_call(call)


def _env_call(call: EnvCall) -> EnvResult:
    cls = load_environment(call.env)
    budget = call.max_output_bytes
    if call.op == "reset":
        env = cls(**call.kwargs)
        messages = call_maybe_async(env.reset, call.row)
        if messages is not None and not isinstance(messages, list):
            raise TypeError(f"reset returned {type(messages).__name__}; expected a list of chat messages or None")
        messages, cut = cap_output(messages, budget) if budget > 0 else (messages, 0)
        return EnvResult(pickle.dumps(env), messages=messages, truncated=cut)
    assert call.state is not None, "a step call carries the state its reset returned"
    env = pickle.loads(call.state)  # noqa: S301 - made by our own worker (module docstring)
    step = normalise_step(call_maybe_async(env.step, call.text))
    observation, cut = cap_output(step.observation, budget) if budget > 0 else (step.observation, 0)
    return EnvResult(pickle.dumps(env), observation=observation, reward=step.reward, done=step.done,
                     info=dict(step.info), truncated=cut)  # fmt: skip


class EnvRunner:
    """Parent side: a process pool executing environment calls. ``num_workers`` processes,
    ``timeout_s`` per call, ``plugins`` imported in each worker first. Started on first use;
    raises AgentLoadError when a worker cannot import its plugins."""

    def __init__(self, num_workers: int, timeout_s: float, plugins: list[str] | tuple[str, ...] = ()) -> None:
        self.num_workers, self.timeout_s, self.plugins = num_workers, timeout_s, list(plugins)
        self._pool: ProcessPool | None = None

    @property
    def restarts(self) -> int:
        """Workers replaced after a timeout or crash since start."""
        return self._pool.restarts if self._pool else 0

    def _start(self) -> ProcessPool:
        if self._pool is None:
            pool = ProcessPool(ENV_CALLS, None, [*_PRELOAD, *self.plugins], self.num_workers)
            try:
                pool.wait_ready()
            except BaseException:
                pool.close()
                raise
            self._pool = pool
        return self._pool

    def run(self, calls: list[EnvCall]) -> list[EnvOutcome]:
        """One outcome per call, in order (calls run concurrently on the workers)."""
        if not calls:
            return []
        pool = self._start()
        outcomes: dict[int, Any] = {}
        # waves of one call per worker: ``timeout_s`` is then each call's own limit whether the pool
        # times rows one by one or a whole run() at once
        for start in range(0, len(calls), self.num_workers):
            wave = range(start, min(start + self.num_workers, len(calls)))
            outcomes.update(pool.run([Unit("rows", [(i, calls[i])]) for i in wave], self.timeout_s))
        out: list[EnvOutcome] = []
        for i in range(len(calls)):
            status, value = outcomes[i]
            out.append(EnvOutcome("ok", result=value) if status == "ok" else EnvOutcome(status, message=value))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


__all__ = ["ENV_CALLS", "EnvCall", "EnvOutcome", "EnvResult", "EnvRunner", "env_call"]
