"""Shared-prompt forward (workers/shared_prefix.py): each distinct prompt runs once, and the
logits and the gradient equal those of the full forward over every [prompt ‖ response] row."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers import shared_prefix
from workers.shared_prefix import prompt_groups, response_logits

TOK = build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0)


def _batch(seed: int = 0) -> Batch:
    """Prompts "abc" ×3 (2 left pads), "hello" ×2 (no pads), "xy" ×1; ragged responses of ≤ 5 tokens."""
    texts = ["abc"] * 3 + ["hello"] * 2 + ["xy"]
    enc = TOK(texts, return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 1, 5, 3])
    rm = torch.arange(5)[None, :] < lengths[:, None]
    ids = torch.randint(5, len(TOK), (6, 5), generator=g).masked_fill(~rm, TOK.pad_token_id)
    return Batch.from_dict({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask.bool(),
                            "response_ids": ids, "response_mask": rm}, {"uid": list("aaabbc")})


def test_prompt_groups_finds_repeated_prompts():
    b = _batch()
    first, inverse = prompt_groups(b["prompt_ids"], b["prompt_mask"])
    assert inverse[first].tolist() == list(range(3))  # first[u] is a row of prompt u
    rows_of = {u: (inverse == u).nonzero().flatten().tolist() for u in range(3)}
    assert sorted(rows_of.values()) == [[0, 1, 2], [3, 4], [5]]
    assert all(min(rows) == first[u] for u, rows in rows_of.items())
    assert prompt_groups(b["prompt_ids"][[0, 3, 5]], b["prompt_mask"][[0, 3, 5]]) is None  # nothing repeats
    right_padded = b["prompt_mask"].clone()
    right_padded[0, -1] = False
    assert prompt_groups(b["prompt_ids"], right_padded) is None  # a prompt that ends in padding


def test_each_prompt_runs_once_and_logits_and_gradients_match_the_full_forward(model, monkeypatch):
    b = _batch()
    shapes = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    p_len = b["prompt_ids"].shape[1]
    mask = b["response_mask"]
    grads = {}
    try:
        for shared in (True, False):
            shapes.clear()
            monkeypatch.setattr(shared_prefix, "shares_prompts", lambda m, s=shared: s)
            model.zero_grad(set_to_none=True)
            logits = response_logits(model, b)
            lp = torch.log_softmax(logits, -1).gather(-1, b["response_ids"][..., None])[..., 0]
            (lp * mask).sum().backward()
            grads[shared] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, list(shapes))
    finally:
        hook.remove()
    (l_s, g_s, shapes_s), (l_f, g_f, shapes_f) = grads[True], grads[False]
    assert shapes_s == [(3, p_len - 1), (6, 5)]  # 3 distinct prompts once, then 6 suffixes of 5 tokens
    assert shapes_f == [(6, p_len + 5)]
    torch.testing.assert_close(l_s[mask], l_f[mask], rtol=1e-5, atol=1e-5)
    for n in g_f:
        torch.testing.assert_close(g_s[n], g_f[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_forward_without_a_cache_argument_takes_the_full_path(model):
    class NoCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache)

    wrapped = NoCache(model)
    assert shared_prefix.forward_kwargs(wrapped) == (None, {})
    assert shared_prefix.forward_kwargs(model)[0] in ("cache", "past_key_values")
    b = _batch()
    with torch.no_grad():
        torch.testing.assert_close(response_logits(wrapped, b)[b["response_mask"]],
                                   response_logits(model, b)[b["response_mask"]], rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_in_training_takes_the_full_forward():
    m = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0)
    assert shared_prefix.shares_prompts(m)
    m.gradient_checkpointing_enable()
    m.train()
    assert not shared_prefix.shares_prompts(m)  # the cache would be switched off: no split
    m.eval()
    assert shared_prefix.shares_prompts(m)  # inference has a cache again


def test_empty_responses_and_own_position_ids(model):
    b = _batch()
    empty = Batch.from_dict({"prompt_ids": b["prompt_ids"], "prompt_mask": b["prompt_mask"],
                             "response_ids": b["response_ids"][:, :0], "response_mask": b["response_mask"][:, :0]})
    assert response_logits(model, empty).shape == (6, 0, len(TOK))  # no suffix to run: the full path
    # rows with equal tokens but other (caller-given) prompt positions are different prompts
    pos = torch.arange(b["prompt_ids"].shape[1]).repeat(6, 1)
    pos[1] += 3
    first, inverse = prompt_groups(b["prompt_ids"], b["prompt_mask"], pos)
    assert len(first) == 4 and inverse[0] != inverse[1] and inverse[0] == inverse[2]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the demo's policy pool; the race needs more than one thread
    yield
    torch.set_num_threads(before)


def _gather_grad(gather) -> bytes:
    """The gradient that reaches one prompt's KV cache (SmolLM2-135M's layer shape: 3 KV heads × 48
    positions × 64) through a gather to its 8 samples, as bytes."""
    from transformers.cache_utils import DynamicCache

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 3, 48, 64, generator=g, requires_grad=True)
    values = torch.randn(1, 3, 48, 64, generator=g, requires_grad=True)
    cache = DynamicCache()
    cache.update(keys, values, 0)
    gather(cache, torch.zeros(8, dtype=torch.long))
    upstream = torch.randn(8, 3, 48, 64, generator=g)
    layer = cache.layers[0]
    ((layer.keys * upstream).sum() + (layer.values * upstream).sum()).backward()
    return keys.grad.numpy().tobytes() + values.grad.numpy().tobytes()


def test_the_cache_gather_adds_its_gradient_in_the_same_order_every_time(two_threads):
    # issue 15 item 8: transformers' batch_select_indices (keys[rows, ...]) backpropagates with
    # index_put_(accumulate=True), which on CPU adds the 8 samples' gradients with atomics in thread
    # order: measured here, 21 different results in 200 repeats. gather_rows (index_select) must
    # give one result.
    results = {_gather_grad(shared_prefix.gather_rows) for _ in range(200)}
    assert len(results) == 1


def test_the_shared_prompt_forward_gathers_with_gather_rows(model, two_threads, monkeypatch):
    calls = []
    real = shared_prefix.gather_rows
    monkeypatch.setattr(shared_prefix, "gather_rows", lambda c, r: (calls.append(r.tolist()), real(c, r)))
    monkeypatch.setattr(shared_prefix, "shares_prompts", lambda m: True)
    grads = set()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        b = _batch()
        logits = response_logits(model, b)
        torch.log_softmax(logits, -1).gather(-1, b["response_ids"][..., None])[..., 0][b["response_mask"]].sum().backward()
        grads.add(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
    assert calls == [[1, 1, 1, 2, 2, 0]] * 3  # the distinct prompts in torch.unique order: "abc" → 1
    assert len(grads) == 1
