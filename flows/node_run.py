"""Running one dataflow node on an iteration's saved inputs (``hybridflow node run``).

The node's own function is called (the body of its Prefect task) with its inputs wired exactly as
the run's dataflow wires them (:attr:`flows.dataflow.DataFlow.wiring`; ``Batch`` parameters,
:attr:`tasks.node.Node.batch_inputs`, get the loaded batch, others the NodeResult). Only the pools
of the roles the node declares (``@node(roles=...)``) start, as one single-rank pool in a
namespace of its own, so a live training run is not disturbed; a node that declares none needs
no pool, not even Ray. The output is written as ``iter_<N>/<node>.debug`` (or ``output``): the
run's files, execution log and cache are untouched.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from pathlib import Path
from typing import Any

from flows.run_dir import RunDir
from hybridflow.layout import ITERATION_PREFIX, iteration_of

NOT_RUNNABLE: dict[str, str] = {
    "rollout": "its output depends on the policy weights at that iteration",
    "values": "its output depends on the critic weights at that iteration",
    "update_policy": "it changes the run's policy weights",
    "update_critic": "it changes the run's critic weights",
    "publish_weights": "it sends the policy's weights to the run's rollout pool",
    "checkpoint": "it writes the run's checkpoints",
}
DEBUG_POOL = "node-debug"


class NodeRunError(ValueError):
    """The node cannot be run on that iteration (names the node, the iteration and why)."""


# ---- inputs ----------------------------------------------------------------------------------


def _iterations(run_dir: Path) -> list[int]:
    return sorted(it for p in run_dir.glob(f"{ITERATION_PREFIX}*") if (it := iteration_of(p.name)) is not None)


def _saved_uri(run: Any, name: str, use_debug: bool) -> str | None:
    for candidate in ([f"{name}.debug"] if use_debug else []) + [name]:
        if Path(f"{run.batch_uri(candidate)}.safetensors").is_file():
            return run.batch_uri(candidate)
    return None


def _missing_input_advice(run: Any, source: str) -> str:
    """What to do about a missing upstream output: run that node first where ``node run`` can,
    else pick an iteration that saved it (``node run`` refuses ``rollout``, ``values``, ...)."""
    if source not in NOT_RUNNABLE:
        return f"run `hybridflow node run {source} ...` first and pass --use-debug-inputs"
    root = Path(run.run_dir)
    saved = [it for it in _iterations(root) if _saved_uri(run.with_iteration(it), source, False)]
    where = f"iterations with a saved {source!r}: {', '.join(map(str, saved))}" if saved else \
        f"no iteration of this run saved {source!r}"
    return f"`node run {source}` cannot make it ({NOT_RUNNABLE[source]}); pass --iteration N of a trained iteration ({where})"


def load_saved(uri: str, name: str, run: Any) -> tuple[Any, Any]:
    """(NodeResult, Batch) of a batch saved by Batch.save (checksum = sha256(tensors ‖ 0 ‖ json), as there)."""
    from hybridflow.batch import Batch, BatchRef

    tensor_bytes, json_bytes = Path(f"{uri}.safetensors").read_bytes(), Path(f"{uri}.json").read_bytes()
    checksum = hashlib.sha256(tensor_bytes + b"\0" + json_bytes).hexdigest()
    batch = Batch.load(uri, expected_checksum=checksum)  # verifies the files did not change between reads
    ref = BatchRef(run.run_id, run.iteration, name, uri, len(batch), tuple(batch.keys()), checksum)
    from tasks.types import NodeResult

    return NodeResult(node=name, ref=ref), batch


def _kl_coef(run_dir: Path, iteration: int, cfg: Any) -> float | None:
    """β the run used at ``iteration``: the adaptive controller's value after iteration − 1
    (metrics.jsonl ``critic/kl_coef_next``); None (= the config's) for the fixed controller."""
    if cfg.algorithm.kl_ctrl.type == "fixed":
        return None
    return RunDir(run_dir).metrics_history().get(iteration - 1, {}).get("critic/kl_coef_next")


def gather_inputs(df: Any, name: str, run: Any, cfg: Any, *, use_debug: bool) -> dict[str, Any]:
    """The node's arguments from iteration ``run.iteration``'s saved outputs, wired as the
    DataFlow wires them: a ``Batch`` parameter gets the loaded batch, any other a NodeResult.
    Raises NodeRunError naming the missing file."""
    node = df.node(name)
    kwargs: dict[str, Any] = {}
    for param, src in df.wiring[name].items():
        if src is None:
            continue
        if src == "input:kl_coef":
            value = _kl_coef(Path(run.run_dir), run.iteration, cfg)
            if value is not None:
                kwargs[param] = value
            continue
        source = src.removeprefix("input:")
        if src.startswith("input:") and source != "prompts":
            raise NodeRunError(f"node {name!r}: flow input {source!r} is not saved with an iteration")
        uri = _saved_uri(run, source, use_debug)
        if uri is None:
            raise NodeRunError(
                f"node {name!r} needs {param!r}, but iteration {run.iteration} has no saved output of "
                f"{source!r} ({run.batch_uri(source)}.safetensors): it did not run in that iteration; "
                + _missing_input_advice(run, source))
        result, batch = load_saved(uri, source, run)
        kwargs[param] = batch if param in node.batch_inputs else result
    return kwargs


# ---- pools -----------------------------------------------------------------------------------


def isolate_roles(cfg: Any, roles: tuple[str, ...]) -> Any:
    """``cfg`` with ``roles`` moved into one single-rank pool ``node-debug`` (sized like the pool
    they came from), so only that pool has to start. The other pools stay in the config (it
    must stay valid) but are never created."""
    from hybridflow.config import config_from_dict

    d = cfg.model_dump(mode="json")
    pools = d["placement"]["pools"]
    origin = next(p for p in pools.values() if roles[0] in p["roles"])
    for name in list(pools):
        pools[name]["roles"] = [r for r in pools[name]["roles"] if r not in roles]
        if not pools[name]["roles"]:
            del pools[name]
    pools[DEBUG_POOL] = {**origin, "workers": 1, "roles": list(roles)}
    return config_from_dict(d)


# ---- running ---------------------------------------------------------------------------------


def _save_output(run: Any, output: str, out: Any) -> Any:
    """Save what the node returned (Batch / (Batch, metrics) / metrics / NodeResult) as ``output``."""
    from tasks.node import save_output

    result, logs = save_output(run, output, out)
    for line in logs:
        print(f"[worker] {line}")
    return result


def _check_output_name(output: str, df: Any) -> None:
    """The output must be a plain file name that is not one of the run's own outputs."""
    taken = {n.name for n in df.nodes} | {"prompts", "val_prompts", "validate"}
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", output) or output in taken or output.startswith("."):
        raise NodeRunError(f"--output {output!r}: give a plain name that is not one of the run's outputs "
                           f"({', '.join(sorted(taken))}), e.g. reward.debug")


def run_node(run_dir: str, name: str, iteration: int, overrides: list[str] | None = None, *,
             output: str | None = None, use_debug_inputs: bool = False) -> Any:
    """Run node ``name`` on iteration ``iteration`` of ``run_dir``; returns its NodeResult
    (``ref``: the saved ``<node>.debug`` batch, or None).
    Raises NodeRunError (unknown / not runnable node, missing iteration or input), ConfigError."""
    from flows.iteration import build_dataflow
    from flows.run_pools import open_pools
    from hybridflow.config import load_config
    from hybridflow.metric_names import node_time_metric
    from tasks.common import RunContext
    from workers.pool import namespace_for

    root = Path(run_dir).resolve()
    folder = RunDir(root)
    if not Path(folder.config_file).is_file():
        raise NodeRunError(f"{run_dir!r} is not a run directory (no config.yaml)")
    cfg = load_config(folder.config_file, overrides)
    if not Path(folder.iter_dir(iteration)).is_dir():
        its = _iterations(root)
        raise NodeRunError(f"run {root.name} has no iteration {iteration}; saved iterations: "
                           f"{', '.join(map(str, its)) or 'none'}")
    df = build_dataflow(cfg)
    if name in NOT_RUNNABLE:
        raise NodeRunError(f"node {name!r} cannot be run on saved inputs: {NOT_RUNNABLE[name]}")
    if name not in [n.name for n in df.nodes]:
        raise NodeRunError(f"no node {name!r} in this run's dataflow; nodes: {', '.join(n.name for n in df.nodes)}")
    output = output or f"{name}.debug"
    _check_output_name(output, df)
    roles = df.node(name).roles
    run_cfg = isolate_roles(cfg, roles) if roles else cfg
    namespace = namespace_for(f"{root.name}-node-{name}-{uuid.uuid4().hex[:6]}")
    run = RunContext(root.name, str(root), iteration, namespace, cfg.trainer.seed, run_cfg.model_dump(mode="json"))
    inputs = gather_inputs(df, name, run, cfg, use_debug=use_debug_inputs)
    if roles:  # a pool will load the model: its files first (flows/preflight_inputs.py)
        from flows.preflight_inputs import check_inputs

        check_inputs(run_cfg, data_files=[], checkpoints=False, prefect=False)
    with open_pools(run_cfg, roles, namespace=namespace):  # only node-debug holds the roles; none: no Ray
        start = time.perf_counter()
        result = _save_output(run, output, df.node(name).fn(run, **inputs))
        return result.with_metrics({node_time_metric(name): time.perf_counter() - start})


def run_metrics(run_dir: str, iteration: int) -> dict[str, float]:
    return RunDir(run_dir).metrics_history().get(iteration, {})


