"""``hybridflow node run NODE --run RUN_DIR --iteration N [key=value ...]``: debug one dataflow node.

Runs one node of the run's dataflow (the built-in one, or ``trainer.dataflow``) on the saved
inputs of iteration N — the upstream outputs in ``RUN_DIR/iter_00000N/`` — under the run's
config plus the overrides (e.g. ``reward.function=my_reward.py:compute_score``), and prints its
metrics next to the run's own values. The node's own function is called (the body of its
Prefect task); only the pool(s) that node needs are started, in a namespace of their own, so a
live training run is not disturbed (``reward`` → a reward pool, ``reference`` → a reference
pool, ``advantage`` / ``filter_groups`` → none, not even Ray). The output is written as
``iter_00000N/<node>.debug`` (or ``--output NAME``): the run's files, execution log and cache
are untouched. No Prefect server is needed.

Not runnable here: ``rollout`` and ``values`` (their output depends on the policy / critic
weights at that iteration, which a checkpoint holds only every ``save_every``), and the update
and checkpoint nodes (they change the run's weights).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
import typing
import uuid
from pathlib import Path
from typing import Any

from flows.cli.args import OverridesAnywhere, add_overrides

# roles whose pools a node calls; a node not listed calls none
NODE_ROLES: dict[str, tuple[str, ...]] = {"reward": ("reward",), "reference": ("reference",)}
NOT_RUNNABLE: dict[str, str] = {
    "rollout": "its output depends on the policy weights at that iteration",
    "values": "its output depends on the critic weights at that iteration",
    "update_policy": "it changes the run's policy weights",
    "update_critic": "it changes the run's critic weights",
    "checkpoint": "it writes the run's checkpoints",
}
DEBUG_POOL = "node-debug"


class NodeRunError(ValueError):
    """The node cannot be run on that iteration (names the node, the iteration and why)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="node_command", required=True, metavar="ACTION", parser_class=OverridesAnywhere)
    r = sub.add_parser("run", help="run one node on the saved inputs of an iteration",
                       description="run one node on the saved inputs of an iteration")
    r.add_argument("node", metavar="NODE", help="node name, e.g. reward, reference, advantage, filter_groups")
    r.add_argument("--run", required=True, metavar="RUN_DIR", help="the run directory (runs/<run_id>)")
    r.add_argument("--iteration", "-i", required=True, type=int, metavar="N", help="iteration whose inputs to use")
    r.add_argument("--output", default=None, metavar="NAME", help="output name in iter_N/ (default: <node>.debug)")
    r.add_argument("--use-debug-inputs", action="store_true",
                   help="read an upstream <node>.debug output instead of the run's, where one exists")
    add_overrides(r, "reward.function=my_reward.py:score")


# ---- inputs ----------------------------------------------------------------------------------


def _iterations(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in run_dir.glob("iter_*") if p.name[5:].isdigit())


def _saved_uri(run: Any, name: str, use_debug: bool) -> str | None:
    for candidate in ([f"{name}.debug"] if use_debug else []) + [name]:
        if Path(f"{run.batch_uri(candidate)}.safetensors").is_file():
            return run.batch_uri(candidate)
    return None


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
    path = run_dir / "metrics.jsonl"
    value = None
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        if rec["iteration"] == iteration - 1 and "critic/kl_coef_next" in rec["metrics"]:
            value = rec["metrics"]["critic/kl_coef_next"]
    return value


def gather_inputs(df: Any, name: str, run: Any, cfg: Any, *, use_debug: bool) -> dict[str, Any]:
    """The node's arguments from iteration ``run.iteration``'s saved outputs, wired as the
    DataFlow wires them: a ``Batch`` parameter gets the loaded batch, any other a NodeResult.
    Raises NodeRunError naming the missing file."""
    from hybridflow.batch import Batch

    node = df.node(name)
    hints = _hints(node.fn)
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
                f"run `hybridflow node run {source} ...` first and pass --use-debug-inputs")
        result, batch = load_saved(uri, source, run)
        kwargs[param] = batch if hints.get(param) in (Batch, Batch | None) else result
    return kwargs


def _hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolved user annotations: treat as NodeResult
        return {}


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


def _start_pool(cfg: Any, namespace: str) -> Any:
    from flows.runtime import ensure_ray
    from workers.pool import create_pool

    ensure_ray(cfg)
    return create_pool(cfg, DEBUG_POOL, namespace=namespace, ckpt_root=None)


def _stop_pool(pool: Any) -> None:
    from workers.pool import destroy_pool

    if "reward" in pool.roles:
        try:
            pool.role("reward").close(timeout_s=30)
        except Exception:  # noqa: BLE001 - best effort before the actor is killed
            pass
    destroy_pool(pool)


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
             output: str | None = None, use_debug_inputs: bool = False) -> dict[str, Any]:
    """Run node ``name`` on iteration ``iteration`` of ``run_dir``; returns its NodeResult
    ({"node", "ref" (the saved ``<node>.debug`` batch or None), "metrics"}).
    Raises NodeRunError (unknown / not runnable node, missing iteration or input), ConfigError."""
    from flows.iteration import build_dataflow
    from hybridflow.config import load_config
    from tasks.common import RunContext
    from tasks.node import TIMING_NAMES
    from workers.pool import namespace_for

    root = Path(run_dir).resolve()
    if not (root / "config.yaml").is_file():
        raise NodeRunError(f"{run_dir!r} is not a run directory (no config.yaml)")
    cfg = load_config(root / "config.yaml", overrides)
    if not (root / f"iter_{iteration:06d}").is_dir():
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
    roles = NODE_ROLES.get(name, ())
    run_cfg = isolate_roles(cfg, roles) if roles else cfg
    namespace = namespace_for(f"{root.name}-node-{name}-{uuid.uuid4().hex[:6]}")
    run = RunContext(root.name, str(root), iteration, namespace, cfg.trainer.seed, run_cfg.model_dump(mode="json"))
    inputs = gather_inputs(df, name, run, cfg, use_debug=use_debug_inputs)
    pool = _start_pool(run_cfg, namespace) if roles else None
    try:
        start = time.perf_counter()
        result = _save_output(run, output, df.node(name).fn(run, **inputs))
        return result.with_metrics({f"timing_s/{TIMING_NAMES.get(name, name)}": time.perf_counter() - start})
    finally:
        if pool is not None:
            _stop_pool(pool)


def _run_metrics(run_dir: str, iteration: int) -> dict[str, float]:
    path = Path(run_dir) / "metrics.jsonl"
    out: dict[str, float] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        if rec["iteration"] == iteration:
            out = rec["metrics"]
    return out


def print_result(result: dict[str, Any], run_dir: str, iteration: int) -> None:
    from rich.console import Console
    from rich.table import Table

    before = _run_metrics(run_dir, iteration)
    table = Table(title=f"{result.node} on iteration {iteration}")
    for col in ("metric", "this run", "in the run"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for k, v in sorted(result.metrics.items()):
        table.add_row(k, f"{v:.6g}", f"{before[k]:.6g}" if k in before else "")
    console = Console()
    console.print(table)
    if result.ref is not None:
        console.print(f"output: {result.ref.uri}.safetensors (+ .json), {result.ref.rows} rows")


def run(args: argparse.Namespace) -> int:
    import os

    from flows.services import services

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        # no Prefect server (the node's own function runs, not its task); Ray only if the node
        # needs a pool (run_node starts it then), stopped again at exit
        with services(None, prefect=False):
            result = run_node(args.run, args.node, args.iteration, args.overrides, output=args.output,
                              use_debug_inputs=args.use_debug_inputs)
    except (NodeRunError, ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_result(result, args.run, args.iteration)
    return 0
