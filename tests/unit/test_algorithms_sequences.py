"""Log-probs / entropy from logits, position ids, response masks, overlong shaping."""

from __future__ import annotations

import math

import pytest
import torch

import hybridflow.algorithms as A
from hybridflow.algorithms import logits as logits_mod


def naive_log_probs(logits, labels, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def test_temperature_reference_values():
    # logits / 0.5 = [4, 2, 0]; logsumexp = ln(e⁴ + e² + 1) = ln(62.9872) = 4.142932
    # token 0: 4 − 4.142932 = −0.142932 ; token 2: 0 − 4.142932 = −4.142932
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    got = A.log_probs_from_logits(logits, torch.tensor([0, 2]), temperature=0.5)
    torch.testing.assert_close(got, torch.tensor([-0.142932, -4.142932]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_match_naive_in_value_and_gradient(temperature, monkeypatch):
    monkeypatch.setattr(logits_mod, "BLOCK_ELEMENTS", 40)  # force several blocks per call
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 6, 11, generator=g) * 3
    labels = torch.randint(0, 11, (3, 4), generator=g)
    for make in (lambda x: x[:, 1:5], lambda x: x[:, 1:5].contiguous()):  # sliced view and contiguous
        x1 = full.clone().requires_grad_()
        x2 = full.clone().requires_grad_()
        lp = A.log_probs_from_logits(make(x1), labels, temperature=temperature)
        ent = A.entropy_from_logits(make(x1), temperature=temperature)
        lp_ref = naive_log_probs(make(x2), labels, temperature)
        ent_ref = naive_entropy(make(x2), temperature)
        torch.testing.assert_close(lp, lp_ref)
        torch.testing.assert_close(ent, ent_ref)
        w1, w2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
        (lp * w1 + ent * w2).sum().backward()
        (lp_ref * w1 + ent_ref * w2).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad)


def test_entropy_reference_values():
    # uniform over 4 tokens: ln 4 = 1.386294 ; one-hot-ish [100, 0]: ≈ 0
    got = A.entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(got, torch.tensor([math.log(4), 0.0]))
    # a banned token (−inf logit) contributes nothing: two live tokens → ln 2
    torch.testing.assert_close(A.entropy_from_logits(torch.tensor([0.0, 0.0, -math.inf])), torch.tensor(math.log(2)))


def saved_for_backward(fn, logits) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits)
    return saved


def test_log_probs_keep_no_vocab_sized_copy_for_backward():
    logits = torch.randn(2, 5, 64, requires_grad=True)
    labels = torch.randint(0, 64, (2, 5))
    for fn in (lambda x: A.log_probs_from_logits(x, labels), lambda x: A.entropy_from_logits(x)):
        big = [t for t in saved_for_backward(fn, logits) if t.numel() >= logits.numel()]
        assert all(t.data_ptr() == logits.data_ptr() for t in big)  # only the logits themselves
    # the naive version keeps a float32 [2, 5, 64] log-softmax: the check above would catch it
    naive = [t for t in saved_for_backward(lambda x: naive_log_probs(x, labels), logits) if t.numel() >= logits.numel()]
    assert any(t.data_ptr() != logits.data_ptr() for t in naive)


def test_log_probs_errors():
    with pytest.raises(ValueError, match="temperature"):
        A.log_probs_from_logits(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        A.log_probs_from_logits(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


# ---- position ids ----------------------------------------------------------------------------


def test_position_ids_reference_value():
    # cumsum [0,0,1,2,3] − 1 = [−1,−1,0,1,2] → clipped [0,0,0,1,2]
    got = A.position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    assert got.tolist() == [[0, 0, 0, 1, 2]] and got.dtype == torch.int64


def test_log_probs_do_not_depend_on_left_padding():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    seq = torch.tensor([5, 6, 7, 8, 9])

    def seq_log_probs(n_pads: int) -> torch.Tensor:
        ids = torch.cat([torch.zeros(n_pads, dtype=torch.long), seq]).unsqueeze(0)
        attn = torch.cat([torch.zeros(n_pads, dtype=torch.long), torch.ones(len(seq), dtype=torch.long)]).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn, position_ids=A.position_ids_from_mask(attn)).logits
        return A.log_probs_from_logits(logits[:, n_pads:-1], ids[:, n_pads + 1 :])

    torch.testing.assert_close(seq_log_probs(0), seq_log_probs(3), atol=1e-5, rtol=1e-5)


# ---- response mask ---------------------------------------------------------------------------


def test_response_mask_reference_values():
    ids = torch.tensor([[11, 12, 3, 0, 0], [5, 7, 9, 0, 0], [2, 4, 2, 4, 4], [1, 1, 1, 1, 1]])
    # row 0: stop 3 at position 2 → T T T F F ; row 2: stop at 0 → T F F F F
    # row 1: no stop, generated length 3 → T T T F F ; row 3: no stop, length 5 → all T
    got = A.response_mask_from_ids(ids, {2, 3}, response_lengths=torch.tensor([5, 3, 5, 5]))
    assert got.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert got.dtype == torch.bool
    # without lengths a response with no stop counts to the end of the row
    assert A.response_mask_from_ids(ids[1:2], [2, 3]).int().tolist() == [[1, 1, 1, 1, 1]]


# ---- overlong --------------------------------------------------------------------------------


def test_overlong_penalty_reference_values():
    # L_max 20, buffer 4 → ramp from 16: len 10 → 0; 16 → 0; 18 → (16 − 18)/4 = −0.5; 20 → −1
    got = A.overlong_penalty(torch.tensor([10, 16, 18, 20]), max_response_tokens=20, buffer_tokens=4, penalty_factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    half = A.overlong_penalty(torch.tensor([19]), max_response_tokens=20, buffer_tokens=4, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([-0.375]))  # −3/4 · 0.5
    none = A.overlong_penalty(torch.tensor([20]), max_response_tokens=20, buffer_tokens=0, penalty_factor=1.0)
    assert none.tolist() == [0.0]
    with pytest.raises(ValueError, match="buffer_tokens"):
        A.overlong_penalty(torch.tensor([1]), max_response_tokens=4, buffer_tokens=5, penalty_factor=1.0)
