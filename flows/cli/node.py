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
import sys
from typing import Any

from flows.cli.args import OverridesAnywhere, add_overrides


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


def print_result(result: dict[str, Any], run_dir: str, iteration: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from flows.node_run import run_metrics

    before = run_metrics(run_dir, iteration)
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

    from flows.node_run import NodeRunError, run_node
    from flows.services import services

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        # no Prefect server (the node's own function runs, not its task); Ray only if the node
        # needs a pool (run_node starts it then), stopped again at exit
        with services(None, prefect=False, reaper=True):
            result = run_node(args.run, args.node, args.iteration, args.overrides, output=args.output,
                              use_debug_inputs=args.use_debug_inputs)
    except (NodeRunError, ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_result(result, args.run, args.iteration)
    return 0
