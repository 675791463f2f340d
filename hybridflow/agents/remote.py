"""Run environment ``reset`` / ``step`` calls in the crash-proof reward process pool.

:class:`EnvRunner` sends each call as one row to :class:`hybridflow.rewards.procpool.ProcessPool`
(the pool loads :func:`agent_call` as its verl-signature "reward" function), so a call that
raises, hangs past ``timeout_s`` (its process group is SIGKILLed) or kills its process
(``os._exit``, segfault, OOM) comes back as an ``error`` / ``timeout`` / ``crash`` outcome and the
pool replaces the worker. An environment instance lives between calls as a pickle: every call
returns the pickled instance, and the next ``step`` of that trajectory unpickles it (in whichever
worker runs it). The pickles are made by our own worker processes from the user's environment
class; model-written code never runs in them (the ``python`` tool runs in the sandbox).
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
from typing import Any

from hybridflow.agents.environments import call_maybe_async, load_environment, normalise_step

Outcome = tuple[str, Any]  # ("ok", result dict) | ("error" | "timeout" | "crash", message)
AGENT_CALL_SPEC = "hybridflow.agents.remote:agent_call"


def _dump(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def _load(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))  # noqa: S301 - produced by our own worker (module docstring)


def agent_call(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, Any]:
    """Worker side. ``extra_info`` is the request: {"op": "reset" | "step", "env": spec,
    "kwargs": constructor kwargs, "row": row dict (reset), "state": pickled env (step),
    "text": assistant text (step)}. Returns {"score": 0, "result": pickled result dict}."""
    req = extra_info
    cls = load_environment(req["env"])
    if req["op"] == "reset":
        env = cls(**req["kwargs"])
        messages = call_maybe_async(env.reset, req["row"])
        if messages is not None and not isinstance(messages, list):
            raise TypeError(f"reset returned {type(messages).__name__}; expected a list of chat messages or None")
        result: dict[str, Any] = {"messages": messages}
    else:
        env = _load(req["state"])
        result = dataclasses.asdict(normalise_step(call_maybe_async(env.step, req["text"])))
    result["state"] = _dump(env)
    return {"score": 0.0, "result": _dump(result)}


class EnvRunner:
    """Parent side: a process pool executing environment calls. ``num_workers`` processes,
    ``timeout_s`` per call, ``plugins`` imported in each worker first. Started on first use."""

    def __init__(self, num_workers: int, timeout_s: float, plugins: list[str] | tuple[str, ...] = ()) -> None:
        self.num_workers, self.timeout_s, self.plugins = num_workers, timeout_s, list(plugins)
        self._pool: Any = None

    def _start(self) -> Any:
        if self._pool is None:
            from hybridflow.config import RewardConfig
            from hybridflow.rewards.procpool import ProcessPool

            preload = ["hybridflow.agents.tools", "hybridflow.rewards.sandbox", *self.plugins]  # off the call clock
            pool = ProcessPool(AGENT_CALL_SPEC, RewardConfig().model_dump(), preload, self.num_workers)
            try:
                pool.wait_ready()
            except BaseException:
                pool.close()
                raise
            self._pool = pool
        return self._pool

    def run(self, requests: list[dict[str, Any]]) -> list[Outcome]:
        """One outcome per request, in order (requests run concurrently on the workers)."""
        if not requests:
            return []
        from hybridflow.rewards.procpool import Unit

        pool = self._start()
        outcomes: dict[int, Any] = {}
        # waves of one call per worker: ``timeout_s`` is then each call's own limit whether the pool
        # times rows one by one or a whole run() at once
        for start in range(0, len(requests), self.num_workers):
            wave = range(start, min(start + self.num_workers, len(requests)))
            outcomes.update(pool.run([Unit("rows", [(i, ("agent", "", None, requests[i], ""))]) for i in wave],
                                     self.timeout_s))  # fmt: skip
        out: list[Outcome] = []
        for i in range(len(requests)):
            status, value = outcomes[i]
            out.append(("ok", _load(value["extra"]["result"])) if status == "ok" else (status, value))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


__all__ = ["EnvRunner", "agent_call", "AGENT_CALL_SPEC"]
