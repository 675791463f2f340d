"""Test glue (not in the doc): examples 2 and 3 in one dataflow, so one train run checks both.

`trainer.dataflow=tests.integration.extending.combined:build_dataflow`.
"""

from tests.integration.extending import best_of_n, kl_probe


def build_dataflow(cfg):
    return kl_probe.build_dataflow(cfg, best_of_n.build_dataflow(cfg))
