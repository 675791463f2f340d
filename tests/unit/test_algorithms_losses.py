"""Policy losses, value loss, KL estimators and controllers: hand-worked values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

import hybridflow.algorithms as A
from hybridflow.algorithms.policy_losses import ppo_token_losses
from hybridflow.config import BUILTIN_POLICY_LOSSES, KLControlConfig

LN = math.log


def one_token_rows(ratios: list[float], advs: list[float]):
    """Each (ratio, advantage) as its own single-token sequence; old log-prob 0."""
    log_probs = torch.tensor([[LN(r)] for r in ratios], requires_grad=True)
    old = torch.zeros(len(ratios), 1)
    adv = torch.tensor([[a] for a in advs])
    mask = torch.ones(len(ratios), 1, dtype=torch.bool)
    return log_probs, old, adv, mask


# ---- PPO -----------------------------------------------------------------------------------


def test_dual_clip_ppo_per_token_reference_values():
    # ε = 0.2, c = 3, loss = max(−Aρ, −A·clip(ρ, 0.8, 1.2)), then min(·, −A·c) when A < 0
    # (5, +1): max(−5, −1.2) = −1.2
    # (5, −1): max(5, 1.2) = 5 → min(5, 3) = 3.0
    # (0.5, +1): max(−0.5, −0.8) = −0.5
    # (1.5, −1): max(1.5, 1.2) = 1.5 → min(1.5, 3) = 1.5
    loss, clipped, dual = ppo_token_losses(
        torch.tensor([5.0, 5.0, 0.5, 1.5]), torch.tensor([1.0, -1.0, 1.0, -1.0]), 0.2, 0.2, 3.0
    )
    torch.testing.assert_close(loss, torch.tensor([-1.2, 3.0, -0.5, 1.5]))
    assert clipped.tolist() == [True, False, False, False]
    assert dual.tolist() == [False, True, False, False]


def test_ppo_loss_metrics_and_gradient():
    lp, old, adv, mask = one_token_rows([5.0, 5.0, 0.5, 1.5], [1.0, -1.0, 1.0, -1.0])
    loss, metrics = A.get_policy_loss("ppo")(lp, old, adv, mask)
    # token-mean of [−1.2, 3.0, −0.5, 1.5] = 2.8 / 4 = 0.7
    torch.testing.assert_close(loss, torch.tensor(0.7))
    assert metrics["pg_loss"] == pytest.approx(0.7)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)
    # ppo_kl = mean(old − new) = −(ln5 + ln5 + ln0.5 + ln1.5)/4
    assert metrics["ppo_kl"] == pytest.approx(-(2 * LN(5) + LN(0.5) + LN(1.5)) / 4, rel=1e-5)
    loss.backward()
    # clipped and dual-clipped tokens get no gradient; unclipped: d(−Aρ)/dlogp = −Aρ, /4 for the mean
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0], [0.0], [-0.5 / 4], [1.5 / 4]]))


def test_clip_higher_is_asymmetric():
    # DAPO: ε_low 0.2, ε_high 0.28. ρ = 1.25, A = +1: 1.25 < 1.28 → not clipped, loss −1.25
    lp, old, adv, mask = one_token_rows([1.25], [1.0])
    loss, m = A.get_policy_loss("ppo")(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(loss, torch.tensor(-1.25))
    assert m["pg_clipfrac"] == 0.0
    # symmetric 0.2 clips it: −1.2
    loss2, m2 = A.get_policy_loss("ppo")(lp, old, adv, mask)
    torch.testing.assert_close(loss2, torch.tensor(-1.2))
    assert m2["pg_clipfrac"] == 1.0


def test_ppo_rejects_bad_dual_clip_and_unknown_options():
    lp, old, adv, mask = one_token_rows([1.0], [1.0])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        A.get_policy_loss("ppo")(lp, old, adv, mask, clip_ratio_c=1.0)
    for name in BUILTIN_POLICY_LOSSES:
        with pytest.raises(TypeError, match="global_normaliser"):
            A.get_policy_loss(name)(lp, old, adv, mask, global_normaliser=4.0)


# ---- GSPO, REINFORCE, CISPO ---------------------------------------------------------------


def test_gspo_uses_the_sequence_ratio():
    # one sequence, token log-ratios [ln 2, 0] (third token masked) → s = exp(ln2 / 2) = √2 = 1.414214
    lp = torch.tensor([[LN(2.0), 0.0, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    # A = +1: clip(√2, 0.8, 1.2) = 1.2 wins → per-token −1.2, clipfrac 1
    loss, m = A.get_policy_loss("gspo")(lp, old, torch.ones(1, 3), mask)
    torch.testing.assert_close(loss, torch.tensor(-1.2))
    assert m["pg_clipfrac"] == 1.0
    # A = −1: max(√2, 1.2) = √2 unclipped; each token's gradient is −A·s = √2, /2 tokens
    loss, m = A.get_policy_loss("gspo")(lp, old, -torch.ones(1, 3), mask)
    torch.testing.assert_close(loss, torch.tensor(math.sqrt(2)))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[math.sqrt(2) / 2, math.sqrt(2) / 2, 0.0]]))


def test_reinforce_on_policy_is_the_plain_policy_gradient():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, m = A.get_policy_loss("reinforce")(lp, lp.detach(), adv, mask)
    # ρ = 1 → loss = −mean(A) = −(2 + 2 − 1 − 1)/4 = −0.5 ; grad = −A/4
    torch.testing.assert_close(loss, torch.tensor(-0.5))
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv / 4)
    assert m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0


def test_cispo_keeps_gradient_of_clipped_tokens():
    # ρ = 5, A = +1 → weight clip(5, 0.8, 1.2) = 1.2 (detached): d(−1.2·A·logp)/dlogp = −1.2
    # ρ = 0.5, A = −1 → weight 0.8: gradient +0.8 ; token-mean over 2 tokens halves both
    lp, old, adv, mask = one_token_rows([5.0, 0.5], [1.0, -1.0])
    loss, m = A.get_policy_loss("cispo")(lp, old, adv, mask)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.2 / 2], [0.8 / 2]]))
    assert m["pg_clipfrac"] == 1.0
    # PPO gives the same tokens no gradient at all
    lp2, old2, adv2, mask2 = one_token_rows([5.0, 0.5], [1.0, -1.0])
    A.get_policy_loss("ppo")(lp2, old2, adv2, mask2)[0].backward()
    assert not lp2.grad.any()


@pytest.mark.parametrize("name", BUILTIN_POLICY_LOSSES)
def test_policy_losses_ignore_masked_positions(name):
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 5, generator=g) * 0.1 - 1).requires_grad_()
    old = lp.detach() + torch.randn(3, 5, generator=g) * 0.1
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    loss1, m1 = A.get_policy_loss(name)(lp, old, adv, mask)
    nan = torch.full_like(adv, float("nan"))
    loss2, m2 = A.get_policy_loss(name)(lp, torch.where(mask, old, nan), torch.where(mask, adv, nan), mask)
    torch.testing.assert_close(loss1, loss2)
    assert m1 == pytest.approx(m2)
    (grad,) = torch.autograd.grad(loss2, lp)
    assert torch.isfinite(grad).all() and not grad[~mask].any()


# ---- value loss ---------------------------------------------------------------------------


def test_value_loss_reference_values():
    # token 1: V 1.0, V_old 0.5, R 2.0 → (1−2)² = 1 ; clip: 0.5 + clamp(0.5, ±0.2) = 0.7 → 1.3² = 1.69
    # token 2: V 2.0, V_old 2.0, R 1.0 → 1 ; clipped 2.0 → 1
    # ½·mean(max(1, 1.69), max(1, 1)) = ½·(2.69/2) = 0.6725 ; clipped term larger on 1 of 2
    v = torch.tensor([[1.0, 2.0, 100.0]], requires_grad=True)
    loss, m = A.value_loss(
        v,
        torch.tensor([[0.5, 2.0, 0.0]]),
        torch.tensor([[2.0, 1.0, 0.0]]),
        torch.tensor([[True, True, False]]),
        clip_range_value=0.2,
        loss_agg_mode="token-mean",
    )
    torch.testing.assert_close(loss, torch.tensor(0.6725))
    assert m["vf_clipfrac"] == 0.5 and m["vf_loss"] == pytest.approx(0.6725)
    loss.backward()
    # token 1: clipped branch is constant in V (clamp saturated) → 0 ; token 2: ½·2(V−R)/2 = 0.5
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.5, 0.0]]))


# ---- KL -----------------------------------------------------------------------------------


def test_kl_estimator_reference_values():
    # Δ = ln 0.2 − ln 0.5 = ln 0.4 = −0.916291
    # k2 = ½·0.839589 = 0.419794 ; k3 = e^{0.916291} − 0.916291 − 1 = 2.5 − 1.916291 = 0.583709
    lp, ref = torch.tensor([LN(0.2)]), torch.tensor([LN(0.5)])
    want = {"k1": -0.916291, "k2": 0.419794, "k3": 0.583709, "abs": 0.916291}
    aliases = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
    for name, value in want.items():
        torch.testing.assert_close(A.kl_penalty(lp, ref, name), torch.tensor([value]))
        if name in aliases:
            torch.testing.assert_close(A.kl_penalty(lp, ref, aliases[name]), torch.tensor([value]))
    with pytest.raises(ValueError, match="known: k1"):
        A.kl_penalty(lp, ref, "k4")


def test_k3_is_clamped():
    # Δ = −30 → log-ratio clamped to 20 → e^20 − 21 ≫ 10 → clamped to 10
    assert float(A.kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3")) == 10.0


def test_kl_loss_aggregates_over_the_mask():
    lp = torch.tensor([[LN(0.2), 0.0], [LN(0.2), LN(0.2)]])
    ref = torch.tensor([[LN(0.5), float("nan")], [LN(0.5), LN(0.5)]])
    mask = torch.tensor([[True, False], [True, True]])
    # three valid tokens with k1 = −0.916291 each: token-mean −0.916291 ; seq-mean-token-sum (−0.916 − 1.833)/2
    torch.testing.assert_close(A.kl_loss(lp, ref, mask, "k1", "token-mean"), torch.tensor(-0.916291))
    torch.testing.assert_close(A.kl_loss(lp, ref, mask, "kl", "seq-mean-token-sum"), torch.tensor(-0.916291 * 1.5))


def test_adaptive_kl_controller_follows_ziegler():
    ctl = A.AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    # KL 0.2: e = clip(0.2/0.1 − 1, ±0.2) = 0.2 → β = 0.1·(1 + 0.2·10/100) = 0.102
    ctl.update(0.2, n_steps=10)
    assert ctl.value == pytest.approx(0.102)
    # KL 0.05: e = clip(−0.5) = −0.2 → 0.102·(1 − 0.02) = 0.09996
    ctl.update(0.05, n_steps=10)
    assert ctl.value == pytest.approx(0.09996)
    fixed = A.FixedKLController(0.3)
    fixed.update(10.0, 100)
    assert fixed.value == 0.3


def test_make_kl_controller_from_config():
    ctl = A.make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.2, horizon=50))
    assert isinstance(ctl, A.AdaptiveKLController) and (ctl.value, ctl.target, ctl.horizon) == (0.05, 0.2, 50)
    assert isinstance(A.make_kl_controller(KLControlConfig()), A.FixedKLController)
