"""``hybridflow dataflow show -c FILE [key=value ...]``: the iteration's nodes, their edges and pools."""

from __future__ import annotations

import argparse

from flows.cli.args import add_overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show"], help="show: print the nodes in run order, each input's source "
                   "and the pool each node calls")
    p.add_argument("-c", "--config", help="YAML config file (defaults when omitted)")
    add_overrides(p)


def run(args: argparse.Namespace) -> int:
    from flows.iteration import build_dataflow
    from hybridflow.config import load_config

    cfg = load_config(args.config, args.overrides)
    pools = {role: name for name, p in cfg.placement.pools.items() for role in p.roles}
    if cfg.async_mode == "stream":  # the train flow's take_groups task makes the flow input rollout
        from flows.stream_feed import max_inflight_groups

        print(f"train flow, before each iteration (trainer.async_mode=stream, up to {max_inflight_groups(cfg)} groups "
              f"generating continuously, {cfg.trainer.stream_order} order, max_staleness={cfg.trainer.max_staleness} "
              f"per token): take_groups(groups in flight, policy_version) -> rollout  calls rollout @ pool "
              f"{pools['rollout']}")
    elif cfg.uses_rollout_pool:  # asynchronous: the train flow's generate_ahead task makes the flow input rollout
        print(f"train flow, ahead of each iteration (trainer.max_staleness={cfg.trainer.max_staleness}, up to "
              f"{cfg.trainer.max_staleness + 1} in flight): generate_ahead(prompts, policy_version) -> rollout  "
              f"calls rollout @ pool {pools['rollout']}")
    print(build_dataflow(cfg).describe(pools))
    return 0
