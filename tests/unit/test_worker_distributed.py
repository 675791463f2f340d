"""workers/distributed.py + workers/training.py across processes: a 2-rank gloo update equals the
1-rank update (DDP and FSDP2 on CPU), and collectives reduce as documented.

The 2-rank case spawns two fresh processes (torch.multiprocessing, gloo on 127.0.0.1, a free
port) running :func:`tests.unit._dist_case.rank_main`, bounded by a timeout; leftover
processes are killed.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.unit import _dist_case as case
from workers import distributed as D

SPAWN_TIMEOUT_S = 180


def _spawn_two_ranks(out_dir: str) -> None:
    ctx = mp.spawn(case.rank_main, args=(2, D.find_free_port(), out_dir), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"2-rank update did not finish within {SPAWN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def test_two_ranks_update_equals_one_rank(tmp_path):
    single = case.build_model()
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    metrics = case.run_update(single, case.make_batch(), 1)
    _spawn_two_ranks(str(tmp_path))
    for strategy in ("ddp", "fsdp"):
        got = load_file(tmp_path / f"{strategy}_weights.safetensors")
        got_metrics = {k: float(v) for k, v in load_file(tmp_path / f"{strategy}_metrics.safetensors").items()}
        changed = 0
        for name, want in single.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6, msg=f"{strategy}: {name}")
            changed += int(not torch.equal(want, initial[name]))
        assert changed == len(initial)  # every tensor moved
        assert metrics["actor/optimizer_steps"] == got_metrics["actor/optimizer_steps"] == 2.0
        # loss of the whole mini-batch (micro-batch terms summed, ranks averaged): the same number
        assert got_metrics["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], rel=1e-4, abs=1e-6)
        assert got_metrics["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-4)
        # an averaged statistic, over real micro-batches only (the padding pass of rank 1 is not one):
        # 1 rank: 5 micro-batches of 2 rows per epoch → 2.0; 2 ranks: 3 + 2 micro-batches of 2 → 2.0
        assert got_metrics["actor/rows"] == metrics["actor/rows"] == 2.0
        # a maximum is the max over micro-batches and ranks (rank 0, which saved these, holds only 1.88)
        batch = case.make_batch()
        want_max = float((-batch["advantages"])[batch["response_mask"]].max())  # 2.61, on rank 1
        assert got_metrics["actor/neg_adv_max"] == metrics["actor/neg_adv_max"] == pytest.approx(want_max)


def test_collectives_without_process_group_are_identities():
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(D.all_reduce_sum(t), t) and D.all_reduce_sum(t) is not t
    assert torch.equal(D.all_reduce_max(t), t)
    assert D.all_reduce_mean({"b": 2, "a": 1.5}) == {"a": 1.5, "b": 2.0}
    model = torch.nn.Linear(2, 2)
    assert D.wrap_for_training(model, "ddp", 1) is model
    with pytest.raises(ValueError, match="allowed: ddp, fsdp"):
        D.wrap_for_training(model, "zero3", 1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="initialised group"):
        D.wrap_for_training(model, "ddp", 2)
