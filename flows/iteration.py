"""One RL iteration as a Prefect flow (a subflow ``iteration-000007`` of the train flow run).

    rollout ──► reward ‖ reference ‖ values ──► advantage ──► update_critic ‖ update_policy

Nodes switch off by config (no reference without KL, no values/update_critic without a
critic); a user DataFlow replaces the built-in one with ``trainer.dataflow``.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from prefect import flow, get_run_logger

from flows.dataflow import DataFlow
from hybridflow.config import ExperimentConfig
from tasks.advantage import advantage
from tasks.common import NodeResult, RunContext
from tasks.filter_groups import filter_groups
from tasks.reference import reference
from tasks.reward import reward
from tasks.rollout import rollout
from tasks.update import update_critic, update_policy
from tasks.values import values


def builtin_nodes(cfg: ExperimentConfig) -> list:
    """The built-in nodes this config switches on, in dataflow order."""
    nodes = [rollout, reward]
    if cfg.needs_reference:
        nodes.append(reference)
    if cfg.needs_critic:
        nodes.append(values)
    if cfg.algorithm.filter_groups:
        nodes.append(filter_groups)
    nodes.append(advantage)
    if cfg.needs_critic:
        nodes.append(update_critic)
    nodes.append(update_policy)
    return nodes


def flow_inputs(cfg: ExperimentConfig) -> tuple[str, ...]:
    base = ("prompts", "kl_coef", "policy_version")
    return base + (("critic_version",) if cfg.needs_critic else ())


def build_dataflow(cfg: ExperimentConfig) -> DataFlow:
    """The iteration's DataFlow: ``trainer.dataflow`` ("module:function(cfg) -> DataFlow") or the built-in one."""
    spec = cfg.trainer.dataflow
    if spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        return factory(cfg)
    return DataFlow(builtin_nodes(cfg), inputs=flow_inputs(cfg))


def _submit_all(df: DataFlow, run: RunContext, cfg: ExperimentConfig, inputs: dict[str, Any]) -> dict[str, Any]:
    if cfg.trainer.task_runner == "ray":
        from prefect_ray.context import remote_options

        # a node task only coordinates (it waits on a pool): it must not hold a CPU the pools need
        with remote_options(num_cpus=0):
            return df.submit(run, **inputs)
    return df.submit(run, **inputs)


def _throughput(cfg: ExperimentConfig, m: dict[str, float]) -> dict[str, float]:
    """perf/throughput (tokens/s/device over the whole step) and perf/mfu/actor (6·N·tokens over the
    update's time, against tracking.peak_flops_per_device)."""
    from hybridflow.metrics import compute_throughput_metrics

    tokens, n_dev = m.get("perf/total_num_tokens"), int(m.get("perf/num_devices", 1))
    if not tokens:
        return {}
    out = compute_throughput_metrics(tokens, m["timing_s/step"], n_devices=n_dev)
    if cfg.tracking.peak_flops_per_device and m.get("timing_s/update_actor"):
        mfu = compute_throughput_metrics(tokens, m["timing_s/update_actor"], n_params=m.get("perf/num_params"),
                                         flops_per_s_peak=cfg.tracking.peak_flops_per_device, n_devices=n_dev)
        out["perf/mfu/actor"] = mfu.get("perf/mfu/actor", float("nan"))
    return out


@flow(name="iteration", flow_run_name="iteration-{run.iteration:06d}", persist_result=False, log_prints=True)
def iteration(run: RunContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Run one iteration. ``inputs`` = the flow inputs (prompts NodeResult, kl_coef, versions).
    Returns {"results": {node: NodeResult}, "metrics": {name: float}}."""
    cfg = run.cfg()
    logger = get_run_logger()
    start = time.perf_counter()
    df = build_dataflow(cfg)
    futures = _submit_all(df, run, cfg, inputs)
    results: dict[str, NodeResult] = {name: fut.result() for name, fut in futures.items()}
    metrics: dict[str, float] = {}
    for res in results.values():
        metrics.update(res["metrics"])
    metrics["timing_s/step"] = time.perf_counter() - start
    metrics.update(_throughput(cfg, metrics))
    logger.info(
        "iteration %d: score %.3f, response length %.1f, %.1fs",
        run.iteration, metrics.get("critic/score/mean", float("nan")),
        metrics.get("response_length/mean", float("nan")), metrics["timing_s/step"],
    )
    return {"results": results, "metrics": metrics}
