"""Placement groups for pools: what a pool asks Ray for, whether the cluster can ever give it,
and where each rank landed.

A pool of ``workers`` ranks asks for one bundle per rank, ``{CPU: cpus_per_worker, GPU:
gpus_per_worker}`` (zero entries left out), placed by ``placement_strategy`` (Ray's
placement-group strategies: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD). Ray leaves a group
that no set of nodes can hold pending forever (only its log says "infeasible"), so
:func:`check_fits` compares the request with the alive nodes' *total* resources before the
group is created and raises :class:`PoolResourceError` naming the pool and what it asked
for. A request that fits the cluster but not what other pools leave free still waits (up to
the pool's ready timeout): it will fit once they go. A cluster with an autoscaler may add
nodes for a request that does not fit now; then set ``HYBRIDFLOW_SKIP_FIT_CHECK=1``.
"""

from __future__ import annotations

import math
import os

from hybridflow.config import ConfigError, PoolConfig


class PoolResourceError(ConfigError, RuntimeError):
    """A pool asks for resources the cluster cannot hold (printed by the CLI as one line)."""


def bundle_of(pool_cfg: PoolConfig) -> dict[str, float]:
    """One rank's Ray bundle, without zero entries (Ray refuses an all-zero bundle)."""
    bundle = {"CPU": float(pool_cfg.cpus_per_worker), "GPU": float(pool_cfg.gpus_per_worker)}
    return {k: v for k, v in bundle.items() if v > 0}


def describe(name: str, pool_cfg: PoolConfig) -> str:
    """'pool 'main' asks for 2 × {CPU: 1.0, GPU: 0.0} (STRICT_SPREAD)'."""
    return (f"pool {name!r} asks for {pool_cfg.workers} × {{CPU: {pool_cfg.cpus_per_worker}, "
            f"GPU: {pool_cfg.gpus_per_worker}}} ({pool_cfg.placement_strategy})")


def _ranks_per_node(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles fit in one node's total resources."""
    fits = [math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items()]
    return max(0, min(fits)) if fits else 0


def check_fits(name: str, pool_cfg: PoolConfig, nodes: list[dict[str, float]]) -> None:
    """Raise PoolResourceError unless the pool's placement group can be placed on ``nodes``
    (each node's total resources, e.g. ``{"CPU": 2.0, "GPU": 0.0, "memory": ...}``).

    STRICT_PACK: every bundle on one node. STRICT_SPREAD: each bundle on a different node.
    PACK / SPREAD: bundles anywhere (best effort packing or spreading), so the nodes together
    must hold them. Other pools are not counted: this is "ever", not "now".
    """
    bundle, w = bundle_of(pool_cfg), pool_cfg.workers
    if not bundle:
        raise PoolResourceError(f"{describe(name, pool_cfg)}: Ray refuses bundles with only 0 resources; "
                                f"set placement.pools.{name}.cpus_per_worker > 0")
    per_node = [_ranks_per_node(n, bundle) for n in nodes]
    strategy = pool_cfg.placement_strategy
    if strategy == "STRICT_PACK":
        ok, why = any(p >= w for p in per_node), "no node holds all ranks"
    elif strategy == "STRICT_SPREAD":
        ok, why = sum(p >= 1 for p in per_node) >= w, f"fewer than {w} nodes can hold a rank"
    else:
        ok, why = sum(per_node) >= w, f"the nodes hold {sum(per_node)} such ranks"
    if not ok:
        have = ", ".join(_short(n) for n in nodes) or "none"
        raise PoolResourceError(f"{describe(name, pool_cfg)}, which the cluster cannot place ({why}); "
                                f"nodes: {have}")


def _short(node: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {node[k]:g}" for k in ("CPU", "GPU") if k in node) + "}"


def alive_node_resources() -> list[dict[str, float]]:
    """Total resources of each alive node of the connected Ray cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def check_pool_fits_cluster(name: str, pool_cfg: PoolConfig) -> None:
    """:func:`check_fits` against the connected Ray cluster (skipped with HYBRIDFLOW_SKIP_FIT_CHECK=1)."""
    if os.environ.get("HYBRIDFLOW_SKIP_FIT_CHECK") == "1":
        return
    check_fits(name, pool_cfg, alive_node_resources())


def node_id() -> str | None:
    """This process's Ray node id (hex), or None outside a Ray worker."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


__all__ = ["PoolResourceError", "bundle_of", "describe", "check_fits", "check_pool_fits_cluster",
           "alive_node_resources", "node_id"]
