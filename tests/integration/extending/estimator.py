"""Example 1 of docs/extending.md: a new advantage estimator, one function and one registration.

Select it with `algorithm.adv_estimator=batch_mean_baseline` and
`trainer.plugins=[tests.integration.extending.estimator]`.
"""

from hybridflow.algorithms import register_advantage_estimator


@register_advantage_estimator("batch_mean_baseline")
def batch_mean_baseline(token_level_rewards, response_mask):
    """REINFORCE with the batch's mean score as baseline (Williams 1992): A_i = r_i − mean_j r_j.

    token_level_rewards: [B, R] float32; response_mask: [B, R] bool. r_i is row i's reward summed
    over its response. Returns (advantages, returns), both [B, R] float32: A_i on every response
    token of row i, 0 outside the mask. It declares no other input (``uid``, ``gamma``, ...): the
    baseline is the whole batch's, not a group's.
    """
    scores = (token_level_rewards * response_mask).sum(-1)
    advantages = (scores - scores.mean())[:, None] * response_mask
    return advantages, advantages.clone()
