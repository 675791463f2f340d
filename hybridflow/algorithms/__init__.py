"""RL algorithms: advantage estimators, policy/value losses, KL, loss aggregation.

Pure torch; everything is selected by name through :mod:`hybridflow.algorithms.registry`.
"""

from hybridflow.algorithms.registry import (
    advantage_estimator_names,
    get_advantage_estimator,
    get_policy_loss,
    policy_loss_names,
    register_advantage_estimator,
    register_policy_loss,
)

__all__ = [
    "register_advantage_estimator",
    "get_advantage_estimator",
    "advantage_estimator_names",
    "register_policy_loss",
    "get_policy_loss",
    "policy_loss_names",
]
