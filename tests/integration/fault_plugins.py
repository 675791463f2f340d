"""Test-only fault injection: a pass-through node between reward and advantage that fails while
``<run_dir>/fail_plan.json`` says so (iteration, failures left)."""

import json
from pathlib import Path

from flows.dataflow import node
from flows.iteration import builtin_dataflow
from hybridflow.batch import Batch


@node(name="gate", retries=1, retry_delay_s=0.5)
def gate(run, reward: Batch) -> Batch:
    plan_path = Path(run.run_dir) / "fail_plan.json"
    if plan_path.exists():
        plan = json.loads(plan_path.read_text())
        if plan["iteration"] == run.iteration and plan["failures"] > 0:
            plan["failures"] -= 1
            plan_path.write_text(json.dumps(plan))
            raise RuntimeError(f"injected failure in iteration {run.iteration}")
    return reward


def build_dataflow(cfg):
    return builtin_dataflow(cfg).add(gate, before="advantage").rewire("advantage", reward="gate")
