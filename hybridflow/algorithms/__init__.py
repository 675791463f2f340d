"""RL algorithms: advantage estimators, policy/value losses, KL, loss aggregation.

Pure torch; estimators and policy losses are selected by name through
:mod:`hybridflow.algorithms.registry`. Importing this package registers every built-in
(``hybridflow.config.BUILTIN_ADV_ESTIMATORS`` / ``BUILTIN_POLICY_LOSSES``; a test keeps the
two in sync). User code adds one with a decorator::

    from hybridflow.algorithms import register_advantage_estimator

    @register_advantage_estimator("my_estimator")
    def my_estimator(token_level_rewards, response_mask, *, uid): ...

(an estimator declares the inputs it uses: ``uid``, ``values``, ``gamma``, ``lam``,
``norm_by_std``, ``reward_baselines``; the pipeline passes only those, or all of them to one
that takes ``**options``)

and selects it with ``algorithm.adv_estimator=my_estimator`` (module listed in
``trainer.plugins``). See docs/algorithms.md.
"""

from hybridflow.algorithms import advantages as _advantages  # noqa: F401  (registers estimators)
from hybridflow.algorithms import policy_losses as _policy_losses  # noqa: F401  (registers losses)
from hybridflow.algorithms import returns as _returns  # noqa: F401  (registers gae, reinforce_plus_plus)
from hybridflow.algorithms.aggregation import (
    LOSS_AGG_MODES,
    MicroBatch,
    accumulation_plan,
    aggregate_loss,
    loss_normalizer,
)
from hybridflow.algorithms.core import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)
from hybridflow.algorithms.logits import entropy_from_logits, log_probs_from_hidden, log_probs_from_logits
from hybridflow.algorithms.registry import (
    advantage_estimator_min_samples,
    advantage_estimator_names,
    get_advantage_estimator,
    get_policy_loss,
    policy_loss_names,
    register_advantage_estimator,
    register_policy_loss,
)
from hybridflow.algorithms.rollout_correction import rollout_correction_weights
from hybridflow.algorithms.sequences import overlong_penalty, position_ids_from_mask, response_mask_from_ids
from hybridflow.algorithms.value import value_loss

_LAZY = {"compute_advantages", "filter_zero_variance_groups"}  # pipeline imports the Batch (tensordict)


def __getattr__(name: str):
    if name in _LAZY:
        from hybridflow.algorithms import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'hybridflow.algorithms' has no attribute {name!r}")

__all__ = [
    "register_advantage_estimator",
    "get_advantage_estimator",
    "advantage_estimator_min_samples",
    "advantage_estimator_names",
    "register_policy_loss",
    "get_policy_loss",
    "policy_loss_names",
    "value_loss",
    "kl_penalty",
    "kl_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "loss_normalizer",
    "accumulation_plan",
    "MicroBatch",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
    "log_probs_from_logits",
    "log_probs_from_hidden",
    "position_ids_from_mask",
    "response_mask_from_ids",
    "overlong_penalty",
    "rollout_correction_weights",
    "compute_advantages",
    "filter_zero_variance_groups",
]
