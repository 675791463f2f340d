"""Pools on a real local Ray: created and looked up by name, dispatch by protocol, and data
parallelism inside a pool — a 2-rank pool (gloo DDP across two Ray actors) applies the same update
as a 1-rank pool on the same batch."""

from __future__ import annotations

import pytest
import torch

from tests.unit._worker_helpers import prompt_batch, tiny_cfg, with_advantages

pytestmark = pytest.mark.integration


def _pool(name: str, workers: int, namespace: str):
    from workers.pool import create_pool, get_pool

    cfg = tiny_cfg(
        f"placement.pools.main.workers={workers}", "placement.pools.main.cpus_per_worker=0.5",
        "data.prompts_per_iteration=4", "actor.mini_batch_trajectories=8",
        "placement.pools.main.roles=[policy]", "placement.pools.reward.cpus_per_worker=0.25",
        "placement.pools.main.strategy=ddp", "trainer.device=cpu",
    )
    pool = create_pool(cfg, "main", namespace=namespace, ckpt_root=None)
    assert get_pool("main", namespace).world_size == workers  # looked up by name
    return cfg, pool


def test_two_rank_pool_equals_one_rank_pool(ray_cluster, tmp_path):
    from hybridflow.models import load_tokenizer
    from workers.checkpoint import read_safetensors_folder
    from workers.pool import destroy_pool

    cfg, one = _pool("main", 1, "pools-test-1")
    try:
        prompts = prompt_batch(load_tokenizer(cfg.model), ("1+1=", "22+3=", "7-2=", "9+9="))
        batch = one.role("policy").generate_sequences(prompts, seed=3)
        batch = one.role("policy").compute_log_probs(batch)
        batch = with_advantages(batch)
        m1 = one.role("policy").update_policy(batch, expected_version=0, batch_id="b0")
        one.role("policy").save_checkpoint(str(tmp_path / "one"))
        assert one.role("policy").get_weights_version() == [1]
        # one prompt (1 group) next: fewer groups than the 2-rank pool has ranks
        small = with_advantages(one.role("policy").compute_log_probs(one.role("policy").generate_sequences(
            prompt_batch(load_tokenizer(cfg.model), ("7*6=",)), seed=4)))
        s1 = one.role("policy").update_policy(small, expected_version=1, batch_id="b1")
        one.role("policy").save_checkpoint(str(tmp_path / "one_small"))
    finally:
        destroy_pool(one)

    _, two = _pool("main", 2, "pools-test-2")
    try:
        assert len(set(two.pids())) == 2  # two processes, one per rank
        m2 = two.role("policy").update_policy(batch, expected_version=0, batch_id="b0")
        two.role("policy").save_checkpoint(str(tmp_path / "two"))
        assert two.role("policy").get_weights_version() == [1, 1]
        again = two.role("policy").update_policy(batch, expected_version=0, batch_id="b0")
        assert again == m2  # exactly-once: the repeat returns the recorded metrics
        # 1 group on 2 ranks: rank 1 gets a zero-weight stand-in; results hold the real rows only
        gen = two.role("policy").generate_sequences(prompt_batch(load_tokenizer(cfg.model), ("7*6=",)), seed=4)
        assert gen["uid"] == ["p0", "p0"] and len(two.role("policy").compute_log_probs(gen)) == 2
        s2 = two.role("policy").update_policy(small, expected_version=1, batch_id="b1")
        two.role("policy").save_checkpoint(str(tmp_path / "two_small"))
    finally:
        destroy_pool(two)
    w1 = read_safetensors_folder(tmp_path / "one" / "policy")
    w2 = read_safetensors_folder(tmp_path / "two" / "policy")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)
    assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-4, abs=1e-6)
    w1, w2 = (read_safetensors_folder(tmp_path / f"{n}_small" / "policy") for n in ("one", "two"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)
    for key in ("actor/pg_loss", "actor/optimizer_steps", "perf/total_num_tokens"):
        assert s2[key] == pytest.approx(s1[key], rel=1e-4, abs=1e-6), key
