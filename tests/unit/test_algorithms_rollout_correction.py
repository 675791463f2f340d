"""Off-policy correction weights (tis, decoupled) and their application inside the policy losses.

Hand-worked values of issue 20: tis (C = 2): π_behav 0.2, π_old 0.5 → w = min(2.5, 2) = 2.0, and
with A = +1, ratio 1 the token's pg loss is −2.0. decoupled (ε = 0.2): π_behav 0.25, π_prox 0.5,
π_θ 0.65 → w = 2, r = 1.3; A = +1 → −2·min(1.3, 1.2) = −2.4; A = −1 → −2·min(−1.3, −1.2) = 2.6.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import get_policy_loss, rollout_correction_weights
from hybridflow.algorithms.rollout_correction import IS_CLIPPED, IS_MAX, IS_MEAN
from hybridflow.config import BUILTIN_POLICY_LOSSES

LN = math.log


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---- tis ------------------------------------------------------------------------------------------
# sequence 0: token a (π_behav 0.2, π_old 0.5, A +1 → w 2.0, loss −2.0), token b (π_behav = π_old = 0.4,
# A +1 → w 1, loss −1.0); sequence 1: token c (π_behav 0.5, π_old 0.25, A −1 → w 0.5, loss +0.5), then a
# padded position holding NaN/inf that must count for nothing. Ratio π/π_old = 1 everywhere.
OLD = _t([[LN(0.5), LN(0.4)], [LN(0.25), 0.0]])
ROLLOUT = torch.tensor([[LN(0.2), LN(0.4)], [LN(0.5), float("nan")]])
ADV = _t([[1.0, 1.0], [-1.0, float("inf")]])
MASK = torch.tensor([[True, True], [True, False]])


def test_tis_hand_worked_single_token():
    old, behav, mask = _t([[LN(0.5)]]), _t([[LN(0.2)]]), torch.ones(1, 1, dtype=torch.bool)
    w, metrics = rollout_correction_weights(old, behav, mask, "tis", tis_threshold=2.0)
    assert w.dtype == torch.float32 and w.item() == pytest.approx(2.0)  # min(0.5/0.2 = 2.5, 2)
    assert metrics[IS_MEAN] == pytest.approx(2.5) and metrics[IS_MAX] == pytest.approx(2.5)  # before truncation
    assert metrics[IS_CLIPPED] == 1.0
    loss, _ = get_policy_loss("ppo")(old.clone(), old, _t([[1.0]]), mask, token_weights=w)
    assert loss.item() == pytest.approx(-2.0)  # −A·ρ·w = −1·1·2


@pytest.mark.parametrize(
    "mode, want",
    [
        ("token-mean", (-2.0 - 1.0 + 0.5) / 3),  # −0.8333: Σ over 3 tokens / 3
        ("seq-mean-token-sum", ((-2.0 - 1.0) + 0.5) / 2),  # −1.25: per-sequence sums, mean over 2
        ("seq-mean-token-mean", ((-2.0 - 1.0) / 2 + 0.5) / 2),  # −0.5: per-sequence means, mean over 2
    ],
)
def test_tis_goes_through_the_aggregation_unchanged(mode, want):
    w, metrics = rollout_correction_weights(OLD, ROLLOUT, MASK, "tis", tis_threshold=2.0)
    torch.testing.assert_close(w, _t([[2.0, 1.0], [0.5, 0.0]]))  # 0 outside the mask
    assert metrics[IS_MEAN] == pytest.approx((2.5 + 1.0 + 0.5) / 3)
    assert metrics[IS_MAX] == pytest.approx(2.5) and metrics[IS_CLIPPED] == pytest.approx(1 / 3)
    loss, m = get_policy_loss("ppo")(OLD.clone(), OLD, ADV, MASK, loss_agg_mode=mode, token_weights=w)
    assert loss.item() == pytest.approx(want)
    assert m["pg_loss"] == pytest.approx(want)


def test_tis_weights_scale_each_tokens_gradient_and_are_detached():
    old = OLD.clone().requires_grad_(True)  # even an old_log_probs with a graph gives detached weights
    w, _ = rollout_correction_weights(old, ROLLOUT, MASK, "tis", tis_threshold=2.0)
    assert not w.requires_grad and w.grad_fn is None
    grads = []
    for weights in (w, None):
        lp = OLD.clone().requires_grad_(True)
        loss, _ = get_policy_loss("ppo")(lp, OLD, ADV, MASK, token_weights=weights)
        loss.backward()
        grads.append(lp.grad)
    # on-policy, inside the clip: ∂ℓ/∂log π = −A·ρ/N per token, times that token's weight
    torch.testing.assert_close(grads[0], grads[1] * w)
    torch.testing.assert_close(grads[0], _t([[-2.0 / 3, -1.0 / 3], [0.5 / 3, 0.0]]))


# ---- decoupled ------------------------------------------------------------------------------------
PROX = _t([[LN(0.5), LN(0.5)]])
BEHAV = _t([[LN(0.25), LN(0.25)]])
THETA = _t([[LN(0.65), LN(0.65)]])
ONE_ROW = torch.ones(1, 2, dtype=torch.bool)


@pytest.mark.parametrize("adv, want", [(1.0, -2.4), (-1.0, 2.6)])
def test_decoupled_hand_worked(adv, want):
    mask = torch.ones(1, 1, dtype=torch.bool)
    w, metrics = rollout_correction_weights(PROX[:, :1], BEHAV[:, :1], mask, "decoupled")
    assert w.item() == pytest.approx(2.0) and metrics[IS_CLIPPED] == 0.0  # no cap: nothing rejected
    # r = 0.65/0.5 = 1.3 → A = +1: −2·min(1.3, 1.2) = −2.4; A = −1: −2·min(−1.3, −1.2) = 2.6 (dual clip c=3 idle)
    loss, m = get_policy_loss("ppo")(THETA[:, :1], PROX[:, :1], _t([[adv]]), mask, token_weights=w)
    assert loss.item() == pytest.approx(want)
    assert m["pg_clipfrac"] == (1.0 if adv > 0 else 0.0)


@pytest.mark.parametrize("mode, want", [("token-mean", (-2.4 + 2.6) / 2), ("seq-mean-token-sum", -2.4 + 2.6)])
def test_decoupled_goes_through_the_aggregation_unchanged(mode, want):
    w, _ = rollout_correction_weights(PROX, BEHAV, ONE_ROW, "decoupled")
    loss, _ = get_policy_loss("ppo")(THETA, PROX, _t([[1.0, -1.0]]), ONE_ROW, loss_agg_mode=mode, token_weights=w)
    assert loss.item() == pytest.approx(want)  # token-mean 0.1; one sequence, token sum 0.2


def test_decoupled_cap_rejects_as_areal():
    # AReaL behav_imp_weight_cap: w > cap → weight 0 (not truncated); the token stays in the normaliser
    prox, behav = _t([[LN(0.5), LN(0.3)]]), _t([[LN(0.25), LN(0.3)]])  # raw w = 2, 1
    w, metrics = rollout_correction_weights(prox, behav, ONE_ROW, "decoupled", behav_weight_cap=1.5)
    torch.testing.assert_close(w, _t([[0.0, 1.0]]))
    assert metrics[IS_MEAN] == pytest.approx(1.5) and metrics[IS_MAX] == pytest.approx(2.0)
    assert metrics[IS_CLIPPED] == 0.5
    loss, _ = get_policy_loss("ppo")(prox.clone(), prox, _t([[1.0, 1.0]]), ONE_ROW, token_weights=w)
    assert loss.item() == pytest.approx((0.0 - 1.0) / 2)  # the rejected token still counts in N = 2
    w_at_cap, _ = rollout_correction_weights(prox, behav, ONE_ROW, "decoupled", behav_weight_cap=2.0)
    assert w_at_cap[0, 0].item() == pytest.approx(2.0)  # w ≤ cap is kept (AReaL's <=)


# ---- shared properties ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_masked_positions_change_nothing_and_the_log_ratio_is_clamped(mode):
    w, metrics = rollout_correction_weights(OLD, ROLLOUT, MASK, mode)
    other = ROLLOUT.clone()
    other[1, 1] = -1e30  # a different masked value
    w2, metrics2 = rollout_correction_weights(OLD, other, MASK, mode)
    assert torch.equal(w, w2) and metrics == metrics2 and w[1, 1] == 0.0
    # a behaviour log-prob of −1000 (log-ratio 1000) is clamped to 20 before exp: finite
    far, far_metrics = rollout_correction_weights(_t([[0.0]]), _t([[-1000.0]]), torch.ones(1, 1, dtype=torch.bool), mode)
    assert torch.isfinite(far).all() and far_metrics[IS_MAX] == pytest.approx(math.exp(20.0))
    empty, empty_metrics = rollout_correction_weights(OLD, ROLLOUT, torch.zeros_like(MASK), mode)
    assert torch.equal(empty, torch.zeros_like(OLD)) and set(empty_metrics.values()) == {0.0}


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown rollout correction 'none'"):
        rollout_correction_weights(OLD, ROLLOUT, MASK, "none")
    with pytest.raises(ValueError, match="must be > 0"):
        rollout_correction_weights(OLD, ROLLOUT, MASK, "tis", tis_threshold=0.0)
    with pytest.raises(ValueError, match=r"\[batch, response_len\]"):
        rollout_correction_weights(OLD, ROLLOUT[:, :1], MASK, "tis")
    with pytest.raises(ValueError, match="token_weights must be"):
        get_policy_loss("ppo")(OLD, OLD, ADV, MASK, token_weights=torch.ones(2, 3))


@pytest.mark.parametrize("name", BUILTIN_POLICY_LOSSES)
def test_every_builtin_loss_weights_its_token_terms(name):
    fn = get_policy_loss(name)
    w = _t([[2.0, 1.0], [0.5, 0.0]])
    loss, _ = fn(OLD.clone(), OLD, ADV, MASK, token_weights=w)
    # on-policy (ρ = s = 1): ppo / gspo / reinforce per token −A; cispo −A·log π
    per_token = -torch.where(MASK, ADV, 0.0) * (OLD if name == "cispo" else 1.0)
    want = float((per_token * w)[MASK].sum() / 3)
    assert loss.item() == pytest.approx(want)


@pytest.mark.parametrize("name", BUILTIN_POLICY_LOSSES)
def test_no_weights_is_bit_identical(name):
    """token_weights=None (rollout_correction none) and all-ones weights leave loss and gradient
    bit-identical to the loss without the option."""
    fn = get_policy_loss(name)
    theta = OLD + _t([[0.1, -0.05], [0.3, 0.0]])  # off-policy, so the clips are exercised
    results = []
    for extra in ({}, {"token_weights": None}, {"token_weights": MASK.float()}):
        lp = theta.clone().requires_grad_(True)
        loss, metrics = fn(lp, OLD, ADV, MASK, loss_agg_mode="seq-mean-token-sum", **extra)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    for loss, grad, metrics in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1]) and metrics == results[0][2]
