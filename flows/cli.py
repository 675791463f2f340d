"""The ``hybridflow`` command line.

Subcommands live in small modules that expose ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when their subcommand runs, so
``hybridflow --help`` is fast (no torch, prefect or ray at module top).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
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


# commands that run flows: they get -v (Prefect's task-state lines and Ray's worker logs on the console)
VERBOSE_COMMANDS = ("train", "eval")
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")


class OverridesAnywhere(argparse.ArgumentParser):
    """A subcommand parser that takes ``key.path=value`` overrides wherever they stand.

    argparse fills a trailing ``overrides`` positional (nargs="*") together with the positional
    before it, so in ``config show -c FILE actor.lr=3e-6`` the override after ``-c FILE`` would be
    "unrecognized"; here such leftovers are appended to ``overrides`` instead."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        ns, extras = super().parse_known_args(args, namespace)
        if hasattr(ns, "overrides"):
            ns.overrides = list(ns.overrides or []) + [a for a in extras if _OVERRIDE.match(a)]
            extras = [a for a in extras if not _OVERRIDE.match(a)]
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training for LLMs on Prefect + Ray.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OverridesAnywhere)
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is None:  # subcommand not built yet
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, verbose=False)
        if name in VERBOSE_COMMANDS:
            p.add_argument("-v", "--verbose", action="store_true",
                           help="also print Prefect's flow/task-run log lines and Ray's worker logs")
        # subcommand modules keep heavy imports inside run(), so importing them here is cheap
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in VERBOSE_COMMANDS:
        from flows.console import configure_console_logging

        configure_console_logging(verbose=args.verbose)  # before prefect is imported
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
