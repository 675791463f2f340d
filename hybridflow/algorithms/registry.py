"""Name → implementation registries for advantage estimators and policy losses.

One implementation per name (:class:`hybridflow.registry.Registry`): registering a taken name
raises DuplicateNameError (a ValueError) naming the module that registered it; looking up an
unknown name raises UnknownNameError (a KeyError) listing the known ones. Dispatch goes only
through here. (Pattern from verl ``core_algos.py`` ``@register_adv_est``.)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from hybridflow.registry import Registry

F = TypeVar("F", bound=Callable)

ADV_ESTIMATORS: Registry[Callable] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable] = Registry("policy loss")
_MIN_SAMPLES_PER_PROMPT: dict[str, int] = {}  # estimators whose baseline is the prompt's group


def register_advantage_estimator(name: str, *, min_samples_per_prompt: int = 1) -> Callable[[F], F]:
    """Decorator: make ``fn`` selectable as ``algorithm.adv_estimator=name``.

    min_samples_per_prompt: the smallest ``rollout.samples_per_prompt`` the estimator is
    meaningful with (2 for group baselines: GRPO, RLOO, ...; with one sample per prompt the
    group is the sample itself and the baseline degenerates). Preflight refuses fewer.
    """

    def deco(fn: F) -> F:
        ADV_ESTIMATORS.add(name, fn)  # raises for a taken name before anything is recorded
        if min_samples_per_prompt > 1:
            _MIN_SAMPLES_PER_PROMPT[name] = min_samples_per_prompt
        return fn

    return deco


def advantage_estimator_min_samples(name: str) -> int:
    """``min_samples_per_prompt`` the estimator was registered with (1 for unknown names)."""
    return _MIN_SAMPLES_PER_PROMPT.get(name, 1)


get_advantage_estimator = ADV_ESTIMATORS.get
advantage_estimator_names = ADV_ESTIMATORS.names


def declared_inputs(fn: Callable, inputs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``inputs`` that ``fn`` declares as parameters (all of them if it takes ``**kw``).

    The advantage pipeline offers every estimator the same inputs (``uid``, ``values``, ``gamma``,
    ``lam``, ``norm_by_std``, ``reward_baselines``); an estimator names only those it uses.
    """
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(inputs)
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return {k: v for k, v in inputs.items() if k in names}


register_policy_loss = POLICY_LOSSES.register  # decorator: make ``fn`` selectable as ``actor.policy_loss=name``
get_policy_loss = POLICY_LOSSES.get
policy_loss_names = POLICY_LOSSES.names
