"""Advantage estimators: hand-worked reference values, loop oracles, invariances, registry."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridflow.algorithms as A
from hybridflow.algorithms.core import masked_whiten
from hybridflow.config import BUILTIN_ADV_ESTIMATORS, BUILTIN_POLICY_LOSSES, ExperimentConfig

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo")


def outcome(scores: list[float], width: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards with each score on the last of `width` valid tokens; all tokens valid."""
    r = torch.zeros(len(scores), width)
    r[:, -1] = torch.tensor(scores)
    return r, torch.ones(len(scores), width, dtype=torch.bool)


def seq_adv(name: str, scores: list[float], uid=None, **kw) -> torch.Tensor:
    r, m = outcome(scores)
    adv, _ = A.get_advantage_estimator(name)(r, m, uid=uid or [0] * len(scores), **kw)
    assert torch.equal(adv[:, 0], adv[:, -1])  # outcome advantage is constant along the response
    return adv[:, 0]


# ---- reference values -----------------------------------------------------------------------


def test_grpo_reference_values():
    # all equal: mean 1, std 0 → (1 − 1) / (0 + 1e-6) = 0, finite
    assert torch.equal(seq_adv("grpo", [1, 1, 1, 1]), torch.zeros(4))
    assert torch.equal(seq_adv("grpo", [0, 0, 0, 0]), torch.zeros(4))
    # [1,0,0,0]: mean 0.25; unbiased var = (0.75² + 3·0.25²)/3 = 0.75/3 = 0.25 → std 0.5
    # (1 − 0.25)/0.5 = 1.5 ; (0 − 0.25)/0.5 = −0.5   (eps 1e-6 moves the 6th digit)
    torch.testing.assert_close(seq_adv("grpo", [1, 0, 0, 0]), torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_dr_grpo_does_not_divide_by_std():
    # [1,0,0,0] − 0.25 = [0.75, −0.25, −0.25, −0.25]
    got = seq_adv("grpo", [1, 0, 0, 0], norm_by_std=False)
    torch.testing.assert_close(got, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_grpo_group_of_one_gets_its_own_score():
    # group "a" = [3] alone (verl's convention): mean 0, std 1 → 3 / (1 + 1e-6)
    # group "b" = [1, 0]: mean 0.5, unbiased std √(2·0.25/1) = √0.5 → ±0.5/√0.5 = ±0.707107
    got = seq_adv("grpo", [3.0, 1.0, 0.0], uid=["a", "b", "b"])
    half = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(got, torch.tensor([3.0 / (1 + 1e-6), half, -half]))


def test_rloo_reference_values():
    # 1 − mean(0,0,0) = 1 ; 0 − mean(1,0,0) = −1/3
    torch.testing.assert_close(seq_adv("rloo", [1, 0, 0, 0]), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_opo_length_weighted_baseline():
    # lengths 1 and 3, scores 1 and 0 → b = (1·1 + 3·0)/(1+3) = 0.25 → A = [0.75, −0.25]
    r = torch.tensor([[1.0, 0, 0], [0, 0, 0]])
    m = torch.tensor([[True, False, False], [True, True, True]])
    adv, _ = A.get_advantage_estimator("opo")(r, m, uid=[0, 0])
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0, 0], [-0.25, -0.25, -0.25]]))


def test_remax_subtracts_greedy_baseline_from_reward_to_go():
    # rewards [1, 0, 2] → reward-to-go [3, 2, 2]; baseline 0.5 → [2.5, 1.5, 1.5]
    r = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    m = torch.tensor([[True, True, True, False]])
    adv, ret = A.get_advantage_estimator("remax")(r, m, reward_baselines=torch.tensor([0.5]))
    torch.testing.assert_close(ret, torch.tensor([[3.0, 2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[2.5, 1.5, 1.5, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        A.get_advantage_estimator("remax")(r, m)


def test_gae_reference_values():
    # one sequence, rewards [0, 1], values [0.5, 0.25], γ = 0.9, λ = 0.8
    # t=1: δ = 1 + 0.9·0 − 0.25 = 0.75, A1 = 0.75
    # t=0: δ = 0 + 0.9·0.25 − 0.5 = −0.275, A0 = −0.275 + 0.72·0.75 = 0.265
    # returns = A + V = [0.765, 1.0]; advantages whitened: mean 0.5075, unbiased std of
    # [0.265, 0.75] = 0.485/√2 = 0.342947 → [−0.707107, 0.707107]
    r = torch.tensor([[0.0, 1.0, 5.0]])
    v = torch.tensor([[0.5, 0.25, 7.0]])
    m = torch.tensor([[True, True, False]])
    adv, ret = A.get_advantage_estimator("gae")(r, m, values=v, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret, torch.tensor([[0.765, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-0.707107, 0.707107, 0.0]]))


def test_reinforce_plus_plus_discounted_returns():
    # rewards [1, 0, 2], γ = 0.5 → returns [1 + 0.5·(0 + 0.5·2), 0 + 0.5·2, 2] = [1.5, 1, 2]
    r = torch.tensor([[1.0, 0.0, 2.0]])
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = A.get_advantage_estimator("reinforce_plus_plus")(r, m, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 2.0]]))
    # whitened: mean 1.5, unbiased std 0.5 → [0, −1, 1]
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.0, 1.0]]), atol=1e-5, rtol=0)


# ---- loop oracles ---------------------------------------------------------------------------


def oracle_group(name: str, rewards: torch.Tensor, mask: torch.Tensor, uid: list, norm_by_std=True):
    """Sample-by-sample versions of the group estimators (the slow obvious way)."""
    scores = [float(sum(rewards[i, t] for t in range(rewards.shape[1]) if mask[i, t])) for i in range(len(uid))]
    lengths = [int(mask[i].sum()) for i in range(len(uid))]
    out = []
    for i, u in enumerate(uid):
        members = [j for j in range(len(uid)) if uid[j] == u]
        g = [scores[j] for j in members]
        n = len(g)
        mean = sum(g) / n if n > 1 else 0.0
        if name == "grpo":
            std = math.sqrt(sum((x - sum(g) / n) ** 2 for x in g) / (n - 1)) if n > 1 else 1.0
            out.append((scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean)
        elif name == "rloo":
            out.append(scores[i] - sum(scores[j] for j in members if j != i) / (n - 1) if n > 1 else scores[i])
        elif name == "reinforce_plus_plus_baseline":
            out.append(scores[i] - mean)
        elif name == "opo":
            total = sum(lengths[j] for j in members)
            b = sum(lengths[j] * scores[j] for j in members) / total if n > 1 and total > 0 else 0.0
            out.append(scores[i] - b)
    adv = torch.tensor(out, dtype=torch.float64).unsqueeze(-1) * mask
    if name == "reinforce_plus_plus_baseline":
        adv = masked_whiten(adv, mask) * mask
    return adv.float()


def oracle_gae(rewards, values, mask, gamma, lam):
    """Per sequence: walk the valid positions backwards (verl semantics), then whiten."""
    B, T = rewards.shape
    raw = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        next_v, last = 0.0, 0.0
        for t in reversed(range(T)):
            if not mask[i, t]:
                raw[i, t] = last
                continue
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            next_v = float(values[i, t])
            raw[i, t] = last
    returns = (raw + values.double()) * mask
    return (masked_whiten(raw, mask) * mask).float(), returns.float()


def random_batch(seed: int, B: int = 12, T: int = 7, groups: int = 4, interior_gaps: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    if interior_gaps:  # multi-turn style: some observation tokens inside the response
        mask &= torch.rand(B, T, generator=g) > 0.2
    rewards = torch.randint(-2, 3, (B, T), generator=g).float() * 0.5
    values = torch.randn(B, T, generator=g)
    uid = [f"p{int(i)}" for i in torch.randint(0, groups, (B,), generator=g)]
    return rewards, values, mask, uid


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("seed", range(4))
def test_group_estimators_match_loop_oracle(name, seed):
    rewards, _, mask, uid = random_batch(seed)
    adv, ret = A.get_advantage_estimator(name)(rewards, mask, uid=uid)
    want = oracle_group(name, rewards, mask, uid)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, want, atol=1e-5, rtol=1e-5)
    assert adv.data_ptr() != ret.data_ptr()  # two tensors: safetensors refuses shared storage


def test_dr_grpo_matches_loop_oracle():
    rewards, _, mask, uid = random_batch(7)
    adv, _ = A.get_advantage_estimator("grpo")(rewards, mask, uid=uid, norm_by_std=False)
    torch.testing.assert_close(adv, oracle_group("grpo", rewards, mask, uid, norm_by_std=False))


@pytest.mark.parametrize("interior_gaps", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_loop_oracle(gamma, lam, interior_gaps):
    rewards, values, mask, _ = random_batch(11, interior_gaps=interior_gaps)
    adv, ret = A.get_advantage_estimator("gae")(rewards, mask, values=values, gamma=gamma, lam=lam)
    want_adv, want_ret = oracle_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, want_ret, atol=1e-5, rtol=1e-5)


def test_gae_requires_values():
    r, m = outcome([1.0])
    with pytest.raises(ValueError, match="values"):
        A.get_advantage_estimator("gae")(r, m)


def test_group_estimators_require_uid():
    r, m = outcome([1.0, 0.0])
    for name in GROUP_ESTIMATORS:
        with pytest.raises(ValueError, match="uid"):
            A.get_advantage_estimator(name)(r, m)


def test_uid_tensor_and_list_agree():
    rewards, _, mask, uid = random_batch(3)
    as_int = torch.tensor([int(u[1:]) * 17 for u in uid])
    for name in GROUP_ESTIMATORS:
        a1, _ = A.get_advantage_estimator(name)(rewards, mask, uid=uid)
        a2, _ = A.get_advantage_estimator(name)(rewards, mask, uid=as_int)
        torch.testing.assert_close(a1, a2)


# ---- properties -----------------------------------------------------------------------------

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=8), st.integers(1, 3))
def test_grpo_never_non_finite(scores, n_groups):
    uid = [i % n_groups for i in range(len(scores))]
    for norm in (True, False):
        adv = seq_adv("grpo", scores, uid=uid, norm_by_std=norm)
        assert torch.isfinite(adv).all()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(BUILTIN_ADV_ESTIMATORS))
def test_masked_positions_never_change_outputs(seed, name):
    rewards, values, mask, uid = random_batch(seed, interior_gaps=name == "gae")
    kw = {"uid": uid, "values": values, "gamma": 0.9, "lam": 0.9, "reward_baselines": torch.ones(len(uid))}
    a1, r1 = A.get_advantage_estimator(name)(rewards, mask, **kw)
    junk = torch.full_like(rewards, float("nan"))
    rewards2 = torch.where(mask, rewards, junk)
    kw2 = {**kw, "values": torch.where(mask, values, 1e9)}
    a2, r2 = A.get_advantage_estimator(name)(rewards2, mask, **kw2)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)
    assert not a1[~mask].any() and not r1[~mask].any()  # zero outside the mask


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(BUILTIN_ADV_ESTIMATORS))
def test_permuting_samples_permutes_advantages(seed, name):
    rewards, values, mask, uid = random_batch(seed)
    perm = torch.randperm(len(uid), generator=torch.Generator().manual_seed(seed))
    base = {"values": values, "gamma": 0.95, "lam": 0.9, "reward_baselines": torch.arange(len(uid)).float()}
    a1, r1 = A.get_advantage_estimator(name)(rewards, mask, uid=uid, **base)
    permuted = {**base, "values": values[perm], "reward_baselines": base["reward_baselines"][perm]}
    a2, r2 = A.get_advantage_estimator(name)(rewards[perm], mask[perm], uid=[uid[i] for i in perm], **permuted)
    torch.testing.assert_close(a2, a1[perm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r2, r1[perm], atol=1e-5, rtol=1e-5)


# ---- registry -------------------------------------------------------------------------------


def test_builtin_names_match_config_lists():
    assert set(A.advantage_estimator_names()) >= set(BUILTIN_ADV_ESTIMATORS)
    assert set(A.policy_loss_names()) >= set(BUILTIN_POLICY_LOSSES)
    builtin_modules = {"hybridflow.algorithms.advantages", "hybridflow.algorithms.returns"}
    ours = {n for n in A.advantage_estimator_names() if A.get_advantage_estimator(n).__module__ in builtin_modules}
    assert ours == set(BUILTIN_ADV_ESTIMATORS)
    losses = {n for n in A.policy_loss_names() if A.get_policy_loss(n).__module__ == "hybridflow.algorithms.policy_losses"}
    assert losses == set(BUILTIN_POLICY_LOSSES)


def test_duplicate_and_unknown_names_fail_loudly():
    with pytest.raises(ValueError, match="already registered"):
        A.register_advantage_estimator("grpo")(lambda *a, **k: None)
    with pytest.raises(KeyError, match="known: .*grpo"):
        A.get_advantage_estimator("gpro")
    with pytest.raises(KeyError, match="known: .*ppo"):
        A.get_policy_loss("ppo2")


def test_user_estimator_is_one_decorator_and_selectable_by_config():
    @A.register_advantage_estimator("test_sign_of_score")
    def sign_of_score(token_level_rewards, response_mask, *, uid=None, values=None, gamma=1.0, lam=1.0, **options):
        s = torch.sign((token_level_rewards * response_mask).sum(-1, keepdim=True)) * response_mask
        return s.float(), s.float().clone()

    cfg = ExperimentConfig.model_validate({"algorithm": {"adv_estimator": "test_sign_of_score"}})
    r, m = outcome([2.0, -3.0])
    adv, _ = A.get_advantage_estimator(cfg.algorithm.adv_estimator)(r, m)
    assert adv[:, 0].tolist() == [1.0, -1.0]
