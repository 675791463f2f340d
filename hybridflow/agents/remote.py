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

**Sticky instances.** An environment class that declares ``picklable = False`` (it holds a socket,
a subprocess, a live session) is never pickled: its instance stays in the worker process that ran
its ``reset``, in that process's table of live instances under the trajectory's ``key``, and every
call of that trajectory is pinned to that worker (:attr:`EnvCall.key` → :meth:`EnvRunner.worker_of`).
The instance is dropped (its ``close()`` called, if it has one) when a step returns done or the
parent sends ``close`` (a trajectory ended by the rollout: max_turns, length). A worker replaced
after a timeout or a crash takes its live instances with it: the next step of each of those
trajectories is an ``error`` outcome saying so, and the trajectory ends as an environment error.
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
    previous call's :attr:`EnvResult.state`), or take the sticky instance ``key`` when ``state`` is
    empty, and call ``step(text)`` with the assistant's text. op "close": drop the sticky instance
    ``key``. key: the trajectory's id (an int unique in the run), pinning the call to one worker; a
    reset carries it so that a sticky instance can be kept under it. max_output_bytes: every string
    the call returns (observation, message contents) is cut to this many bytes in the worker
    (:mod:`hybridflow.agents.caps`); 0 = no cap.
    """

    op: Literal["reset", "step", "close"]
    env: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    state: bytes | None = None
    text: str = ""
    max_output_bytes: int = 0
    key: int | None = None

    @classmethod
    def reset(cls, env: str, kwargs: dict[str, Any], row: dict[str, Any], max_output_bytes: int = 0,
              key: int | None = None) -> EnvCall:
        return cls("reset", env, kwargs=kwargs, row=row, max_output_bytes=max_output_bytes, key=key)

    @classmethod
    def step(cls, env: str, state: bytes, text: str, max_output_bytes: int = 0, key: int | None = None) -> EnvCall:
        return cls("step", env, state=state, text=text, max_output_bytes=max_output_bytes, key=key)

    @classmethod
    def close(cls, env: str, key: int) -> EnvCall:
        return cls("close", env, key=key)


@dataclass(frozen=True)
class EnvResult:
    """What a call returned (the environment call kind's response). state: the environment instance
    after the call, pickled by the worker (empty for a sticky instance, which stays in the worker:
    ``sticky`` True). reset: ``messages`` (the conversation to start from; None keeps the row's
    prompt). step: observation (str | messages | None), reward (float | None), done, info (counters
    such as tool_calls, tool_errors, parse_errors). truncated: how many of the returned strings were
    cut to the call's ``max_output_bytes``."""

    state: bytes
    messages: Messages | None = None
    observation: str | Messages | None = None
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    truncated: int = 0
    sticky: bool = False


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


#: sticky environment instances of this worker process, by trajectory key (module docstring)
_LIVE: dict[int, Any] = {}


def is_picklable_environment(env: Any) -> bool:
    """False when an environment class declares ``picklable = False``, or an instance sets it (an
    adapter whose instances hold a connection only for some kwargs): its instances are sticky."""
    return bool(getattr(env, "picklable", True))


def _pickled(env: Any, spec: str) -> bytes:
    try:
        return pickle.dumps(env)
    except Exception as e:  # noqa: BLE001 - pickling raises TypeError, AttributeError, PicklingError...
        raise TypeError(f"environment {spec!r} cannot be pickled ({type(e).__name__}: {e}); declare "
                        "picklable = False on its class to keep each instance in one worker process "
                        "(docs/environments.md, sticky environments)") from None


def _drop(key: int | None) -> None:
    env = _LIVE.pop(key, None) if key is not None else None
    if env is not None and callable(getattr(env, "close", None)):
        call_maybe_async(env.close)


def _env_call(call: EnvCall) -> EnvResult:
    if call.op == "close":
        _drop(call.key)
        return EnvResult(b"", sticky=True)
    cls = load_environment(call.env)
    budget = call.max_output_bytes
    if call.op == "reset":
        env = cls(**call.kwargs)
        sticky = not is_picklable_environment(env)  # the class's declaration, or its instance's
        if sticky and call.key is None:
            raise ValueError(f"environment {call.env!r} is sticky (picklable = False) and the reset carries no key")
        messages = call_maybe_async(env.reset, call.row)
        if messages is not None and not isinstance(messages, list):
            raise TypeError(f"reset returned {type(messages).__name__}; expected a list of chat messages or None")
        messages, cut = cap_output(messages, budget) if budget > 0 else (messages, 0)
        if sticky:
            _drop(call.key)  # a reset under a key still live (a retried rollout) replaces it
            _LIVE[call.key] = env
            return EnvResult(b"", messages=messages, truncated=cut, sticky=True)
        return EnvResult(_pickled(env, call.env), messages=messages, truncated=cut)
    sticky = not call.state
    if not sticky:
        env = pickle.loads(call.state)  # noqa: S301 - made by our own worker (module docstring)
    elif call.key in _LIVE:
        env = _LIVE[call.key]
    else:
        raise LookupError(f"the {call.env!r} instance of this trajectory is gone: the worker process that held it "
                          "was replaced (after a timeout or crash of a call it ran) or the trajectory was closed")
    step = normalise_step(call_maybe_async(env.step, call.text))
    observation, cut = cap_output(step.observation, budget) if budget > 0 else (step.observation, 0)
    if sticky:
        if step.done:
            _drop(call.key)
        state = b""
    else:
        state = _pickled(env, call.env)
    return EnvResult(state, observation=observation, reward=step.reward, done=step.done, info=dict(step.info),
                     truncated=cut, sticky=sticky)


def worker_preload(cfg: Any) -> list[str]:
    """Modules every environment worker imports at start, off the call clock: ``trainer.plugins``,
    then the ``preload`` modules that ``rollout.environment``'s class declares (a hub adapter names
    its package: textarena imports nltk and scipy, ~5 s, which would otherwise count against the
    first ``reset``'s ``tool_timeout_s``). Only modules installed here are named: a missing package
    keeps the adapter's own one-line error at ``reset``. Nothing is imported in this process."""
    import importlib.util

    from hybridflow.agents.environments import ENVIRONMENTS

    mods = list(cfg.trainer.plugins)
    name = cfg.rollout.environment
    if name and name in ENVIRONMENTS:
        for mod in getattr(ENVIRONMENTS.get(name), "preload", ()):
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):  # a parent package missing
                found = False
            if found and mod not in mods:
                mods.append(mod)
    return mods


class EnvRunner:
    """Parent side: a process pool executing environment calls. ``num_workers`` processes,
    ``timeout_s`` per call, ``plugins`` imported in each worker first. Started on first use;
    raises AgentLoadError when a worker cannot import its plugins."""

    def __init__(self, num_workers: int, timeout_s: float, plugins: list[str] | tuple[str, ...] = (),
                 key_stride: int = 1) -> None:
        self.num_workers, self.timeout_s, self.plugins = num_workers, timeout_s, list(plugins)
        self.key_stride = key_stride
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

    def worker_of(self, key: int) -> int:
        """The worker a call keyed ``key`` is pinned to: ``(key // key_stride) % num_workers`` (a tools
        pool rank gets the keys ``≡ rank mod world_size``: the stride spreads them over its workers)."""
        return (key // self.key_stride) % self.num_workers

    def run(self, calls: list[EnvCall]) -> list[EnvOutcome]:
        """One outcome per call, in order (calls run concurrently on the workers; a keyed call on the
        worker :meth:`worker_of` its key, any other on a free one)."""
        if not calls:
            return []
        pool = self._start()
        outcomes: dict[int, Any] = {}
        # waves of at most one call per worker: ``timeout_s`` is then each call's own limit whether the
        # pool times rows one by one or a whole run() at once
        for wave in self._waves(calls):
            outcomes.update(pool.run([Unit("rows", [(i, calls[i])], w) for i, w in wave], self.timeout_s))
        out: list[EnvOutcome] = []
        for i in range(len(calls)):
            status, value = outcomes[i]
            out.append(EnvOutcome("ok", result=value) if status == "ok" else EnvOutcome(status, message=value))
        return out

    def _waves(self, calls: list[EnvCall]) -> list[list[tuple[int, int | None]]]:
        """(call index, worker or None) per wave, at most one call per worker a wave: keyed calls on
        their worker first (the pool hands a worker the first unit it may run), then as many unkeyed
        calls as workers are left, on whichever is free."""
        todo, waves = list(range(len(calls))), []
        while todo:
            used: set[int] = set()
            wave: list[tuple[int, int | None]] = []
            free, rest = [], []
            for i in todo:
                key = calls[i].key
                if key is None:
                    free.append(i)
                elif (w := self.worker_of(key)) not in used:
                    used.add(w)
                    wave.append((i, w))
                else:
                    rest.append(i)
            room = self.num_workers - len(used)
            waves.append([*wave, *((i, None) for i in free[:room])])
            todo = sorted(rest + free[room:])
        return waves

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


__all__ = ["ENV_CALLS", "EnvCall", "EnvOutcome", "EnvResult", "EnvRunner", "env_call", "is_picklable_environment",
           "worker_preload"]
