"""The ``tools`` role: tool calls and environment steps of multi-turn rollouts in a pool of their own.

By default the multi-turn loop (``workers/rollout/multi_turn.py``) executes each round's
``reset`` / ``step`` calls in a crash-proof process pool inside the rollout worker
(:class:`hybridflow.agents.remote.EnvRunner`). With a pool holding the ``tools`` role::

    placement:
      pools:
        main:  {workers: 1, cpus_per_worker: 2, roles: [policy, reference]}
        tools: {workers: 2, cpus_per_worker: 1, roles: [tools]}

the rollout worker sends them to that pool instead (:class:`PoolEnvRunner`), so sandboxes can
scale out on CPU nodes while the GPUs generate. Each rank of the tools pool is a
:class:`ToolsWorker`: the same EnvRunner (``rollout.multi_turn.num_workers`` processes,
``tool_timeout_s`` per call), so a tool or environment that raises, hangs or kills its process
still comes back as an error / timeout / crash outcome and the rollout goes on. A round's calls
are split across the ranks in contiguous parts (dispatch protocol ``list_scatter``) and joined
back in order. An environment instance travels between calls as a pickle, so the steps of one
trajectory may run on different ranks.
"""

from __future__ import annotations

from typing import Any

from hybridflow.agents.remote import EnvRunner, Outcome
from hybridflow.config import ExperimentConfig
from workers.dispatch import dispatch

TOOLS_ROLE = "tools"
_run_namespace: str | None = None  # the Ray namespace of this process's pool (set by WorkerHost)


def set_run_namespace(namespace: str | None) -> None:
    """Record the run's Ray namespace for :class:`PoolEnvRunner` look-ups in this process. The pool's
    WorkerHost calls it: an actor created in a namespace other than its job's cannot ask Ray for it
    (``get_runtime_context().namespace`` is the job's)."""
    global _run_namespace
    _run_namespace = namespace


class ToolsWorker:
    """One rank of the tools pool: executes environment ``reset`` / ``step`` requests (the tools form
    is the built-in ``tools`` environment) in a crash-proof process pool. Plain class; the pool
    makes it remote. ``rank``, ``world_size`` and ``device`` are the pool's (no model, no device)."""

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        mt = cfg.rollout.multi_turn
        self.rank, self.world_size = rank, world_size
        self.runner = EnvRunner(mt.num_workers, mt.tool_timeout_s, cfg.trainer.plugins)

    @dispatch("list_scatter")
    def run_env_calls(self, requests: list[dict[str, Any]]) -> list[Outcome]:
        """One outcome per request, in order: ``("ok", result dict)`` or ``("error" | "timeout" |
        "crash", message)``. ``requests`` are :class:`MultiTurnRollout`'s reset / step requests (dicts
        with "op", "env", ...; docstring of :func:`hybridflow.agents.remote.agent_call`). Each call
        has ``rollout.multi_turn.tool_timeout_s`` seconds; the process pool starts on first use."""
        return self.runner.run(requests)

    def close(self) -> None:
        """Stop the process pool (called when the pool shuts down)."""
        self.runner.close()


def tools_pool_name(cfg: ExperimentConfig) -> str | None:
    """The pool holding the ``tools`` role, or None (tools run in the rollout worker's process)."""
    return next((name for name, p in cfg.placement.pools.items() if TOOLS_ROLE in p.roles), None)


class PoolEnvRunner:
    """Rollout side: :class:`EnvRunner`'s interface (``run``, ``close``) with the calls executed by the
    tools pool ``pool_name`` of the run's Ray namespace (looked up on first use, so the pools may start
    in any order). ``namespace`` None: the one :func:`set_run_namespace` recorded in this process, else
    the job's. Raises PoolError when the pool
    does not exist or a rank does not answer within ``timeout_s`` (None: no limit)."""

    def __init__(self, pool_name: str, namespace: str | None = None, timeout_s: float | None = None) -> None:
        self.pool_name, self.namespace, self.timeout_s = pool_name, namespace, timeout_s
        self._tools: Any = None

    def _handle(self) -> Any:
        if self._tools is None:
            import ray

            from workers.pool import get_pool

            namespace = self.namespace or _run_namespace or ray.get_runtime_context().namespace
            self._tools = get_pool(self.pool_name, namespace, (TOOLS_ROLE,)).role(TOOLS_ROLE)
        return self._tools

    def run(self, requests: list[dict[str, Any]]) -> list[Outcome]:
        """One outcome per request, in order (the ranks of the tools pool share the requests)."""
        if not requests:
            return []
        return self._handle().run_env_calls(requests, timeout_s=self.timeout_s)

    def close(self) -> None:
        """Nothing to release here: the tools pool's ranks own their processes."""
        self._tools = None


__all__ = ["ToolsWorker", "PoolEnvRunner", "tools_pool_name", "set_run_namespace", "TOOLS_ROLE"]
