"""Dispatch protocols: how a pool method's call is split across ranks and joined back.

A worker method declares its protocol with ``@dispatch("dp_scatter")``; the pool reads
the declaration and drives every rank accordingly. Protocols are registered by name,
so users can add one with :func:`register_dispatch` (HybridFlow, Sheng et al. 2024, §4).

Built-in:
- ``broadcast``: every rank gets the same arguments; result = list of per-rank results.
- ``dp_scatter``: the first positional argument (a :class:`Batch`) is split into
  ``world_size`` parts by whole ``uid`` groups, balanced by tokens; a Batch result is
  concatenated back in the original row order, a dict result (metrics, already reduced
  across ranks by the worker) is taken from rank 0.
- ``gather``: every rank gets the same arguments; result = list of per-rank results
  (alias of broadcast with the intent of collecting data).
- ``rank_zero``: only rank 0 is called; result = its result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.batch import Batch

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class DispatchProtocol:
    """``split(args, kwargs, world_size) -> list of per-rank (args, kwargs) or None (rank not called)``;
    ``join(per_rank_results, split_info) -> result``."""

    name: str
    split: Callable[[tuple, dict, int], tuple[list[Call | None], Any]]
    join: Callable[[list[Any], Any], Any]


_PROTOCOLS: dict[str, DispatchProtocol] = {}


def register_dispatch(name: str, split: Callable, join: Callable) -> DispatchProtocol:
    """Register a protocol by name. Raises ValueError if the name is taken."""
    if name in _PROTOCOLS:
        raise ValueError(f"dispatch protocol {name!r} is already registered")
    proto = DispatchProtocol(name, split, join)
    _PROTOCOLS[name] = proto
    return proto


def get_dispatch(name: str) -> DispatchProtocol:
    try:
        return _PROTOCOLS[name]
    except KeyError:
        raise KeyError(f"unknown dispatch protocol {name!r}; known: {', '.join(sorted(_PROTOCOLS))}") from None


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


def _dp_split(args: tuple, kwargs: dict, world: int) -> tuple[list[Call | None], Any]:
    batch = args[0]
    if not isinstance(batch, Batch):
        raise TypeError(f"dp_scatter needs a Batch as first argument, got {type(batch).__name__}")
    if world == 1:
        return [(args, kwargs)], None
    index_parts = batch.split_indices_by_groups(world)
    parts = [batch.index(idx) for idx in index_parts]
    order = [i for idx in index_parts for i in idx]  # original row of each joined row
    return [((p, *args[1:]), kwargs) for p in parts], order


def _dp_join(results: list[Any], order: Sequence[int] | None) -> Any:
    first = results[0]
    if isinstance(first, Batch):
        joined = Batch.concat(results) if len(results) > 1 else first
        if order is None:
            return joined
        inverse = [0] * len(order)
        for new_pos, old_pos in enumerate(order):
            inverse[old_pos] = new_pos
        return joined.index(inverse)
    return first  # metrics dicts are all-reduced by the workers; rank 0 speaks for the pool


def _rank_zero_split(args: tuple, kwargs: dict, world: int) -> tuple[list[Call | None], Any]:
    return [(args, kwargs)] + [None] * (world - 1), None


def _rank_zero_join(results: list[Any], _info: Any) -> Any:
    return results[0]


register_dispatch("broadcast", _same_for_all, _as_list)
register_dispatch("gather", _same_for_all, _as_list)
register_dispatch("dp_scatter", _dp_split, _dp_join)
register_dispatch("rank_zero", _rank_zero_split, _rank_zero_join)
