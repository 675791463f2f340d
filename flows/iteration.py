"""One RL iteration as a Prefect flow (a subflow ``iteration-000007`` of the train flow run).

The built-in dataflow, as :func:`builtin_dataflow` declares it (``hybridflow dataflow show -c
CONFIG`` prints it for a config, with the pool each node calls)::

    prompts ─► rollout ─► reward ‖ reference ‖ values ─► advantage ─► update_critic ‖ update_policy
    with a rollout pool (trainer.max_staleness): the driver runs rollout ahead, and the iteration is
               rollout ─► old_log_probs ‖ reward ─► reference ‖ values ─► advantage ─► update_* ─► publish_weights
    with algorithm.filter_groups:  rollout ─► reward ─► filter_groups ─► reference ‖ values ─► advantage ─► ...
    with reward.judge:             rollout ─► judge ─► reward ─► ...   (the judge pool's verdicts, combined)

Nodes switch off by config (no reference without KL, no values/update_critic without a critic,
filter_groups only with ``algorithm.filter_groups``, judge only with ``reward.judge.enable``); a user
DataFlow replaces the built-in one with ``trainer.dataflow`` ("module:function(cfg) -> DataFlow",
usually ``builtin_dataflow(cfg)`` plus :meth:`~flows.dataflow.DataFlow.add` / ``rewire``).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prefect import flow, get_run_logger

from flows.dataflow import DataFlow, DataFlowError
from hybridflow.config import ConfigError, ExperimentConfig
from hybridflow.deprecation import warn_deprecated
from tasks.advantage import advantage
from tasks.common import RunContext
from tasks.filter_groups import filter_groups
from tasks.judge import judge
from tasks.reference import reference
from tasks.reward import reward
from tasks.rollout import old_log_probs, rollout
from tasks.types import AdvantageResult, NodeResult
from tasks.update import update_critic, update_policy
from tasks.values import values
from tasks.weight_sync import publish_weights


def flow_inputs(cfg: ExperimentConfig) -> tuple[str, ...]:
    """What the driver passes into each iteration: the prompts' NodeResult (with a separate rollout
    pool: the rollout's RolloutResult instead, generated ahead by the driver), the KL controller's
    β, and the weights versions the trained roles must be at."""
    first = "rollout" if cfg.uses_rollout_pool else "prompts"
    return (first, "kl_coef", "policy_version") + (("critic_version",) if cfg.needs_critic else ())


def flow_input_values(cfg: ExperimentConfig, first: NodeResult, trainer: Any) -> dict[str, Any]:
    """The iteration's inputs by :func:`flow_inputs`' names: ``first`` (what the driver's feed
    took: the prompts' NodeResult, or the RolloutResult generated ahead), and from ``trainer``
    (a :class:`flows.trainer_state.TrainerState`) ``kl_coef`` and the weights versions."""
    values = {"kl_coef": trainer.kl_coef, "policy_version": trainer.policy_version,
              "critic_version": trainer.critic_version}
    names = flow_inputs(cfg)
    return {names[0]: first, **{name: values[name] for name in names[1:]}}


def builtin_dataflow(cfg: ExperimentConfig) -> DataFlow:
    """The iteration's nodes for ``cfg``, their edges written where they take effect."""
    # asynchronous: the rollout is a flow input (the driver runs it ahead on the rollout pool) and
    # old_log_probs recomputes the trainer's log-probs of it; the nodes after read those
    trajectories = "old_log_probs" if cfg.uses_rollout_pool else "rollout"
    # DAPO dynamic sampling: every node after the filter reads the kept groups, not all of them
    kept = "filter_groups" if cfg.algorithm.filter_groups else trajectories
    nodes = [
        None if cfg.uses_rollout_pool else rollout,        # (prompts, policy_version) -> trajectories
        old_log_probs if cfg.uses_rollout_pool else None,  # (rollout, policy_version) -> + old_log_probs
        judge if cfg.reward.judge.enable else None,        # (rollout) -> judge_score
        reward,                                            # (rollout, judge) -> token_level_scores
        filter_groups.wire(rollout=trajectories) if cfg.algorithm.filter_groups else None,  # -> kept groups
        reference.wire(rollout=kept) if cfg.needs_reference else None,   # -> ref_log_probs
        values.wire(rollout=kept) if cfg.needs_critic else None,         # (+ critic_version) -> values
        advantage.wire(rollout=kept, reward="filter_groups" if cfg.algorithm.filter_groups else "reward"),
        update_critic if cfg.needs_critic else None,       # (advantage, critic_version)
        update_policy,                                     # (advantage, policy_version)
        publish_weights if cfg.uses_rollout_pool else None,  # (update_policy) -> weights to the rollout pool
    ]
    return DataFlow([n for n in nodes if n is not None], inputs=flow_inputs(cfg))


def builtin_nodes(cfg: ExperimentConfig) -> list:
    """The built-in dataflow's nodes (deprecated: FutureWarning, removed in 0.3.0; use
    ``builtin_dataflow(cfg)`` and edit it with ``rewire``/``without``, or its ``.nodes``)."""
    warn_deprecated("flows.iteration.builtin_nodes(cfg)", "flows.iteration.builtin_dataflow(cfg) (its .nodes)")
    return builtin_dataflow(cfg).nodes


def build_dataflow(cfg: ExperimentConfig) -> DataFlow:
    """The iteration's DataFlow: ``trainer.dataflow`` ("module:function(cfg) -> DataFlow") or the
    built-in one. Raises ConfigError naming ``trainer.dataflow`` when the factory cannot be
    imported, does not return a DataFlow, or its graph is not runnable (DataFlowError's message)."""
    spec = cfg.trainer.dataflow
    if not spec:
        return builtin_dataflow(cfg)
    module, _, attr = spec.partition(":")
    where = f"trainer.dataflow={spec}"
    if not module or not attr:
        raise ConfigError(f"config error: {where}: expected 'module:function'")
    try:
        for plugin in cfg.trainer.plugins:  # the factory's nodes may live in a plugin
            importlib.import_module(plugin)
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config error: {where}: {type(e).__name__}: {e}") from None
    try:
        flow = factory(cfg)
    except (DataFlowError, ValueError, TypeError) as e:  # DataFlowError; rewire/wire of a missing parameter
        raise ConfigError(f"config error: {where}: {e}") from None
    if not isinstance(flow, DataFlow):
        raise ConfigError(f"config error: {where} returned {type(flow).__name__}, not a DataFlow")
    return flow


@dataclass
class IterationResult:
    """What one iteration gives the driver: each node's result and the iteration's metrics (the
    nodes' merged, plus ``timing_s/step`` and throughput)."""

    results: dict[str, NodeResult]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def kl_coef_next(self) -> float | None:
        """The advantage node's β for the next iteration (None: no advantage result carries one)."""
        adv = self.results.get("advantage")
        return adv.kl_coef_next if isinstance(adv, AdvantageResult) else None


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


_NO_HEARTBEAT: list[Any] = []  # [(settings seen, the same settings without flow heartbeats)]


@contextmanager
def without_flow_heartbeats() -> Iterator[None]:
    """Prefect settings with ``flows.heartbeat_frequency`` unset, for the flow runs started inside.

    Every flow run, subflows included, starts a heartbeat thread that sleeps in 1 s steps, and the
    engine joins it when the run ends (``prefect.flow_engine._send_heartbeats``, prefect 3.9): each
    iteration subflow waited ~0.5 s for that sleep to finish, a quarter of the iteration's
    orchestration cost at the demo's settings. The iteration is a subflow of the train flow run,
    whose own heartbeat keeps reporting that the run is alive, so the subflow's is not needed.
    The copy changes that one field and nothing else: Prefect's ``Settings.copy_with_update``
    re-validates, which re-reads the environment for every setting not set explicitly (a
    ``PREFECT_API_URL`` exported after the base settings were built would point the subflows at
    another API than their parent), so the copy is a pydantic ``model_copy``. It is built once per
    base settings."""
    from prefect.context import SettingsContext, get_settings_context

    ctx = get_settings_context()
    if ctx.settings.flows.heartbeat_frequency is None:
        yield
        return
    if not _NO_HEARTBEAT or _NO_HEARTBEAT[0][0] is not ctx.settings:
        flows = ctx.settings.flows.model_copy(update={"heartbeat_frequency": None})
        _NO_HEARTBEAT[:] = [(ctx.settings, ctx.settings.model_copy(update={"flows": flows}))]
    with SettingsContext(profile=ctx.profile, settings=_NO_HEARTBEAT[0][1]):
        yield


def call_iteration(iteration_flow: Any, run: RunContext, inputs: dict[str, Any]) -> IterationResult:
    """Call the iteration flow (``iteration`` or its ``with_options`` copy) for ``run.iteration``
    without a flow-run heartbeat of its own (see :func:`without_flow_heartbeats`)."""
    with without_flow_heartbeats():
        return iteration_flow(run=run, inputs=inputs)


@flow(name="iteration", flow_run_name="iteration-{run.iteration:06d}", persist_result=False, log_prints=True)
def iteration(run: RunContext, inputs: dict[str, Any]) -> IterationResult:
    """Run one iteration. ``inputs`` = the flow inputs (prompts NodeResult, kl_coef, versions)."""
    cfg = run.cfg()
    start = time.perf_counter()
    futures = _submit_all(build_dataflow(cfg), run, cfg, inputs)
    results: dict[str, NodeResult] = {name: NodeResult.of(fut.result()) for name, fut in futures.items()}
    metrics: dict[str, float] = {}
    for res in results.values():
        metrics.update(res.metrics)
    metrics["timing_s/step"] = time.perf_counter() - start
    metrics.update(_throughput(cfg, metrics))
    get_run_logger().info(
        "iteration %d: score %.3f, response length %.1f, %.1fs",
        run.iteration, metrics.get("critic/score/mean", float("nan")),
        metrics.get("response_length/mean", float("nan")), metrics["timing_s/step"],
    )
    return IterationResult(results, metrics)
