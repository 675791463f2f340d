"""Dispatch protocols: how a pool method's call is split across ranks and joined back.

A worker method declares its protocol with ``@dispatch("dp_scatter")``; the pool reads
the declaration and drives every rank accordingly. Protocols are registered by name,
so users can add one with :func:`register_dispatch` (HybridFlow, Sheng et al. 2024, §4).

Built-in:
- ``broadcast``: every rank gets the same arguments; result = list of per-rank results.
- ``dp_scatter``: the first positional argument (a :class:`Batch`) is split into
  ``world_size`` parts by whole ``uid`` groups, balanced by tokens; a Batch result is
  concatenated back in the original row order (by groups in their original order when a rank
  returns a different number of rows than it got, e.g. n samples per prompt), a dict result (metrics, already reduced
  across ranks by the worker) is taken from rank 0. With fewer groups than ranks, each idle
  rank gets a padding stand-in (:func:`hybridflow.batch.padding_stand_in`: a copy of the
  lightest group, which the worker gives zero weight) so collectives stay in step; its result
  is dropped.
- ``gather``: every rank gets the same arguments; result = list of per-rank results
  (alias of broadcast with the intent of collecting data).
- ``rank_zero``: only rank 0 is called; result = its result.
- ``list_scatter``: the first positional argument (a list) is cut into ``world_size`` contiguous
  parts of near-equal length (ranks whose part would be empty are not called); the per-rank result
  lists are concatenated in rank order, so result ``i`` answers item ``i``.
- ``keyed_scatter``: like ``list_scatter``, but an item with an int ``key`` attribute goes to rank
  ``key % world_size`` (always the same rank for one key: the tools pool's sticky environment
  instances) and the others to the least loaded rank; result ``i`` answers item ``i``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.batch import Batch, BatchError, padding_stand_in
from hybridflow.registry import Registry

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class DispatchProtocol:
    """``split(args, kwargs, world_size) -> list of per-rank (args, kwargs) or None (rank not called)``;
    ``join(per_rank_results, split_info) -> result``."""

    name: str
    split: Callable[[tuple, dict, int], tuple[list[Call | None], Any]]
    join: Callable[[list[Any], Any], Any]


PROTOCOLS: Registry[DispatchProtocol] = Registry("dispatch protocol")


def register_dispatch(name: str, split: Callable, join: Callable) -> DispatchProtocol:
    """Register a protocol by name. Raises DuplicateNameError (a ValueError) if the name is taken."""
    return PROTOCOLS.add(name, DispatchProtocol(name, split, join), module=getattr(split, "__module__", None))


get_dispatch = PROTOCOLS.get  # the protocol registered as ``name``; UnknownNameError (a KeyError) lists the known ones


def dispatch(name: str) -> Callable[[Callable], Callable]:
    """Method decorator declaring the protocol the pool uses for it."""

    def deco(fn: Callable) -> Callable:
        fn.__hybridflow_dispatch__ = name  # type: ignore[attr-defined]
        return fn

    return deco


def protocol_of(fn: Callable) -> str:
    """The protocol declared on a worker method (default ``broadcast``)."""
    return getattr(fn, "__hybridflow_dispatch__", "broadcast")


# ---- built-ins -------------------------------------------------------------------------------


def _same_for_all(args: tuple, kwargs: dict, world: int) -> tuple[list[Call | None], Any]:
    return [(args, kwargs)] * world, None


def _as_list(results: list[Any], _info: Any) -> list[Any]:
    return results


@dataclass(frozen=True)
class _DpSplit:
    """How a dp_scatter call was split: ``order`` = original row of each joined real row;
    ``group_order`` = the input's uids in order of first appearance; ``padded`` = ranks that got
    a padding stand-in (their results are dropped)."""

    order: list[int]
    group_order: list[Any]
    padded: frozenset[int]


def _dp_split(args: tuple, kwargs: dict, world: int) -> tuple[list[Call | None], Any]:
    batch = args[0]
    if not isinstance(batch, Batch):
        raise TypeError(f"dp_scatter needs a Batch as first argument, got {type(batch).__name__}")
    if world == 1:
        return [(args, kwargs)], None
    index_parts = batch.split_indices_by_groups(world, allow_empty=True)
    parts = [batch.index(idx) for idx in index_parts if idx]
    if len(parts) < world:  # fewer groups than ranks: idle ranks compute on a copy of the lightest group
        tokens = batch.token_counts()
        lightest = min((p for p in index_parts if p), key=lambda p: sum(tokens[i] for i in p))
        parts += [padding_stand_in(batch, lightest) for _ in range(world - len(parts))]
    order = [i for idx in index_parts for i in idx]
    padded = frozenset(r for r, idx in enumerate(index_parts) if not idx)
    group_order = list(dict.fromkeys(batch["uid"]))
    return [((p, *args[1:]), kwargs) for p in parts], _DpSplit(order, group_order, padded)


def _dp_join(results: list[Any], info: _DpSplit | None) -> Any:
    if info is not None:
        results = [r for rank, r in enumerate(results) if rank not in info.padded]
    first = results[0]
    if isinstance(first, Batch):
        joined = Batch.concat(results) if len(results) > 1 else first
        if info is None:
            return joined
        if len(joined) != len(info.order):  # rows per group changed (generate: n samples per prompt)
            return joined.index(_group_major(joined, info.group_order))
        inverse = [0] * len(info.order)
        for new_pos, old_pos in enumerate(info.order):
            inverse[old_pos] = new_pos
        return joined.index(inverse)
    return first  # metrics dicts are all-reduced by the workers; rank 0 (never padding) speaks for the pool


def _group_major(joined: Batch, group_order: list[Any]) -> list[int]:
    """Rows of ``joined`` ordered by the input's group order (rows of a group in their order)."""
    rows: dict[Any, list[int]] = {}
    for i, u in enumerate(joined["uid"]):
        rows.setdefault(u, []).append(i)
    idx = [i for u in group_order for i in rows.get(u, [])]
    if len(idx) != len(joined):
        raise BatchError(f"dp_scatter: results hold uids that were not in the input ({len(joined)} rows, "
                         f"{len(idx)} matched)")
    return idx


def _rank_zero_split(args: tuple, kwargs: dict, world: int) -> tuple[list[Call | None], Any]:
    return [(args, kwargs)] + [None] * (world - 1), None


def _rank_zero_join(results: list[Any], _info: Any) -> Any:
    return results[0]


def _list_split(args: tuple, kwargs: dict, world: int) -> tuple[list[Call | None], Any]:
    items = args[0]
    if not isinstance(items, list):
        raise TypeError(f"list_scatter needs a list as first argument, got {type(items).__name__}")
    size, extra = divmod(len(items), world)
    calls: list[Call | None] = []
    start = 0
    for rank in range(world):
        stop = start + size + (rank < extra)
        calls.append(((items[start:stop], *args[1:]), kwargs) if stop > start else None)
        start = stop
    return calls, None


def _list_join(results: list[Any], _info: Any) -> list[Any]:
    return [item for part in results for item in part]


def _keyed_split(args: tuple, kwargs: dict, world: int) -> tuple[list[Call | None], Any]:
    items = args[0]
    if not isinstance(items, list):
        raise TypeError(f"keyed_scatter needs a list as first argument, got {type(items).__name__}")
    ranks: list[int] = []
    loads = [0] * world
    for item in items:
        key = getattr(item, "key", None)
        rank = key % world if key is not None else min(range(world), key=loads.__getitem__)
        ranks.append(rank)
        loads[rank] += 1
    parts = [[item for item, r in zip(items, ranks, strict=True) if r == rank] for rank in range(world)]
    calls = [((part, *args[1:]), kwargs) if part else None for part in parts]
    return calls, ranks


def _keyed_join(results: list[Any], ranks: list[int]) -> list[Any]:
    # results of the called ranks only (those with a part), in rank order
    parts = {r: iter(part) for r, part in zip(sorted(set(ranks)), results, strict=True)}
    return [next(parts[r]) for r in ranks]


register_dispatch("broadcast", _same_for_all, _as_list)
register_dispatch("gather", _same_for_all, _as_list)
register_dispatch("dp_scatter", _dp_split, _dp_join)
register_dispatch("rank_zero", _rank_zero_split, _rank_zero_join)
register_dispatch("list_scatter", _list_split, _list_join)
register_dispatch("keyed_scatter", _keyed_split, _keyed_join)
