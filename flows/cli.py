"""The ``hybridflow`` command line.

Subcommands live in small modules that expose ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when their subcommand runs, so
``hybridflow --help`` is fast (no torch, prefect or ray at module top).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# subcommand -> (module with add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flows.cli_train", "run RL training (a Prefect flow on Ray)"),
    "eval": ("flows.cli_eval", "evaluate a model or checkpoint on a dataset"),
    "data": ("hybridflow.data.cli", "write verl-format datasets (gsm8k, arith, countdown)"),
    "export": ("flows.cli_export", "export a checkpoint as a plain Hugging Face model folder"),
    "deploy": ("flows.cli_deploy", "register the Prefect deployments"),
    "bench": ("flows.cli_bench", "run a benchmark from bench/"),
    "node": ("flows.cli_node", "run one dataflow node on a saved iteration"),
    "config": ("flows.cli_config", "show the resolved config"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training for LLMs on Prefect + Ray.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is None:  # subcommand not built yet
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # subcommand modules keep heavy imports inside run(), so importing them here is cheap
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hybridflow.config import ConfigError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a run that stopped itself (flows.train.TrainingStopped): one line, exit 1
        stopped = getattr(sys.modules.get("flows.train"), "TrainingStopped", None)
        if stopped is None or not isinstance(e, stopped):
            raise
        print(str(e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
