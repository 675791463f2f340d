"""The process behind one rank of a pool: :class:`WorkerHost` builds the rank's plain workers (one
per role, in :data:`ROLE_ORDER`; roles in one pool share the process: the hybrid engine), joins
the pool's process group when it has several ranks, restores the run's latest checkpoint, records
each start and stop in the run's ``pool_events.jsonl`` and serves role calls by name.

A plain class: :func:`workers.pool.create_pool` makes it a named, restartable Ray actor per rank.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import ray

from hybridflow.config import ExperimentConfig, PoolConfig, config_from_dict
from workers import worker_logs
from workers.handles import role_class
from workers.placement import node_id
from workers.pool_errors import PoolError
from workers.pool_events import append_event, weights_digest
from workers.progress import progress_for_run

# construction order inside one process: the reference may reuse the policy (LoRA: adapters off)
ROLE_ORDER = ("policy", "rollout", "reference", "critic", "reward", "tools", "judge", "evaluator")
# roles whose workers run multi-turn rollouts: they get the run's namespace to find the tools pool in
NAMESPACED_ROLES = ("policy", "rollout")


def resolve_device(cfg: ExperimentConfig, pool_cfg: PoolConfig) -> str:
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if pool_cfg.gpus_per_worker > 0 else "cpu"


class WorkerHost(worker_logs.LoggedCalls):
    """The process behind one rank of a pool. Plain class; :func:`workers.pool.create_pool` makes it remote.
    Workers report progress (:mod:`workers.progress`); ``call_logged``: :mod:`workers.worker_logs`."""

    def __init__(
        self,
        cfg_dict: dict,
        pool_name: str,
        rank: int,
        world_size: int,
        ckpt_root: str | None,
        torch_threads: int | None = None,
        namespace: str | None = None,
    ):
        self.cfg = config_from_dict(cfg_dict)
        self.namespace = namespace  # the run's Ray namespace (the actor cannot ask Ray for it)
        self.pool_name = pool_name
        self.pool_cfg = self.cfg.placement.pools[pool_name]
        self.rank, self.world_size = rank, world_size
        self.ckpt_root = ckpt_root
        self.device = resolve_device(self.cfg, self.pool_cfg)
        self.workers: dict[str, Any] = {}
        self.restored_from: str | None = None
        worker_logs.install()
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        for mod in self.cfg.trainer.plugins:
            importlib.import_module(mod)
        # no process group (one rank, or the tools role): ready at once, so a Ray restart restores by itself
        if world_size == 1 or self.pool_cfg.roles == ["tools"]:
            self.setup()

    # ---- distributed set-up (multi-rank pools) ----
    def free_address(self) -> tuple[str, int]:
        from workers import distributed as D

        return D.rendezvous_address(ray.util.get_node_ip_address())

    def init_distributed(self, addr: str, port: int) -> None:
        import torch
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        if self.device == "cuda":
            torch.cuda.set_device(0)
        from workers.distributed import rendezvous_url

        dist.init_process_group(backend, init_method=rendezvous_url(addr, port), rank=self.rank, world_size=self.world_size)

    def setup(self) -> None:
        for role in ROLE_ORDER:
            if role not in self.pool_cfg.roles:
                continue
            if (role == "critic" and not self.cfg.needs_critic) or (role == "reference" and not self.cfg.needs_reference):
                continue  # the node is switched off: do not load a model nobody calls
            cls = role_class(role)
            kwargs: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size, "device": self.device}
            if role == "reference" and "policy" in self.workers:
                kwargs["policy"] = self.workers["policy"]
            if role in NAMESPACED_ROLES:
                kwargs["namespace"] = self.namespace
            self.workers[role] = cls(self.cfg, **kwargs)
            self.workers[role].progress = progress_for_run(self.ckpt_root, self.pool_name, self.rank)
        self._restore_latest()
        self._record_start()

    def _restore_latest(self) -> None:
        if not self.ckpt_root:
            return
        from workers.checkpoint import load_latest

        path = load_latest(self.ckpt_root)
        if path is None:
            return
        for role, worker in self.workers.items():
            if hasattr(worker, "load_checkpoint") and role in ("policy", "rollout", "critic"):
                worker.load_checkpoint(path)
        self.restored_from = path

    def _record_start(self) -> None:
        """Append ``{"event": "started", pool, rank, pid, node_id, cwd, restored_from, t}`` to the run's
        ``pool_events.jsonl`` (beside ``checkpoints/``): one line per (re)start of a rank, so a
        run's restarts and what each restored survive the actor and the pool (a Ray restart is
        otherwise visible only to whoever held the old handle)."""
        self._record({"event": "started", "restored_from": self.restored_from, "cwd": os.getcwd()})

    def _record(self, fields: dict[str, Any]) -> None:
        if self.ckpt_root:
            append_event(self.ckpt_root, {"pool": self.pool_name, "rank": self.rank, **fields})

    # ---- serving ----
    def is_ready(self) -> bool:
        return bool(self.workers)

    def ping(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node_id": node_id(),
            "rank": self.rank,
            "roles": sorted(self.workers),
            "ready": self.is_ready(),
            "restored_from": self.restored_from,
        }

    def shutdown(self) -> None:
        """Record a ``stopped`` event (with :meth:`weights_digest`), then release what workers hold
        outside this process (e.g. reward process pools)."""
        if self.workers:
            self._record({"event": "stopped", "weights_sha256": weights_digest(self.workers)})
        for worker in self.workers.values():
            close = getattr(worker, "close", None)
            if close is not None:
                close()
        self.workers = {}

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if role not in self.workers:
            raise PoolError(
                f"pool {self.pool_name!r} rank {self.rank} has no ready role {role!r} (roles: {sorted(self.workers)})"
            )
        return getattr(self.workers[role], method)(*args, **kwargs)
