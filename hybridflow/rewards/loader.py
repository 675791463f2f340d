"""Load a user's reward function from ``reward.function`` and detect its calling convention.

Specs: ``"package.module:function"`` (imported by name) or ``"path/to/file.py:function"``
(loaded from the file). Accepted signatures, detected by parameter names:

- ``verl``: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` →
  float | dict (a dict has ``score`` and extra fields). Called once per row, by keyword.
- ``batched`` (TRL): ``fn(prompts, completions, **kwargs)`` → list of float | None, one per
  completion. Called once per chunk of rows with keyword lists ``prompts``, ``completions``
  (plain strings), ``data_source``, ``ground_truth``, ``extra_info``.
- ``verl_async`` / ``batched_async``: the same as ``async def``; run with ``asyncio.run``.

Arguments a function does not declare (and cannot take through ``**kwargs``) are not passed,
so ``def reward(completions, **kw)`` and ``def score(solution_str, ground_truth)`` both work.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hybridflow.user_code import import_user_module

RewardKind = Literal["verl", "verl_async", "batched", "batched_async"]


class RewardLoadError(ImportError):
    """``reward.function`` could not be imported or has an unsupported signature."""


@dataclass(frozen=True)
class RewardFunction:
    """A loaded user reward function and how to call it."""

    spec: str
    fn: Callable[..., Any]
    kind: RewardKind

    @property
    def batched(self) -> bool:
        return self.kind in ("batched", "batched_async")

    def score_row(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> Any:
        """Call a verl-style function on one row; returns what the function returns."""
        kwargs = {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
        out = self.fn(**_accepted(self.fn, kwargs))
        return asyncio.run(out) if self.kind == "verl_async" else out

    def score_batch(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        data_source: Sequence[str],
        ground_truth: Sequence[Any],
        extra_info: Sequence[Any],
    ) -> list[Any]:
        """Call a batched (TRL) function; raises ValueError unless it returns one value per row."""
        kwargs = {
            "prompts": list(prompts),
            "completions": list(completions),
            "data_source": list(data_source),
            "ground_truth": list(ground_truth),
            "extra_info": list(extra_info),
        }
        out = self.fn(**_accepted(self.fn, kwargs))
        if self.kind == "batched_async":
            out = asyncio.run(out)
        if not isinstance(out, list | tuple) or len(out) != len(completions):
            got = f"{len(out)} values" if isinstance(out, list | tuple) else type(out).__name__
            raise ValueError(f"batched reward returned {got} for {len(completions)} completions")
        return list(out)


def load_reward_function(spec: str) -> RewardFunction:
    """Import ``spec`` ("pkg.mod:fn" or "path/file.py:fn") and detect its signature.

    Raises RewardLoadError naming the spec and the cause (malformed spec, file missing, import
    failed — with the original exception type and message —, attribute missing, not callable,
    or a signature that is neither verl's nor TRL's).
    """
    if ":" not in spec:
        raise RewardLoadError(f"reward.function {spec!r}: expected 'package.module:function' or 'path/file.py:function'")
    where, name = spec.rsplit(":", 1)
    module = import_user_module(
        where, label=f"reward.function {spec!r}", prefix="hybridflow_user_reward_", error_cls=RewardLoadError
    )
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardLoadError(f"reward.function {spec!r}: {where} has no attribute {name!r}; callables: {public}")
    if not callable(fn):
        raise RewardLoadError(f"reward.function {spec!r}: {name} is a {type(fn).__name__}, not a function")
    return RewardFunction(spec, fn, _detect_kind(spec, fn))


def _detect_kind(spec: str, fn: Callable[..., Any]) -> RewardKind:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise RewardLoadError(f"reward.function {spec!r}: cannot read its signature ({e})") from e
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    if "solution_str" in params:
        return "verl_async" if is_async else "verl"
    if "completions" in params:
        return "batched_async" if is_async else "batched"
    raise RewardLoadError(
        f"reward.function {spec!r}: unsupported signature {inspect.signature(fn)}; expected verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info=None) or TRL's "
        "fn(prompts, completions, **kwargs) -> list[float]"
    )


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


__all__ = ["RewardFunction", "RewardLoadError", "load_reward_function", "RewardKind"]
