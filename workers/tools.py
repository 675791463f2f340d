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
are split across the ranks (dispatch protocol ``keyed_scatter``) and joined back in order. An
environment instance travels between calls as a pickle, so the steps of one trajectory may run on
different ranks; a sticky instance (``picklable = False``) stays in one worker process of one rank,
which every call of its trajectory is sent to (the call's ``key``). The run's Ray namespace, where :class:`PoolEnvRunner` finds
the tools pool, is handed to the rollout side by its :class:`~workers.host.WorkerHost` (a
constructor argument of the policy / rollout worker), not kept in this module.
"""

from __future__ import annotations

from typing import Any

from hybridflow.agents.remote import EnvCall, EnvOutcome, EnvRunner, worker_preload
from hybridflow.config import ExperimentConfig
from workers.dispatch import dispatch

TOOLS_ROLE = "tools"


class ToolsWorker:
    """One rank of the tools pool: executes environment ``reset`` / ``step`` requests (the tools form
    is the built-in ``tools`` environment) in a crash-proof process pool. Plain class; the pool
    makes it remote. ``rank``, ``world_size`` and ``device`` are the pool's (no model, no device)."""

    def __init__(self, cfg: ExperimentConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        mt = cfg.rollout.multi_turn
        self.rank, self.world_size = rank, world_size
        # a rank gets the keys ≡ rank mod world_size (keyed_scatter); the stride spreads them over its workers
        self.runner = EnvRunner(mt.num_workers, mt.tool_timeout_s, worker_preload(cfg), key_stride=world_size)

    @dispatch("keyed_scatter")
    def run_env_calls(self, calls: list[EnvCall]) -> list[EnvOutcome]:
        """One :class:`EnvOutcome` per call, in order: status "ok" with its ``result``, or "error" |
        "timeout" | "crash" with a one-line ``message``. ``calls`` are :class:`MultiTurnRollout`'s
        reset / step calls. Each call has ``rollout.multi_turn.tool_timeout_s`` seconds; the process
        pool starts on first use."""
        return self.runner.run(calls)

    def close(self) -> None:
        """Stop the process pool (called when the pool shuts down)."""
        self.runner.close()


def tools_pool_name(cfg: ExperimentConfig) -> str | None:
    """The pool holding the ``tools`` role, or None (tools run in the rollout worker's process)."""
    return next((name for name, p in cfg.placement.pools.items() if TOOLS_ROLE in p.roles), None)


class PoolEnvRunner:
    """Rollout side: :class:`EnvRunner`'s interface (``run``, ``close``) with the calls executed by the
    tools pool ``pool_name`` of the Ray namespace ``namespace`` (looked up on first use, so the pools
    may start in any order). ``namespace`` is the run's, which the rollout worker got from its
    WorkerHost: an actor created in a namespace other than its job's cannot ask Ray for it
    (``get_runtime_context().namespace`` is the job's); None (a driver or a test): the job's.
    Raises PoolError when the pool does not exist or a rank does not answer within ``timeout_s``
    (None: no limit)."""

    def __init__(self, pool_name: str, namespace: str | None = None, timeout_s: float | None = None) -> None:
        self.pool_name, self.namespace, self.timeout_s = pool_name, namespace, timeout_s
        self._tools: Any = None

    def _handle(self) -> Any:
        if self._tools is None:
            import ray

            from workers.pool import get_pool

            namespace = self.namespace or ray.get_runtime_context().namespace
            self._tools = get_pool(self.pool_name, namespace, (TOOLS_ROLE,)).role(TOOLS_ROLE)
        return self._tools

    def run(self, calls: list[EnvCall]) -> list[EnvOutcome]:
        """One outcome per call, in order (the ranks of the tools pool share the calls)."""
        if not calls:
            return []
        return self._handle().run_env_calls(calls, timeout_s=self.timeout_s)

    def close(self) -> None:
        """Nothing to release here: the tools pool's ranks own their processes."""
        self._tools = None


__all__ = ["ToolsWorker", "PoolEnvRunner", "tools_pool_name", "TOOLS_ROLE"]
