"""Persistent Ray actor pools: create or look up, place, dispatch, health, restart.

A pool is ``workers`` Ray actors (data-parallel ranks) named ``<pool>/rank<r>`` in the
run's namespace, placed with one placement group (one bundle per rank). Each actor is a
:class:`workers.host.WorkerHost` that holds one plain worker object per role (roles in one pool share
the process: the hybrid engine). Prefect tasks find a pool by name with :func:`get_pool`
and call role methods on a role handle (``pool.role("policy").generate_sequences(batch)``,
:mod:`workers.handles`), which splits and joins each call by the method's declared dispatch
protocol (:mod:`workers.dispatch`).

Recovery: actors are created with ``max_restarts``; a restarted single-rank actor rebuilds
its workers and restores the pool's latest checkpoint in ``__init__`` before it serves
again. A multi-rank pool whose process group broke is rebuilt as a whole by
:meth:`Pool.ensure_healthy`. A pool that cannot recover raises :class:`PoolError` naming
the pool, the rank and the cause.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.config import ExperimentConfig, PoolConfig
from hybridflow.deprecation import warn_deprecated
from workers.allocator import worker_env
from workers.dispatch import get_dispatch, protocol_of
from workers.handles import ROLE_CLASSES, RoleHandle, call_ranks, role_class  # noqa: F401 (re-exported)
from workers.host import WorkerHost
from workers.placement import PoolResourceError, bundle_of, check_pool_fits_cluster, describe
from workers.pool_errors import PoolError
from workers.pool_errors import cause as _cause
from workers.pool_errors import root_cause as _root_cause
from workers.pool_events import lost_ranks, pool_events_path, read_pool_events  # noqa: F401 (re-exported)
from workers.vllm_runtime import vllm_runtime_env


def namespace_for(run_id: str) -> str:
    return f"hybridflow-{run_id}"


@dataclass
class Pool:
    """Handle to a pool's actors (picklable: Prefect tasks receive or look it up)."""

    name: str
    namespace: str
    actors: list[Any]
    roles: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def role(self, role: str) -> RoleHandle:
        """This pool's ``role`` with its worker methods bound (:class:`workers.handles.RoleHandle`)."""
        return RoleHandle(self, role)

    def call(self, role: str, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``role.method`` by name. Deprecated (FutureWarning, removed in 0.3.0): call the bound
        method of the role's handle, ``pool.role(role).method(...)``. Returns the joined result."""
        warn_deprecated(f"Pool.call({role!r}, {method!r}, ...)", f"pool.role({role!r}).{method}(...)")
        proto = get_dispatch(protocol_of(getattr(role_class(role), method)))
        return call_ranks(self, role, method, proto, args, kwargs, timeout_s)

    def ping(self, deadline_s: float = 30.0) -> list[dict[str, Any]]:
        """Ping every rank; raises PoolError naming the first rank that is dead or too slow."""
        out = []
        for rank, actor in enumerate(self.actors):
            try:
                out.append(ray.get(actor.ping.remote(), timeout=deadline_s))
            except GetTimeoutError:
                raise PoolError(f"pool {self.name!r} rank {rank}: no answer to ping within {deadline_s}s") from None
            except RayActorError as e:
                raise PoolError(f"pool {self.name!r} rank {rank} is dead: {_cause(e)}") from None
        return out

    def pids(self) -> list[int]:
        return [p["pid"] for p in self.ping()]


def _actor_name(pool: str, rank: int) -> str:
    return f"{pool}/rank{rank}"


def get_pool(name: str, namespace: str, roles: tuple[str, ...] = ()) -> Pool:
    """Look up an existing pool by name. Raises PoolError if it does not exist."""
    actors = []
    rank = 0
    while True:
        try:
            actors.append(ray.get_actor(_actor_name(name, rank), namespace=namespace))
        except ValueError:
            break
        rank += 1
    if not actors:
        raise PoolError(f"pool {name!r} does not exist in namespace {namespace!r}")
    return Pool(name, namespace, actors, roles)


def create_pool(
    cfg: ExperimentConfig,
    name: str,
    *,
    namespace: str,
    ckpt_root: str | None,
    max_restarts: int = 3,
    ready_timeout_s: float = 600.0,
) -> Pool:
    """Create (or look up, if it exists) the pool ``name`` of ``cfg.placement.pools``.

    Blocks until every rank has built its workers (models loaded). Raises PoolError naming
    the rank that failed and why (e.g. the model path does not exist).
    """
    pool_cfg = cfg.placement.pools[name]
    try:
        existing = get_pool(name, namespace, tuple(pool_cfg.roles))
        if existing.world_size == pool_cfg.workers:
            return existing
    except PoolError:
        pass
    pg = _placement_group(namespace, name, pool_cfg, ready_timeout_s)
    actors = _spawn_ranks(cfg, name, namespace, pg, ckpt_root, max_restarts)
    pool = Pool(name, namespace, actors, tuple(pool_cfg.roles))
    _bring_up(pool, ready_timeout_s)
    return pool


def _placement_group(namespace: str, name: str, pool_cfg: PoolConfig, timeout_s: float) -> Any:
    """The pool's placement group (one bundle per rank), created if absent and placed within
    ``timeout_s`` (PoolError naming the pool and the cluster's resources otherwise)."""
    pg_name = f"{namespace}/{name}"
    try:
        pg = get_placement_group(pg_name)
    except ValueError:
        check_pool_fits_cluster(name, pool_cfg)  # a request no node set can hold fails now, not never
        pg = placement_group([bundle_of(pool_cfg)] * pool_cfg.workers, strategy=pool_cfg.placement_strategy,
                             name=pg_name)
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise PoolError(f"{describe(name, pool_cfg)}: not placed within {timeout_s:g}s (other pools hold "
                        f"the resources?); cluster resources: {ray.cluster_resources()}")
    return pg


def _spawn_ranks(cfg: ExperimentConfig, name: str, namespace: str, pg: Any, ckpt_root: str | None,
                 max_restarts: int) -> list[Any]:
    """One named, restartable WorkerHost actor per rank, each on its bundle of ``pg``."""
    pool_cfg = cfg.placement.pools[name]
    threads = pool_cfg.torch_threads or max(1, int(round(pool_cfg.cpus_per_worker)))
    host_cls = ray.remote(WorkerHost)
    cfg_dict = cfg.model_dump(mode="json")
    return [
        host_cls.options(
            name=_actor_name(name, rank),
            namespace=namespace,
            num_cpus=pool_cfg.cpus_per_worker,
            num_gpus=pool_cfg.gpus_per_worker,
            max_restarts=max_restarts,
            max_task_retries=0,
            # a rollout rank takes the next weights (receive_weights) while it generates
            max_concurrency=2 if "rollout" in pool_cfg.roles else 1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            runtime_env=_runtime_env(cfg, pool_cfg, threads),
        ).remote(cfg_dict, name, rank, pool_cfg.workers, ckpt_root, threads, namespace)
        for rank in range(pool_cfg.workers)
    ]


def _runtime_env(cfg: ExperimentConfig, pool_cfg: PoolConfig, threads: int) -> dict[str, Any]:
    """A rank's ``runtime_env``: the allocator's environment, and for a pool holding a vLLM engine the
    vLLM runtime's interpreter and settings (:func:`workers.vllm_runtime.vllm_runtime_env`)."""
    vllm = vllm_runtime_env(cfg, pool_cfg.roles, on_cpu=not pool_cfg.gpus_per_worker)
    return {**vllm, "env_vars": {**worker_env(pool_cfg, threads), **vllm.get("env_vars", {})}}


def _bring_up(pool: Pool, timeout_s: float) -> None:
    try:
        if pool.world_size > 1 and pool.roles != ("tools",):  # the tools role needs no process group
            addr, port = ray.get(pool.actors[0].free_address.remote(), timeout=timeout_s)
            ray.get([a.init_distributed.remote(addr, port) for a in pool.actors], timeout=timeout_s)
            ray.get([a.setup.remote() for a in pool.actors], timeout=timeout_s)
        else:
            ray.get([a.ping.remote() for a in pool.actors], timeout=timeout_s)
    except RayActorError as e:
        rank = _failed_rank(pool)
        raise PoolError(f"pool {pool.name!r} rank {rank} failed to start: {_root_cause(e)}") from None
    except GetTimeoutError:
        raise PoolError(f"pool {pool.name!r} did not come up within {timeout_s}s") from None


def _failed_rank(pool: Pool) -> int | str:
    for rank, a in enumerate(pool.actors):
        try:
            ray.get(a.ping.remote(), timeout=5)
        except Exception:
            return rank
    return "?"


def ensure_healthy(cfg: ExperimentConfig, pool: Pool, *, ckpt_root: str | None, wait_s: float = 300.0) -> Pool:
    """Wait until every rank answers a ping and is ready (a Ray restart restores the latest
    checkpoint). A multi-rank pool with a restarted rank is rebuilt as a whole. Raises
    PoolError when the pool cannot recover."""
    deadline = time.monotonic() + wait_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        rebuilt = _replace_lost_ranks(cfg, pool, ckpt_root)  # Ray marks a node dead after missed heartbeats
        if rebuilt is not None:
            return rebuilt
        try:  # short pings, so a node found dead meanwhile is acted on
            infos = pool.ping(deadline_s=min(10.0, max(1.0, deadline - time.monotonic())))
            if all(i["ready"] for i in infos):
                return pool
            if pool.world_size > 1:  # a rank restarted alone cannot rejoin the process group
                destroy_pool(pool)
                return create_pool(cfg, pool.name, namespace=pool.namespace, ckpt_root=ckpt_root)
        except PoolError as e:
            last = e
            if "is dead" in str(e) and "restarts" in str(e):
                break
        time.sleep(0.5)
    raise PoolError(f"pool {pool.name!r} did not recover within {wait_s}s: {last}")


def wait_for_pools(cfg: ExperimentConfig, namespace: str, *, ckpt_root: str | None, wait_s: float) -> float:
    """Wait (up to ``wait_s`` seconds per pool) until every pool of ``cfg.placement.pools`` that
    exists in ``namespace`` answers with every rank ready (:func:`ensure_healthy`: a rank Ray is
    restarting after its actor died is back, its latest checkpoint restored). What a retried node
    does first (:func:`tasks.pools.wait_for_run_pools`), so a retry never meets a rank that is still
    down, e.g. a tools-pool rank killed mid-call, which the node reaches only through another pool.
    A pool not started (``eval`` starts fewer) is skipped. Returns the seconds waited; raises
    PoolError naming the pool that did not come back."""
    start = time.monotonic()
    for name, pool_cfg in cfg.placement.pools.items():
        try:
            pool = get_pool(name, namespace, tuple(pool_cfg.roles))
        except PoolError:
            continue
        ensure_healthy(cfg, pool, ckpt_root=ckpt_root, wait_s=wait_s)
    return time.monotonic() - start


def _replace_lost_ranks(cfg: ExperimentConfig, pool: Pool, ckpt_root: str | None) -> Pool | None:
    """A rank whose Ray node died never answers (its actor waits for a place its placement group
    allows). Rebuild the pool on the nodes that are left (restoring the latest checkpoint), or
    raise PoolError naming the pool and the lost node when they cannot hold it. None: no node lost."""
    if not ckpt_root:
        return None
    lost = lost_ranks(os.path.dirname(os.path.normpath(ckpt_root)), pool.name, pool.world_size)
    if not lost:
        return None
    where = "; ".join(f"rank {r} ran on node {n['node_id']} ({n['ip']}), which is gone" for r, n in lost.items())
    try:
        check_pool_fits_cluster(pool.name, cfg.placement.pools[pool.name])
    except PoolResourceError as e:
        raise PoolError(f"pool {pool.name!r}: {where}; the nodes left cannot hold it ({e}); add a node, "
                        f"then `hybridflow train --resume <run dir>`") from None
    destroy_pool(pool, grace_s=10.0)
    return create_pool(cfg, pool.name, namespace=pool.namespace, ckpt_root=ckpt_root)


def destroy_pool(pool: Pool, *, grace_s: float = 30.0) -> None:
    """Shut the pool's workers down (closing their child processes), then kill its actors and
    remove its placement group."""
    try:
        ray.get([a.shutdown.remote() for a in pool.actors], timeout=grace_s)
    except Exception:
        pass
    for a in pool.actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass
    try:
        remove_placement_group(get_placement_group(f"{pool.namespace}/{pool.name}"))
    except ValueError:
        pass


def restart_rank(pool: Pool, rank: int) -> None:
    """Kill rank ``rank``'s actor so that Ray starts it again (the actors have ``max_restarts``;
    a restarted rank restores the latest checkpoint, :func:`ensure_healthy`): the way out for a rank
    that hangs in a call. A retried node waits for it (:func:`wait_for_pools`)."""
    ray.kill(pool.actors[rank], no_restart=False)


def create_pools(cfg: ExperimentConfig, *, namespace: str, ckpt_root: str | None) -> dict[str, Pool]:
    """Create every pool of the placement config. Returns {pool name: Pool}."""
    return {name: create_pool(cfg, name, namespace=namespace, ckpt_root=ckpt_root) for name in cfg.placement.pools}


def pool_for_role(cfg: ExperimentConfig, role: str) -> str:
    for name, p in cfg.placement.pools.items():
        if role in p.roles:
            return name
    raise PoolError(f"no pool has role {role!r}")
