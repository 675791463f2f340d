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
    """``flow`` (default: the built-in iteration) with the advantage node, and so the update,
    reading best_of_n's rows in place of all of rollout's, reward's, reference's and values'."""
    flow = (flow or builtin_dataflow(cfg)).add(best_of_n, before="advantage")
    fed = [p for p in ("rollout", "reward", "reference", "values") if flow.wiring["advantage"].get(p)]
    return flow.rewire("advantage", **{p: "best_of_n" for p in fed})
