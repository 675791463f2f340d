"""Test-only (``trainer.plugins``): ``actor.policy_loss: slow_ppo`` — PPO that sleeps 1 s per
micro-batch, so an update takes longer than a rollout (tests/integration/test_async_training.py)."""

from __future__ import annotations

import time

from hybridflow.algorithms import get_policy_loss
from hybridflow.algorithms.registry import register_policy_loss

SLEEP_S = 1.0


@register_policy_loss("slow_ppo")
def slow_ppo(log_probs, old_log_probs, advantages, response_mask, **settings):
    time.sleep(SLEEP_S)
    return get_policy_loss("ppo")(log_probs, old_log_probs, advantages, response_mask, **settings)
