"""Loss aggregation, the gradient-accumulation contract, and masked statistics."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridflow.algorithms as A

MODES = A.LOSS_AGG_MODES
MAX_TOKENS = 4


def a_and_b():
    """Sequence A has token losses [1, 2, 3], sequence B has [6]; padding holds junk."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [6.0, 99.0, float("nan")]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return loss, mask


def test_aggregation_reference_values():
    loss, mask = a_and_b()
    # token-mean: (1+2+3+6)/4 = 3 ; seq-mean-token-mean: (2 + 6)/2 = 4
    # seq-mean-token-sum: (6 + 6)/2 = 6 ; seq-mean-token-sum-norm: (6/4 + 6/4)/2 = 1.5
    want = {"token-mean": 3.0, "seq-mean-token-mean": 4.0, "seq-mean-token-sum": 6.0, "seq-mean-token-sum-norm": 1.5}
    for mode, value in want.items():
        got = A.aggregate_loss(loss, mask, mode, max_response_tokens=MAX_TOKENS)
        torch.testing.assert_close(got, torch.tensor(value))


def test_token_mean_accumulation_uses_the_global_normaliser():
    # micro-batch 1: token losses [4]; micro-batch 2: [0, 0, 0]. 4 tokens in the mini-batch.
    # accumulated: 4/4 + 0/4 = 1.0 (averaging per-micro means would give (4 + 0)/2 = 2.0)
    w = torch.tensor(1.0, requires_grad=True)
    loss = torch.stack([torch.tensor([4.0, 0.0, 0.0]), torch.zeros(3), torch.zeros(3)]) * w
    mask = torch.tensor([[True, False, False], [True, True, False], [True, False, False]])
    plan = A.accumulation_plan(mask, 1, "token-mean")
    assert [mb.global_normalizer for mb in plan] == [4.0, 4.0, 4.0]
    micro_1 = plan[0].aggregate(loss[plan[0].rows], mask[plan[0].rows])
    micro_2 = sum(mb.aggregate(loss[mb.rows], mask[mb.rows]) for mb in plan[1:])
    total = micro_1 + micro_2
    torch.testing.assert_close(total, torch.tensor(1.0))
    (g_acc,) = torch.autograd.grad(total, w)
    loss = torch.stack([torch.tensor([4.0, 0.0, 0.0]), torch.zeros(3), torch.zeros(3)]) * w  # fresh graph
    (g_full,) = torch.autograd.grad(A.aggregate_loss(loss, mask, "token-mean"), w)
    torch.testing.assert_close(g_acc, g_full)
    # the mistake the plan prevents: mean of micro-batch means
    wrong = (A.aggregate_loss(loss[:1], mask[:1], "token-mean") + A.aggregate_loss(loss[1:], mask[1:], "token-mean")) / 2
    torch.testing.assert_close(wrong, torch.tensor(2.0))


def random_minibatch(seed: int, B: int = 7, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full row
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    x = torch.randn(B, T, generator=g)
    return x, mask


def accumulated(x_param, mask, mode, micro, **plan_kw):
    total = 0.0
    for mb in A.accumulation_plan(mask, micro, mode, max_response_tokens=MAX_TOKENS + 2, **plan_kw):
        total = total + mb.aggregate(x_param[mb.rows] ** 2, mask[mb.rows])
    return total


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("micro", [1, 2, 3, 7])
def test_accumulation_reproduces_full_batch_loss_and_gradient(mode, micro):
    x, mask = random_minibatch(micro)
    p = x.clone().requires_grad_()
    full = A.aggregate_loss(p**2, mask, mode, max_response_tokens=MAX_TOKENS + 2)
    (g_full,) = torch.autograd.grad(full, p)
    acc = accumulated(p, mask, mode, micro)
    (g_acc,) = torch.autograd.grad(acc, p)
    torch.testing.assert_close(acc, full)
    torch.testing.assert_close(g_acc, g_full)


@pytest.mark.parametrize("name", ["ppo", "gspo", "reinforce", "cispo"])
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_accumulation_matches_full_batch(name, mode):
    g = torch.Generator().manual_seed(5)
    x, mask = random_minibatch(9, B=8)
    lp = (x * 0.1 - 1.0).requires_grad_()
    old = lp.detach() + torch.randn(lp.shape, generator=g) * 0.1
    adv = torch.randn(lp.shape, generator=g)
    loss_fn = A.get_policy_loss(name)
    full, _ = loss_fn(lp, old, adv, mask, loss_agg_mode=mode, max_response_tokens=8)
    (g_full,) = torch.autograd.grad(full, lp)
    acc = 0.0
    for mb in A.accumulation_plan(mask, 3, mode, max_response_tokens=8):
        loss, _ = loss_fn(lp[mb.rows], old[mb.rows], adv[mb.rows], mask[mb.rows], **mb.loss_kwargs)
        acc = acc + loss
    (g_acc,) = torch.autograd.grad(acc, lp)
    torch.testing.assert_close(acc, full)
    torch.testing.assert_close(g_acc, g_full)


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_plan_gives_the_global_gradient(mode):
    """Two ranks hold rows [0:4] and [4:7]; DDP averages their gradients."""
    x, mask = random_minibatch(21)
    p = x.clone().requires_grad_()
    full = A.aggregate_loss(p**2, mask, mode, max_response_tokens=MAX_TOKENS + 2)
    (g_full,) = torch.autograd.grad(full, p)
    shards = [slice(0, 4), slice(4, 7)]
    locals_ = [A.loss_normalizer(mask[s], mode, MAX_TOKENS + 2) for s in shards]

    def all_reduce_sum(_: float) -> float:  # what torch.distributed.all_reduce(SUM) returns
        return sum(locals_)

    rank_losses = [accumulated(p[s], mask[s], mode, 2, sum_across_ranks=all_reduce_sum, world_size=2) for s in shards]
    grads = [torch.autograd.grad(loss, p)[0] for loss in rank_losses]
    torch.testing.assert_close((grads[0] + grads[1]) / 2, g_full)  # DDP's average
    torch.testing.assert_close((rank_losses[0] + rank_losses[1]) / 2, full)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(MODES), st.lists(st.integers(1, 4), min_size=1, max_size=6))
def test_any_split_into_micro_batches_keeps_loss_and_gradient(seed, mode, sizes):
    B = sum(sizes)
    x, mask = random_minibatch(seed, B=B)
    p = x.clone().requires_grad_()
    kw = {"max_response_tokens": 10}
    full = A.aggregate_loss(p**3, mask, mode, **kw)
    (g_full,) = torch.autograd.grad(full, p)
    norm = A.loss_normalizer(mask, mode, 10)
    acc, start = 0.0, 0
    for n in sizes:  # uneven consecutive micro-batches
        rows = slice(start, start + n)
        acc = acc + A.aggregate_loss(p[rows] ** 3, mask[rows], mode, global_normalizer=norm, **kw)
        start += n
    (g_acc,) = torch.autograd.grad(acc, p)
    torch.testing.assert_close(acc, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_acc, g_full, rtol=1e-5, atol=1e-5)


def test_loss_normalizer_counts():
    _, mask = a_and_b()
    empty_row = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    assert A.loss_normalizer(empty_row, "token-mean") == 4.0  # 3 + 1 tokens
    assert A.loss_normalizer(empty_row, "seq-mean-token-mean") == 2.0  # the empty row is not a sequence
    assert A.loss_normalizer(empty_row, "seq-mean-token-sum-norm", MAX_TOKENS) == 2.0


def test_empty_minibatch_gives_zero_not_nan():
    loss = torch.ones(2, 3)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        assert float(A.aggregate_loss(loss, mask, mode, max_response_tokens=3)) == 0.0
        assert float(A.aggregate_loss(loss, mask, mode, max_response_tokens=3, global_normalizer=0.0)) == 0.0


def test_aggregation_errors():
    loss, mask = a_and_b()
    with pytest.raises(ValueError, match="max_response_tokens"):
        A.aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="allowed: token-mean"):
        A.aggregate_loss(loss, mask, "seq-mean")
    with pytest.raises(ValueError, match=">= 0"):
        A.aggregate_loss(loss, mask, "token-mean", global_normalizer=-1.0)
    with pytest.raises(ValueError, match="micro_batch_trajectories"):
        A.accumulation_plan(mask, 0, "token-mean")


# ---- masked statistics ----------------------------------------------------------------------


def test_masked_entropy_mean_reference_value():
    # valid entropies 1, 2, 3 → (1 + 2 + 3)/3 = 2.0 ; the 9.9s are padding
    ent = torch.tensor([[1.0, 2.0, 9.9], [3.0, 9.9, 9.9]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    torch.testing.assert_close(A.masked_mean(ent, mask), torch.tensor(2.0))
    torch.testing.assert_close(A.aggregate_loss(ent, mask, "token-mean"), torch.tensor(2.0))


def test_masked_var_and_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, float("inf")]])
    mask = torch.tensor([[True, True, True, False]])
    # mean 2, unbiased var (1 + 0 + 1)/2 = 1 ; biased 2/3
    torch.testing.assert_close(A.masked_var(x, mask), torch.tensor(1.0))
    torch.testing.assert_close(A.masked_var(x, mask, unbiased=False), torch.tensor(2 / 3))
    w = A.masked_whiten(x, mask)
    torch.testing.assert_close(w[mask], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    w2 = A.masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(w2[mask], torch.tensor([1.0, 2.0, 3.0]), atol=1e-6, rtol=0)
    # one element: variance 0, whitening gives 0 (finite), not an error
    one = torch.tensor([[5.0, 0.0]])
    m1 = torch.tensor([[True, False]])
    assert float(A.masked_var(one, m1)) == 0.0 and float(A.masked_whiten(one, m1)[0, 0]) == 0.0
    assert float(A.masked_mean(one, torch.zeros_like(m1))) == 0.0
