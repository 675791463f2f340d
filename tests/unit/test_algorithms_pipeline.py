"""compute_advantages (overlong shaping, KL in reward, registry dispatch) and group filtering."""

from __future__ import annotations

import math

import pytest
import torch

import hybridflow.algorithms as A
from hybridflow.algorithms.pipeline import compute_advantages, filter_zero_variance_groups
from hybridflow.batch import Batch, BatchError
from hybridflow.config import ExperimentConfig


def cfg_with(**sections) -> ExperimentConfig:
    return ExperimentConfig.model_validate(sections)


def run_pipeline(batch: Batch, cfg: ExperimentConfig, **kwargs):
    """compute_advantages given the config sections the advantage node passes it."""
    return compute_advantages(batch, cfg.algorithm, max_response_tokens=cfg.rollout.max_response_tokens, **kwargs)


def scored_batch(scores: list[float], lengths: list[int], uid: list, width: int = 4, **extra) -> Batch:
    """Score on the last valid token of each response, as the reward worker places it."""
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)
    tls = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        if n:
            tls[i, n - 1] = s
    tensors = {"token_level_scores": tls, "response_mask": mask, **extra}
    return Batch.from_dict(tensors, {"uid": uid})


def test_grpo_through_the_pipeline():
    batch = scored_batch([1, 0, 0, 0, 1, 1, 1, 1], [4, 2, 3, 1, 4, 4, 2, 3], ["a"] * 4 + ["b"] * 4)
    out, metrics = run_pipeline(batch, ExperimentConfig())
    # group a: [1,0,0,0] → [1.5, −0.5, −0.5, −0.5]; group b all equal → 0
    torch.testing.assert_close(out["advantages"][:, 0], torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]))
    assert not out["advantages"][~out["response_mask"]].any()
    assert torch.equal(out["token_level_rewards"], batch["token_level_scores"])
    assert metrics["algorithm/zero_variance_groups"] == 0.5  # 1 of 2 groups
    assert metrics["algorithm/num_groups"] == 2.0
    assert "advantages" not in batch  # the input is not modified


def test_kl_in_reward_fixed_coefficient():
    # every valid token: k1 = ln 0.2 − ln 0.5 = −0.916291 ; β = 0.1 → reward += 0.0916291
    batch = scored_batch(
        [1.0, 0.0],
        [2, 1],
        ["a", "a"],
        width=2,
        old_log_probs=torch.full((2, 2), math.log(0.2)),
        ref_log_probs=torch.full((2, 2), math.log(0.5)),
    )
    cfg = cfg_with(algorithm={"use_kl_in_reward": True, "kl_ctrl": {"kl_coef": 0.1}})
    out, metrics = run_pipeline(batch, cfg)
    want = torch.tensor([[0.0916291, 1.0916291], [0.0916291, 0.0]])
    torch.testing.assert_close(out["token_level_rewards"], want)
    assert metrics["critic/kl"] == pytest.approx(-0.916291, rel=1e-5)
    assert metrics["critic/kl_coef"] == 0.1
    # per-sequence rewards 1 + 2·0.0916291 = 1.183258 and 0.0916291; a group of two is always ±1/√2
    # (d/2 over the unbiased std d/√2) → GRPO ±0.707107
    torch.testing.assert_close(out["advantages"][:, 0], torch.tensor([0.707107, -0.707107]))


def test_kl_in_reward_adaptive_controller_is_updated_and_required():
    batch = scored_batch(
        [1.0, 0.0],
        [2, 2],
        ["a", "a"],
        width=2,
        old_log_probs=torch.full((2, 2), math.log(0.5)),
        ref_log_probs=torch.full((2, 2), math.log(0.2)),
    )
    cfg = cfg_with(
        algorithm={
            "use_kl_in_reward": True,
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.5, "horizon": 20},
        }
    )
    with pytest.raises(ValueError, match="kl_controller"):
        run_pipeline(batch, cfg)
    ctl = A.make_kl_controller(cfg.algorithm.kl_ctrl)
    _, metrics = run_pipeline(batch, cfg, kl_controller=ctl)
    # KL = ln 2.5 = 0.916291 > target 0.5 → e = clip(0.83, ±0.2) = 0.2 → β = 0.1·(1 + 0.2·2/20) = 0.102
    assert metrics["critic/kl_coef"] == 0.1
    assert ctl.value == pytest.approx(0.102)


def test_kl_in_reward_needs_log_probs():
    batch = scored_batch([1.0, 0.0], [2, 2], ["a", "a"], width=2)
    with pytest.raises(BatchError, match="old_log_probs"):
        run_pipeline(batch, cfg_with(algorithm={"use_kl_in_reward": True}))


def test_overlong_penalty_lands_on_the_last_token():
    # max 4 tokens, buffer 2 → ramp from 2: length 4 → −1, 3 → −0.5, 2 → 0
    batch = scored_batch([1.0, 1.0, 1.0], [4, 3, 2], ["a", "a", "a"])
    cfg = cfg_with(
        rollout={"max_response_tokens": 4},
        algorithm={"overlong_buffer": {"enable": True, "buffer_tokens": 2, "penalty_factor": 1.0}},
    )
    out, metrics = run_pipeline(batch, cfg)
    want = torch.tensor([[0, 0, 0, 0.0], [0, 0, 0.5, 0], [0, 1.0, 0, 0]])
    torch.testing.assert_close(out["token_level_rewards"], want)
    assert torch.equal(out["token_level_scores"], batch["token_level_scores"])  # raw scores kept
    assert metrics["algorithm/overlong_penalty/mean"] == pytest.approx(-0.5)
    assert metrics["algorithm/zero_variance_groups"] == 0.0  # the penalty made the scores differ
    # lengths from the non-tensor field take precedence over the mask
    batch.set("response_length", [2, 2, 2])
    out2, _ = run_pipeline(batch, cfg)
    torch.testing.assert_close(out2["token_level_rewards"], batch["token_level_scores"])


def test_dispatch_goes_through_the_registry_with_config_values():
    seen = {}

    @A.register_advantage_estimator("test_pipeline_probe")
    def probe(token_level_rewards, response_mask, *, uid=None, values=None, gamma=1.0, lam=1.0, **options):
        seen.update(uid=uid, values=values, gamma=gamma, lam=lam, **options)
        z = torch.zeros_like(token_level_rewards)
        return z, z.clone()

    values = torch.ones(2, 4)
    batch = scored_batch([1.0, 0.0], [4, 4], ["u", "v"], values=values, reward_baselines=torch.tensor([0.5, 0.5]))
    cfg = cfg_with(algorithm={"adv_estimator": "test_pipeline_probe", "gamma": 0.9, "lam": 0.8, "norm_adv_by_std_in_grpo": False})
    run_pipeline(batch, cfg)
    assert seen["uid"] == ["u", "v"] and torch.equal(seen["values"], values)
    assert (seen["gamma"], seen["lam"], seen["norm_by_std"]) == (0.9, 0.8, False)
    assert torch.equal(seen["reward_baselines"], torch.tensor([0.5, 0.5]))


def test_gae_and_remax_through_the_pipeline():
    batch = scored_batch([1.0, 0.0], [2, 1], ["a", "b"], width=2, values=torch.tensor([[0.5, 0.25], [0.1, 9.0]]))
    cfg = cfg_with(algorithm={"adv_estimator": "gae", "gamma": 1.0, "lam": 1.0})
    out, _ = run_pipeline(batch, cfg)
    # γ = λ = 1: returns = reward-to-go = [[1, 1], [0, ·]]
    torch.testing.assert_close(out["returns"], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    batch.set("reward_baselines", torch.tensor([0.25, 0.25]))
    out, _ = run_pipeline(batch, cfg_with(algorithm={"adv_estimator": "remax"}))
    torch.testing.assert_close(out["advantages"], torch.tensor([[0.75, 0.75], [-0.25, 0.0]]))


def test_filter_zero_variance_groups():
    # a: [1, 0] varies → kept; b: [1, 1] equal → dropped; c: a group of one → dropped
    batch = scored_batch([1, 0, 1, 1, 0.5], [4, 2, 3, 1, 2], ["a", "a", "b", "b", "c"])
    kept, dropped = filter_zero_variance_groups(batch)
    assert dropped == 2 and kept["uid"] == ["a", "a"]
    torch.testing.assert_close(kept["token_level_scores"], batch["token_level_scores"][:2])
    none, dropped = filter_zero_variance_groups(batch.index([2, 3]))
    assert len(none) == 0 and dropped == 1


def test_an_estimator_gets_only_the_inputs_it_declares():
    seen = {}

    @A.register_advantage_estimator("test_pipeline_declares_gamma")
    def discounted_probe(token_level_rewards, response_mask, *, gamma):
        seen["gamma"] = gamma  # no uid / values / lam / norm_by_std parameter: none is passed
        z = torch.zeros_like(token_level_rewards)
        return z, z.clone()

    batch = scored_batch([1.0, 0.0], [4, 4], ["u", "v"], values=torch.ones(2, 4))
    run_pipeline(batch, cfg_with(algorithm={"adv_estimator": "test_pipeline_declares_gamma", "gamma": 0.7}))
    assert seen == {"gamma": 0.7}
    from hybridflow.algorithms.registry import declared_inputs

    assert declared_inputs(discounted_probe, {"gamma": 0.7, "uid": ["u"]}) == {"gamma": 0.7}
