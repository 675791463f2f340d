"""ReferenceWorker and CriticWorker without Ray."""

from __future__ import annotations

import pytest
import torch

from tests.unit._worker_helpers import prompt_batch, tiny_cfg, weights, with_advantages
from workers import checkpoint as C
from workers.critic import CriticWorker
from workers.policy import PolicyWorker, VersionMismatchError
from workers.reference import ReferenceWorker


def _scored_rollout(policy: PolicyWorker):
    batch = policy.compute_log_probs(policy.generate_sequences(prompt_batch(policy.tokenizer), seed=2))
    return with_advantages(batch)


# ---- reference ---------------------------------------------------------------------------------


def test_reference_equals_initial_policy_and_stays_frozen():
    cfg = tiny_cfg()
    policy = PolicyWorker(cfg)
    ref = ReferenceWorker(cfg, policy=policy)  # no LoRA: a separate copy, the policy is ignored
    assert not ref.shares_policy
    batch = _scored_rollout(policy)
    out = ref.compute_ref_log_probs(batch)
    # same weights, same arithmetic; chunks of other sizes are trimmed to other widths, so equal
    # up to float rounding
    torch.testing.assert_close(out["ref_log_probs"], batch["old_log_probs"])
    assert "ref_log_probs" not in batch  # the caller's batch is not modified
    policy.update_policy(batch, expected_version=0, batch_id="b0")
    again = ref.compute_ref_log_probs(batch)
    assert torch.equal(again["ref_log_probs"], out["ref_log_probs"])
    moved = policy.compute_log_probs(batch)["old_log_probs"]
    assert not torch.equal(moved, out["ref_log_probs"])


def test_lora_reference_reuses_the_policy_with_adapters_off():
    cfg = tiny_cfg("model.lora_rank=4", "model.target_modules=[q_proj, v_proj]", "actor.lr=1e-2")
    policy = PolicyWorker(cfg)
    ref = ReferenceWorker(cfg, policy=policy)
    assert ref.shares_policy and ref.module is None
    separate = ReferenceWorker(cfg)  # no policy in the process: its own copy of the base model
    batch = _scored_rollout(policy)
    before = ref.compute_ref_log_probs(batch)["ref_log_probs"]
    # LoRA starts with B = 0: the adapted policy equals the base model
    torch.testing.assert_close(before, batch["old_log_probs"], rtol=0, atol=1e-6)
    policy.update_policy(batch, expected_version=0, batch_id="b0")
    after = ref.compute_ref_log_probs(batch)["ref_log_probs"]
    assert torch.equal(after, before)  # adapters off = the frozen base, whatever they learned
    assert torch.equal(separate.compute_ref_log_probs(batch)["ref_log_probs"], before)
    assert not torch.allclose(policy.compute_log_probs(batch)["old_log_probs"], before)


# ---- critic ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gae_cfg():
    return tiny_cfg("algorithm.adv_estimator=gae")


def test_values_read_the_predecessor_hidden_state(gae_cfg):
    policy, critic = PolicyWorker(gae_cfg), CriticWorker(gae_cfg)
    batch = _scored_rollout(policy)
    values = critic.compute_values(batch)["values"]
    assert values.shape == batch["response_ids"].shape and values.dtype == torch.float32
    assert (values[~batch["response_mask"]] == 0).all()
    # row 0 by hand: V over the whole unpadded sequence; response token t is valued at column P−1+t
    p = int(batch["prompt_mask"][0].sum())
    r = int(batch["response_mask"][0].sum())
    ids = torch.cat([batch["prompt_ids"][0][batch["prompt_mask"][0]], batch["response_ids"][0][:r]]).unsqueeze(0)
    with torch.no_grad():
        full = critic.module(ids, torch.ones_like(ids), torch.arange(ids.shape[1]).unsqueeze(0))
    torch.testing.assert_close(values[0, :r], full[0, p - 1 : p - 1 + r], rtol=1e-5, atol=1e-6)


def _critic_batch(policy, critic):
    batch = critic.compute_values(_scored_rollout(policy))
    batch.set("returns", (batch["values"] + 1.0).masked_fill(~batch["response_mask"], 0.0))
    return batch


def test_critic_update_moves_value_head_exactly_once(gae_cfg):
    policy, critic = PolicyWorker(gae_cfg), CriticWorker(gae_cfg)
    batch = _critic_batch(policy, critic)
    head = critic.module.value_head.weight.detach().clone()
    metrics = critic.update_critic(batch, expected_version=0, batch_id="c0")
    assert not torch.equal(head, critic.module.value_head.weight)
    assert critic.get_weights_version() == 1
    # returns = V_old + 1 and V = V_old on the first pass: ½·1² per token, nothing clipped
    assert metrics["critic/vf_loss"] == pytest.approx(0.5, rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == 0.0
    for key in ("critic/grad_norm", "critic/lr", "critic/vpred_mean"):
        assert key in metrics
    assert critic.update_critic(batch, expected_version=0, batch_id="c0") == metrics
    with pytest.raises(VersionMismatchError, match="critic update expected weights_version 3"):
        critic.update_critic(batch, expected_version=3, batch_id="c3")
    # values moved towards the returns
    new_values = critic.compute_values(batch)["values"]
    mask = batch["response_mask"]
    assert (batch["returns"] - new_values)[mask].mean() < (batch["returns"] - batch["values"])[mask].mean()


def test_critic_checkpoint_round_trip(gae_cfg, tmp_path):
    policy, critic = PolicyWorker(gae_cfg), CriticWorker(gae_cfg)
    batch = _critic_batch(policy, critic)
    critic.update_critic(batch, expected_version=0, batch_id="c0")
    tmp = C.begin_save(tmp_path, 1)
    critic.save_checkpoint(tmp)
    path = C.finalize_checkpoint(tmp_path, 1, {})
    fresh = CriticWorker(gae_cfg)
    fresh.load_checkpoint(path)
    assert fresh.get_weights_version() == 1
    want, got = weights(critic.module), weights(fresh.module)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    s1, s2 = critic.optim.state_dict()["optimizer"]["state"], fresh.optim.state_dict()["optimizer"]["state"]
    assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])


def test_critic_load_skips_checkpoint_without_critic_when_not_needed(tmp_path):
    cfg = tiny_cfg()  # grpo: no critic trained
    critic = CriticWorker(cfg)
    before = weights(critic.module)
    C.begin_save(tmp_path, 1)
    path = C.finalize_checkpoint(tmp_path, 1, {})
    critic.load_checkpoint(path)
    assert all(torch.equal(v, before[k]) for k, v in weights(critic.module).items())
    gae = CriticWorker(tiny_cfg("algorithm.adv_estimator=gae"))
    with pytest.raises(C.CheckpointError, match="needs a critic"):
        gae.load_checkpoint(path)
