"""PolicyWorker on two gloo ranks with FSDP2 (spawned processes, bounded in time) equals one rank;
the FSDP2 rollout copy is synced after the update, and an FSDP2 checkpoint restores the weights.
The same for the critic (update with a fixed target, checkpoint round trip)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.unit import _dist_policy_case as case
from tests.unit._worker_helpers import prompt_batch, with_advantages
from workers import distributed as D
from workers.critic import CriticWorker
from workers.policy import PolicyWorker

SPAWN_TIMEOUT_S = 300


def test_two_rank_fsdp_policy_update_equals_one_rank(tmp_path):
    single = PolicyWorker(case.cfg_for("ddp"))
    prompts = prompt_batch(single.tokenizer, ("1+1=", "22+3=", "7*6="))
    batch = with_advantages(single.compute_log_probs(single.generate_sequences(prompts, seed=5)))
    batch.save(str(tmp_path / "batch"))
    metrics = single.update_policy(batch, expected_version=0, batch_id="b0")
    want = {k: v.detach() for k, v in single.module.state_dict().items()}
    critic = CriticWorker(case.cfg_for("ddp", "algorithm.adv_estimator=gae"))
    critic.update_critic(case.critic_batch(batch), expected_version=0, batch_id="c0")
    want_critic = {k: v.detach() for k, v in critic.module.state_dict().items()}

    ctx = mp.spawn(case.rank_main, args=(2, D.find_free_port(), str(tmp_path / "batch"), str(tmp_path)),
                   nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"2-rank policy update did not finish within {SPAWN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()

    for strategy, prefixes in (("fsdp", ["w/", "rollout/", "reloaded/"]),):
        got = load_file(tmp_path / f"{strategy}.safetensors")
        for prefix in prefixes:
            for name, value in want.items():
                torch.testing.assert_close(got[prefix + name], value, rtol=1e-4, atol=1e-6,
                                           msg=f"{strategy} {prefix}{name}")
        assert float(got["metric/pg_loss"]) == pytest.approx(metrics["actor/pg_loss"], rel=1e-4, abs=1e-6)
        if strategy == "fsdp":
            assert float(got["metric/reloaded_version"]) == 1.0
            for name in want:  # the checkpoint restores the saved weights bit for bit
                assert torch.equal(got["reloaded/" + name], got["w/" + name]), name
            for name, value in want_critic.items():
                torch.testing.assert_close(got["critic/" + name], value, rtol=1e-4, atol=1e-6, msg=name)
                assert torch.equal(got["critic_reloaded/" + name], got["critic/" + name]), name
