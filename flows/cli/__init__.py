"""The ``hybridflow`` command line: argparse and printing only.

Each subcommand is a small module that exposes ``add_arguments(parser)`` and ``run(args) -> int``
and calls the library (the flows, :mod:`flows.services` for starting and stopping what a command
needs, :mod:`flows.eval_plan`, :mod:`flows.export`, ...). Subcommand modules keep heavy imports
inside ``run()``, so ``hybridflow --help`` is fast (no torch, prefect or ray at module top).
Every subcommand parser takes ``key.path=value`` overrides wherever they stand
(:class:`flows.cli.args.OverridesAnywhere`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from flows.cli.args import OverridesAnywhere

# subcommand -> (module with add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flows.cli.train", "run RL training (a Prefect flow on Ray)"),
    "eval": ("flows.cli.eval", "evaluate a model or checkpoint on a dataset"),
    "data": ("hybridflow.data.cli", "write verl-format datasets (gsm8k, arith, countdown)"),
    "export": ("flows.cli.export", "export a checkpoint as a plain Hugging Face model folder"),
    "deploy": ("flows.cli.deploy", "register the Prefect deployments"),
    "bench": ("flows.cli.bench", "run a benchmark from bench/"),
    "node": ("flows.cli.node", "run one dataflow node on a saved iteration"),
    "config": ("flows.cli.config", "show the resolved config"),
    "dataflow": ("flows.cli.dataflow", "show the iteration's nodes, edges and pools for a config"),
}

# commands that run flows: they get -v (Prefect's task-state lines and Ray's worker logs on the console)
VERBOSE_COMMANDS = ("train", "eval")


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
        importlib.import_module(module).add_arguments(p)  # cheap: no heavy imports at their top
    return parser


def error_line(e: BaseException) -> str:
    """``error: <message>`` (a ConfigError's own ``config error: ...`` lines are kept as they are)."""
    text = str(e)
    return text if text.startswith(("error:", "config error:")) else f"error: {text}"


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the subcommand. Returns the exit code:
    0 done, 1 a run that stopped itself (flows.train.TrainingStopped) or failed to write, 2 a bad
    argument or config (one line on stderr), 130/143/129 stopped by SIGINT/SIGTERM/SIGHUP (one line,
    :mod:`flows.signals`, whatever exception the signal became on its way up)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args._command_line = argv is None  # this process is the command itself (it may re-execute itself)
    if args.command in VERBOSE_COMMANDS:
        from flows.console import configure_console_logging

        configure_console_logging(verbose=args.verbose)  # before prefect is imported
    from flows import signals
    from hybridflow.config import ConfigError

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ConfigError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except BaseException as e:  # noqa: BLE001 - a stop signal ends in one line, whatever it became
        stop = signals.stop_reason(e)
        if stop is None:
            return _stopped_or_raise(e)
        print(stop.line(), file=sys.stderr)
        return stop.exit_code


def _stopped_or_raise(e: BaseException) -> int:
    """1 with one line for a run that stopped itself; anything else is raised again."""
    if isinstance(e, Exception):  # a run that stopped itself (flows.train.TrainingStopped): one line, exit 1
        stopped = getattr(sys.modules.get("flows.train"), "TrainingStopped", None)
        if stopped is not None and isinstance(e, stopped):
            print(str(e), file=sys.stderr)
            return 1
    raise e
