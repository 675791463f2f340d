"""Example 2 of docs/extending.md: a node after the reward — RAFT-style best-of-n rejection
sampling, the update trains on each prompt's TOP_K best responses.

Select it with `trainer.dataflow=tests.integration.extending.best_of_n:build_dataflow`.
"""

import torch

from flows.dataflow import node
from flows.iteration import builtin_dataflow
from hybridflow.batch import Batch

TOP_K = 2  # responses kept per prompt, of the rollout.samples_per_prompt sampled


@node(name="best_of_n")
def best_of_n(run, rollout: Batch, reward: Batch, reference: Batch | None = None, values: Batch | None = None):
    """Rejection sampling (Dong et al. 2023, "RAFT"): each prompt's TOP_K responses with the highest
    score (token_level_scores summed; ties: the earlier sample), with every field the advantage node
    reads, rows in their original order. Metrics: the kept responses' mean score."""
    joined = rollout.union(reward)
    for extra in (reference, values):  # present when the config has KL / a critic
        joined = joined if extra is None else joined.union(extra)
    scores = joined["token_level_scores"].sum(-1)
    keep = []
    for group in joined.groups():
        best = torch.argsort(scores[group], descending=True, stable=True)[:TOP_K]
        keep += [group[i] for i in best.tolist()]
    keep.sort()
    return joined.index(keep), {"best_of_n/kept_score_mean": scores[keep].mean().item()}


def build_dataflow(cfg, flow=None):
    """``flow`` (default: the built-in iteration) with best_of_n reading what the advantage node
    read (e.g. filter_groups' kept groups), and the advantage node, so the update, reading best_of_n."""
    flow = flow or builtin_dataflow(cfg)
    fed = {p: src for p, src in flow.wiring["advantage"].items() if src and p in ("rollout", "reward", "reference", "values")}
    flow = flow.add(best_of_n.wire(**fed), before="advantage")
    return flow.rewire("advantage", **{p: "best_of_n" for p in fed})
