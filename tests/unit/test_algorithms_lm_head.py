"""The chunked LM head (hybridflow/algorithms/logits.py ``log_probs_from_hidden``): the log-probs,
entropies and gradients of the plain head + log-softmax, without ever holding the [rows, vocab]
logits — checked against torch.autograd of the plain path, and by watching every allocation."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.algorithms import log_probs_from_hidden

N, H, V = 37, 16, 53  # 37 rows in chunks of 8: a short last chunk


def _inputs(seed: int = 0, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, labels


def _plain(hidden, weight, bias, labels, temperature):
    z = torch.nn.functional.linear(hidden, weight, bias) / temperature
    log_p = torch.log_softmax(z, -1)
    return log_p.gather(-1, labels[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def _grads(lp, ent, tensors, seed=1):
    """Gradients of a loss using both outputs with random per-row weights."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return torch.autograd.grad((lp * a).sum() + (ent * b).sum(), tensors)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_plain_head(bias, temperature):
    hidden, weight, b, labels = _inputs(bias=bias)
    tensors = [hidden, weight] + ([b] if bias else [])
    lp, ent = log_probs_from_hidden(hidden, weight, labels, temperature=temperature, bias=b, with_entropy=True,
                                    chunk_rows=8)
    lp_ref, ent_ref = _plain(hidden, weight, b, labels, temperature)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(lp, ent, tensors), _grads(lp_ref, ent_ref, tensors), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_log_probs_alone_and_a_detached_entropy_give_the_log_prob_gradient():
    hidden, weight, _, labels = _inputs()
    lp, ent = log_probs_from_hidden(hidden, weight, labels, with_entropy=True, chunk_rows=5)
    lp_only, none = log_probs_from_hidden(hidden, weight, labels, chunk_rows=5)
    assert none is None
    lp_ref, _ = _plain(hidden, weight, None, labels, 1.0)
    want = torch.autograd.grad(lp_ref.sum(), [hidden, weight])
    for out in (lp, lp_only):  # the entropy output unused: its gradient arrives as None
        for got, w in zip(torch.autograd.grad(out.sum(), [hidden, weight]), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)


def test_a_tied_weight_gets_the_head_and_the_embedding_gradients():
    # SmolLM2 ties lm_head.weight to embed_tokens.weight: the head's gradient adds to the lookup's
    g = torch.Generator().manual_seed(3)
    table = torch.randn(V, H, generator=g, requires_grad=True)
    ids, labels = torch.randint(0, V, (N,), generator=g), torch.randint(0, V, (N,), generator=g)
    hidden = torch.tanh(torch.nn.functional.embedding(ids, table))
    lp, _ = log_probs_from_hidden(hidden, table, labels, chunk_rows=6)
    (got,) = torch.autograd.grad(lp.sum(), [table])
    ref, _ = _plain(torch.tanh(torch.nn.functional.embedding(ids, table)), table, None, labels, 1.0)
    (want,) = torch.autograd.grad(ref.sum(), [table])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class LargestWithVocab(TorchDispatchMode):
    """Records the most rows (numel ÷ vocab) of any newly allocated tensor whose last dim is the vocab."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_tensor_of_more_than_a_chunk_of_logits_exists_or_is_saved():
    hidden, weight, _, labels = _inputs()
    saved = []

    def run(fn):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
            with LargestWithVocab(V) as watch:
                lp, ent = fn()
                torch.autograd.grad((lp + ent).sum(), [hidden, weight])
        return watch.rows, [s for s in saved if s and s[-1] == V]

    rows, saved_vocab = run(lambda: log_probs_from_hidden(hidden, weight, labels, with_entropy=True, chunk_rows=4))
    assert rows <= 4 and saved_vocab == []
    # the detectors see the full logits of the plain path (so the checks above can fail)
    rows, saved_vocab = run(lambda: _plain(hidden, weight, None, labels, 1.0))
    assert rows == N and (N, V) in saved_vocab


def test_bad_shapes_and_temperature_are_refused():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_hidden(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_hidden(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="weight"):
        log_probs_from_hidden(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="bias"):
        log_probs_from_hidden(hidden, weight, labels, bias=torch.zeros(V + 1))


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_matmuls_equal_a_bf16_head_under_autocast_with_a_float32_log_softmax(bias):
    """matmul_dtype=bfloat16 (bf16-mixed / bf16-true): the plain head under autocast (bf16 logits) and a
    float32 log-softmax, as TRL's bf16=True computes it; values equal it to float rounding, gradients to
    the bf16 rounding of each chunk's d W (summed in float32) — and all outputs and gradients are float32."""
    hidden, weight, b, labels = _inputs(seed=3, bias=bias)
    tensors = [hidden, weight] + ([b] if bias else [])
    lp, ent = log_probs_from_hidden(hidden, weight, labels, temperature=0.7, bias=b, with_entropy=True,
                                    chunk_rows=8, matmul_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = torch.nn.functional.linear(hidden, weight, b)
    assert z.dtype == torch.bfloat16
    log_p = torch.log_softmax(z.float() / 0.7, -1)
    lp_ref, ent_ref = log_p.gather(-1, labels[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    got, want = _grads(lp, ent, tensors), _grads(lp_ref, ent_ref, tensors)
    for g_got, g_want, t in zip(got, want, tensors, strict=True):
        assert g_got.dtype == t.dtype == torch.float32
        torch.testing.assert_close(g_got, g_want.float(), rtol=2e-2, atol=2e-2)
    # and far from a float32 head's numbers: the bf16 path is really taken
    lp32, _ = log_probs_from_hidden(hidden, weight, labels, temperature=0.7, bias=b, chunk_rows=8)
    assert (lp32 - lp).abs().max() > 1e-4


def test_another_matmul_dtype_is_refused():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match="matmul_dtype"):
        log_probs_from_hidden(hidden, weight, labels, matmul_dtype=torch.float16)
