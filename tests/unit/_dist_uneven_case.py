"""Helper for test_uneven_batches.py: what each spawned rank runs (pure torch, starts fast).

Every rank takes its share of a batch of ``n`` groups from the ``dp_scatter`` protocol — a
padding stand-in when there are fewer groups than ranks — and runs the update loop on it;
each rank saves its weights and metrics, so the test compares every rank with a 1-rank run.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from hybridflow.batch import Batch
from tests.unit import _dist_case as case
from workers import distributed as D
from workers.dispatch import get_dispatch
from workers.training import Optimization

GROUP_COUNTS = (1, 2, 3, 5)


def make_batch(n_groups: int) -> Batch:
    """The first ``n_groups`` groups (2 rows each, uneven lengths) of the 10-row test batch."""
    return case.make_batch().index(range(2 * n_groups))


def run_update(model, batch: Batch, world_size: int) -> dict[str, float]:
    """One mini-batch of every row (so the split between ranks cannot change the steps), micro-batches
    of 2, two epochs."""
    opt = Optimization(model, case.SETTINGS, world_size=world_size)
    return opt.update(batch, case.loss_fn, mini_batch_trajectories=100, micro_batch_trajectories=2, epochs=2,
                      loss_agg_mode="token-mean", max_response_tokens=5)


def rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    D.init_process_group(rank, world, master_port=port)
    for strategy in ("ddp", "fsdp"):
        for n in GROUP_COUNTS:
            calls, _ = get_dispatch("dp_scatter").split((make_batch(n),), {}, world)
            part = calls[rank][0][0]
            model = D.wrap_for_training(case.build_model(), strategy, world)
            metrics = run_update(model, part, world)
            state = D.full_model_state_dict(model)
            save_file(state | {f"metric/{k}": torch.tensor(v) for k, v in metrics.items()},
                      f"{out_dir}/{strategy}_{n}_rank{rank}.safetensors")
    case.end_rank()
