"""Batches with fewer ``uid`` groups than data-parallel ranks (a small prompts_per_step, the last
validation chunk, a filtered batch) on 2- and 3-rank pools with 1, 2, 3 and 5 groups.

- dispatch: every real row goes to exactly one rank, idle ranks get a marked padding stand-in,
  and the joined result is the input's rows in their order (the stand-ins' results dropped);
- the update loop over real gloo process groups (DDP and FSDP2, spawned processes, bounded in
  time): every rank ends with the 1-rank run's weights and metrics — the stand-in rows, which
  are real-looking copies with True masks, carry no weight.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from hybridflow.batch import Batch, BatchError, is_padding
from tests.unit import _dist_case as base
from tests.unit import _dist_uneven_case as case
from workers import distributed as D
from workers.dispatch import get_dispatch

SPAWN_TIMEOUT_S = 240


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n_groups", case.GROUP_COUNTS)
def test_dp_scatter_pads_idle_ranks_and_join_drops_them(world, n_groups):
    batch = case.make_batch(n_groups)
    batch.set("x", torch.arange(len(batch)))
    proto = get_dispatch("dp_scatter")
    calls, info = proto.split((batch,), {"seed": 1}, world)
    parts = [c[0][0] for c in calls]
    assert len(parts) == world and all(c[1] == {"seed": 1} for c in calls)
    real = [p for p in parts if not is_padding(p)]
    assert len(real) == min(world, n_groups)
    assert [is_padding(p) for p in parts] == [r >= n_groups for r in range(world)]  # rank 0 is always real
    # each real row on exactly one real rank; a stand-in is a whole real group (a copy)
    assert sorted(int(i) for p in real for i in p["x"]) == list(range(len(batch)))
    for p in parts:
        assert len(p) > 0 and all(len(g) == 2 for g in p.groups())
    # fake workers: each rank adds a field; a metrics dict comes from rank 0
    outs = [p.union(Batch.from_dict({"y": p["x"] * 10})) for p in parts]
    joined = proto.join(outs, info)
    assert joined["uid"] == batch["uid"] and torch.equal(joined["y"], batch["x"] * 10)
    assert proto.join([{"rank": r} for r in range(world)], info) == {"rank": 0}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n_prompts", [1, 2, 5])
def test_dp_scatter_join_of_expanded_rows_keeps_prompt_order(world, n_prompts):
    """generate_sequences returns n rows per prompt: the join orders them prompt-major, as one rank does."""
    prompts = Batch.from_dict({"prompt_mask": torch.ones(5, 3, dtype=torch.bool)},
                              {"uid": ["u3", "u0", "u4", "u1", "u2"]}).index(range(n_prompts))
    proto = get_dispatch("dp_scatter")
    calls, info = proto.split((prompts,), {}, world)
    joined = proto.join([c[0][0].repeat_interleave(2) for c in calls], info)
    assert joined["uid"] == prompts.repeat_interleave(2)["uid"]


def test_dp_scatter_without_groups_is_an_error():
    with pytest.raises(BatchError, match="0 groups cannot fill 2 parts"):
        get_dispatch("dp_scatter").split((case.make_batch(0),), {}, 2)


def _spawn(world: int, out_dir: str) -> None:
    ctx = mp.spawn(case.rank_main, args=(world, D.find_free_port(), out_dir), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{world}-rank updates did not finish within {SPAWN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_update_equals_one_rank(world, tmp_path):
    _spawn(world, str(tmp_path))
    for n in case.GROUP_COUNTS:
        single = base.build_model()
        want = case.run_update(single, case.make_batch(n), 1)
        for strategy in ("ddp", "fsdp"):
            for rank in range(world):
                got = load_file(tmp_path / f"{strategy}_{n}_rank{rank}.safetensors")
                where = f"{strategy}, {n} groups, rank {rank}/{world}"
                for name, value in single.state_dict().items():
                    torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=f"{where}: {name}")
                for key in ("actor/pg_loss", "actor/grad_norm", "actor/rows", "actor/optimizer_steps"):
                    assert float(got[f"metric/{key}"]) == pytest.approx(want[key], rel=1e-4, abs=1e-6), (where, key)
