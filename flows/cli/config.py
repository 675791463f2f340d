"""``hybridflow config show -c FILE [key=value ...]``: print the fully resolved config.

The config is validated and its user code (multi-turn tools / environment) imported and checked
(:func:`hybridflow.agents.checks.check_user_code`): a problem is one line, exit 2."""

from __future__ import annotations

import argparse

from flows.cli.args import add_overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print the resolved config as YAML")
    p.add_argument("-c", "--config", help="YAML config file (defaults when omitted)")
    add_overrides(p)


def run(args: argparse.Namespace) -> int:
    from hybridflow.agents.checks import check_user_code
    from hybridflow.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    check_user_code(cfg)
    print(dump_config(cfg), end="")
    return 0
