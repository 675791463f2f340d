"""Example 3 of docs/extending.md: a node switched off by config — a KL diagnostic that exists
only when the config uses KL (`actor.use_kl_loss` or `algorithm.use_kl_in_reward`; without them
the built-in dataflow has no `reference` node for it to read).

Select it with `trainer.dataflow=tests.integration.extending.kl_probe:build_dataflow`.
"""

from flows.dataflow import node
from flows.iteration import builtin_dataflow
from hybridflow.batch import Batch


@node(name="kl_probe")
def kl_probe(run, rollout: Batch, reference: Batch) -> dict[str, float]:
    """k3 estimate of KL(π_old‖π_ref) per response token (Schulman 2020) before the update: with
    x = ref_log_probs − old_log_probs (nats), k3 = eˣ − x − 1 ≥ 0. Metrics only, read by no node."""
    x = (reference["ref_log_probs"] - rollout["old_log_probs"])[rollout["response_mask"]]
    k3 = x.exp() - x - 1
    return {"kl_probe/k3_mean": k3.mean().item(), "kl_probe/k3_max": k3.max().item()}


def build_dataflow(cfg, flow=None):
    """``flow`` (default: the built-in iteration), plus kl_probe when ``cfg`` uses KL."""
    flow = flow or builtin_dataflow(cfg)
    return flow.add(kl_probe) if cfg.needs_reference else flow
