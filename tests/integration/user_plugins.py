"""A user advantage estimator and a DAPO-like filter node, written with the API of docs/extending.md
(whose examples are tests/integration/extending/); test_recovery_and_extending.py trains with them.

Selected by config: `algorithm.adv_estimator=grpo_median`, `trainer.plugins=[tests.integration.user_plugins]`,
`trainer.dataflow=tests.integration.user_plugins:build_dataflow`.
"""

import torch

from flows.dataflow import node
from flows.iteration import builtin_dataflow
from hybridflow.algorithms import register_advantage_estimator
from hybridflow.batch import Batch


@register_advantage_estimator("grpo_median")
def grpo_median(token_level_rewards, response_mask, *, uid=None, **options):
    """GRPO with the group median as baseline: A_i = r_i − median(r_group), broadcast over tokens."""
    scores = (token_level_rewards * response_mask).sum(-1)
    labels = torch.as_tensor([hash(u) for u in uid]) if not torch.is_tensor(uid) else uid
    adv = torch.empty_like(scores)
    for label in labels.unique():  # groups are few; samples within a group are vectorised
        members = labels == label
        adv[members] = scores[members] - scores[members].median()
    advantages = adv[:, None] * response_mask
    return advantages, advantages.clone()


@node(name="keep_informative_groups")
def keep_informative_groups(run, rollout: Batch, reward: Batch):
    """Drop groups whose samples all got the same score (no learning signal; DAPO dynamic sampling)."""
    joined = rollout.union(reward)
    scores = joined["token_level_scores"].sum(-1)
    keep = [i for g in joined.groups() if scores[g].unique().numel() > 1 for i in g]
    if not keep:  # nothing informative: keep everything rather than train on an empty batch
        return joined, {"keep_informative_groups/kept": 0.0}
    return joined.index(keep), {"keep_informative_groups/kept": len(keep) / len(joined)}


def build_dataflow(cfg):
    """The built-in iteration, with the advantage (and so the update) on the informative groups."""
    flow = builtin_dataflow(cfg).add(keep_informative_groups, before="advantage")
    return flow.rewire("advantage", rollout="keep_informative_groups", reward="keep_informative_groups")
