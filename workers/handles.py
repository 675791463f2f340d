"""Role handles: a pool's role with its worker methods bound, verl's ``_bind_worker_method``.

    policy = pool.role("policy")            # or tasks.pools.pool_of(run, "policy")
    trajectories = policy.generate_sequences(prompts, seed=7)

Each public method of the role's worker class (:data:`ROLE_CLASSES`) becomes a method of the
handle with the same name, bound once, with the dispatch protocol the worker method declares
(``@dispatch("dp_scatter")``, :mod:`workers.dispatch`; undeclared: ``broadcast``). A call splits
its arguments across the pool's ranks by that protocol, runs them, and joins the results, so a
reader (or a static walk) follows ``policy.generate_sequences`` straight to
``PolicyWorker.generate_sequences``. Models: verl ``single_controller/base/worker_group.py``
(``_bind_worker_method``) and ``decorator.py`` (``register``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError

from workers.dispatch import DispatchProtocol, get_dispatch, protocol_of
from workers.pool_errors import PoolError, RankTimeout
from workers.worker_logs import emit as emit_worker_lines

if TYPE_CHECKING:
    from workers.pool import Pool

ROLE_CLASSES = {
    "policy": "workers.policy:PolicyWorker",
    "rollout": "workers.rollout_worker:RolloutWorker",
    "reference": "workers.reference:ReferenceWorker",
    "critic": "workers.critic:CriticWorker",
    "reward": "workers.reward:RewardWorker",
    "tools": "workers.tools:ToolsWorker",
    "judge": "workers.judge:JudgeWorker",
    "evaluator": "workers.evaluator:HarnessEvaluator",
}


def role_class(role: str) -> type:
    """The worker class of a built-in role. Raises PoolError for an unknown role."""
    try:
        module, name = ROLE_CLASSES[role].split(":")
    except KeyError:
        raise PoolError(f"unknown role {role!r}; roles: {', '.join(ROLE_CLASSES)}") from None
    return getattr(importlib.import_module(module), name)


class PendingCall:
    """A role method running on its pool's ranks, started by :func:`start_ranks`; :meth:`result`
    waits for it. What lets two pools' calls run at the same time (:func:`call_together`)."""

    def __init__(self, pool: Pool, role: str, method: str, proto: DispatchProtocol, refs: list[Any], info: Any):
        self.pool, self.role, self.method, self.proto, self.refs, self.info = pool, role, method, proto, refs, info

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait for every called rank (``timeout_s`` each) and join (``proto.join``). What each rank
        printed during the call is re-emitted here (:func:`workers.worker_logs.emit`). Raises
        RankTimeout (a PoolError naming the pool, rank and method) when a rank does not answer
        within ``timeout_s``."""
        results = []
        for rank, ref in enumerate(self.refs):
            if ref is None:
                results.append(None)
                continue
            try:
                result, lines = ray.get(ref, timeout=timeout_s)
            except GetTimeoutError:
                raise RankTimeout(self.pool.name, rank, f"{self.role}.{self.method}", timeout_s) from None
            emit_worker_lines(self.pool.name, rank, self.role, self.method, lines)
            results.append(result)
        keep_all = self.proto.name in ("broadcast", "rank_zero")
        return self.proto.join(results if keep_all else [r for r in results if r is not None], self.info)


def start_ranks(pool: Pool, role: str, method: str, proto: DispatchProtocol, args: tuple, kwargs: dict) -> PendingCall:
    """Split (``proto.split``) and start ``role.method`` on each rank that gets a part; nothing waited for."""
    calls, info = proto.split(args, kwargs, pool.world_size)
    refs = [None if c is None else actor.call_logged.remote(role, method, *c[0], **c[1])
            for actor, c in zip(pool.actors, calls, strict=True)]
    return PendingCall(pool, role, method, proto, refs, info)


def call_ranks(pool: Pool, role: str, method: str, proto: DispatchProtocol, args: tuple, kwargs: dict,
               timeout_s: float | None = None) -> Any:
    """Split (``proto.split``), run ``role.method`` on each rank that gets a part, join (``proto.join``):
    :func:`start_ranks` then :meth:`PendingCall.result`. Raises PoolError on a rank's timeout."""
    return start_ranks(pool, role, method, proto, args, kwargs).result(timeout_s)


Together = tuple[Callable[..., Any], tuple, dict]


def call_together(calls: list[Together], *, timeout_s: float | None = None) -> list[Any]:
    """The cross-pool collective protocol: ``[(bound method, args, kwargs), ...]`` — role handles'
    bound methods, e.g. ``(policy.broadcast_weights, (3,), {})`` and ``(rollout.receive_broadcast,
    (layout,), {"version": 3, "keep": 4})`` — all started before any is waited for (each on the
    ranks its dispatch protocol names), so the members of a collective spanning two pools meet.
    Returns each call's joined result, in order. Raises PoolError when a rank does not answer
    within ``timeout_s`` (per rank), or the first member's error."""
    pending = [method.start(*args, **kwargs) for method, args, kwargs in calls]
    return [p.result(timeout_s) for p in pending]


def _bound(pool: Pool, role: str, method: str, proto: DispatchProtocol, doc: str | None) -> Callable[..., Any]:
    def call(*args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return call_ranks(pool, role, method, proto, args, kwargs, timeout_s)

    def start(*args: Any, **kwargs: Any) -> PendingCall:
        return start_ranks(pool, role, method, proto, args, kwargs)

    call.__name__, call.__qualname__, call.__doc__ = method, f"{role}.{method}", doc
    call.protocol = proto.name  # type: ignore[attr-defined]
    call.start = start  # type: ignore[attr-defined]  # started without waiting: call_together
    return call


class RoleHandle:
    """One role of a pool, its worker methods bound (see the module docstring). Every bound method
    takes the worker method's arguments plus ``timeout_s`` (seconds per rank; None: no limit)."""

    def __init__(self, pool: Pool, role: str, worker_class: type | None = None):
        if role not in pool.roles:
            raise PoolError(f"pool {pool.name!r} has no role {role!r} (roles: {', '.join(pool.roles)})")
        self.pool, self.role = pool, role
        self.worker_class = worker_class or role_class(role)
        self.methods = tuple(sorted(_public_methods(self.worker_class)))
        for name in self.methods:
            fn = getattr(self.worker_class, name)
            setattr(self, name, _bound(pool, role, name, get_dispatch(protocol_of(fn)), inspect.getdoc(fn)))

    def rendezvous_address(self, timeout_s: float | None = None) -> tuple[str, int]:
        """``(host, port)`` free on rank 0's node, where a group spanning pools can meet
        (:func:`workers.distributed.rendezvous_address`). Raises PoolError on timeout."""
        try:
            return ray.get(self.pool.actors[0].free_address.remote(), timeout=timeout_s)
        except GetTimeoutError:
            raise PoolError(f"pool {self.pool.name!r} rank 0: no rendezvous address within {timeout_s}s") from None

    def __getattr__(self, name: str) -> Any:  # only for names that were not bound
        if name.startswith("__") or name in ("pool", "role", "worker_class", "methods"):
            raise AttributeError(name)
        raise AttributeError(f"{self.worker_class.__name__} (role {self.role!r}) has no method {name!r}; "
                             f"methods: {', '.join(self.methods)}")

    def __repr__(self) -> str:
        return f"RoleHandle(pool={self.pool.name!r}, role={self.role!r}, ranks={self.pool.world_size})"


@functools.cache
def _public_methods(cls: type) -> frozenset[str]:
    return frozenset(name for name, fn in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_"))


__all__ = ["ROLE_CLASSES", "PendingCall", "RoleHandle", "call_ranks", "call_together", "role_class", "start_ranks"]
