"""Rows packed without padding (workers/packed_rows.py, actor.pack_rows): the same log-probs,
entropies and gradients as the padded forward, on fewer token positions."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.sequences import position_ids_from_mask
from hybridflow.batch import Batch
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers import packed_rows, shared_prefix
from workers.log_probs import sequence_log_probs
from workers.packed_rows import bin_rows, layout_tokens, pack_rows_of, plan_packing
from workers.shared_prefix import response_logits

TOK = build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0)


def _batch(lengths=(9, 2, 4, 1, 9, 3), seed: int = 0, texts=None) -> Batch:
    """Prompts of 1–5 tokens (left padded), responses of ``lengths`` tokens (right padded)."""
    texts = texts or ["abc", "hello", "xy", "a", "hello world", "q"][: len(lengths)]
    enc = TOK(texts, return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    width = int(lengths.max())
    rm = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.randint(5, len(TOK), (len(lengths), width), generator=g).masked_fill(~rm, TOK.pad_token_id)
    return Batch.from_dict({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask.bool(),
                            "response_ids": ids, "response_mask": rm})


def test_first_fit_decreasing_bins():
    width, bin_of, offset = bin_rows([9, 2, 4, 1, 9, 3])
    assert width == 9
    # first-fit decreasing at width 9: [9], [9], [4, 3, 2] (full), then the 1 opens a fourth bin
    bins: dict[int, list[int]] = {}
    for i, b in enumerate(bin_of):
        bins.setdefault(b, []).append(i)
    lengths = [9, 2, 4, 1, 9, 3]
    assert all(sum(lengths[i] for i in rows) <= width for rows in bins.values())
    for rows in bins.values():  # rows of a bin sit back to back
        spans = sorted((offset[i], offset[i] + lengths[i]) for i in rows)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert len(bins) == 4 and bin_rows([]) == (0, [], [])


def test_the_plan_restarts_positions_per_row_and_refuses_chosen_positions():
    b = _batch()
    ids = torch.cat([b["prompt_ids"], b["response_ids"]], 1)
    attn = shared_prefix.attention_mask(b)
    plan = plan_packing(ids, attn, position_ids_from_mask(attn))
    assert plan is not None and plan.tokens < ids.numel()
    for i in range(len(ids)):  # each row's real tokens, in order, at positions 0..n-1 of its bin
        n = int(attn[i].sum())
        got = plan.ids[plan.bin_of[i], plan.offset[i] : plan.offset[i] + n]
        assert torch.equal(got, ids[i][attn[i]])
        assert plan.position_ids[plan.bin_of[i], plan.offset[i] : plan.offset[i] + n].tolist() == list(range(n))
    shifted = position_ids_from_mask(attn) + 1  # positions a caller chose: packing would change them
    assert plan_packing(ids, attn, shifted) is None
    empty = attn.clone()
    empty[2] = False
    assert plan_packing(ids, empty, position_ids_from_mask(empty)) is None


@pytest.mark.parametrize("output", ["logits", "hidden"])
def test_packed_log_probs_and_gradients_equal_the_padded_forward(model, output):
    b = _batch()
    mask = b["response_mask"]
    shapes, results = [], {}
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    try:
        for pack in ("off", "on"):
            shapes.clear()
            model.zero_grad(set_to_none=True)
            lp, ent = sequence_log_probs(model, b, temperature=0.7, with_entropy=True, entropy_grad=True,
                                         lm_head="chunked" if output == "hidden" else "full", pack_rows=pack)
            ((lp + 0.1 * ent) * mask).sum().backward()
            results[pack] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                             list(shapes))
    finally:
        hook.remove()
    (lp_p, ent_p, g_p, s_p), (lp_k, ent_k, g_k, s_k) = results["off"], results["on"]
    width = int(shared_prefix.attention_mask(b).sum(1).max())
    assert s_p == [(6, b["prompt_ids"].shape[1] + 9)]  # no prompt repeats: the padded forward
    assert len(s_k) == 1 and s_k[0][1] == width and s_k[0][0] < 6  # fewer, narrower rows
    torch.testing.assert_close(lp_k[mask], lp_p[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_k[mask], ent_p[mask], rtol=1e-5, atol=1e-5)
    # padding positions come from zero logits/hidden states (one constant), not from another row's tokens
    assert torch.unique(lp_k[~mask]).numel() == 1
    for n in g_p:
        torch.testing.assert_close(g_k[n], g_p[n], rtol=1e-4, atol=1e-6, msg=n)


def test_auto_takes_the_layout_with_fewer_positions(model, monkeypatch):
    calls = []
    real = packed_rows.packed_response_positions
    monkeypatch.setattr(packed_rows, "packed_response_positions", lambda *a, **k: calls.append(1) or real(*a, **k))
    ragged = _batch()  # 6 rows, responses 1..9 tokens, no prompt repeats: packing saves positions
    response_logits(model, ragged, pack_rows="auto")
    assert calls == [1]
    calls.clear()
    # 4 samples of one prompt, equal lengths: sharing the prompt computes the fewest positions
    same = _batch(lengths=(6, 6, 6, 6), texts=["hello world"] * 4)
    attn = shared_prefix.attention_mask(same)
    groups = shared_prefix.prompt_groups(same["prompt_ids"], same["prompt_mask"])
    cost = layout_tokens(attn, same["prompt_ids"].shape[1], groups)
    assert cost["shared_prompt"] < cost["packed"] <= cost["padded"]
    auto = response_logits(model, same, pack_rows="auto")
    assert calls == []
    forced = response_logits(model, same, pack_rows="on")
    assert calls == [1]
    torch.testing.assert_close(auto, forced, rtol=1e-5, atol=1e-5)


def test_a_model_that_cannot_take_packed_rows(model):
    b = _batch()
    assert pack_rows_of(model) == (True, "")  # the tiny llama on sdpa
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model  # a DDP wrapper's .module is unwrapped to find the config
    assert pack_rows_of(wrapped)[0]
    stub = torch.nn.Module()
    stub.config = type("C", (), {"model_type": "llama", "_attn_implementation": "paged_attention"})()
    ok, why = pack_rows_of(stub)
    assert not ok and "paged_attention" in why

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model
            self.config = type("C", (), {"model_type": "gpt2", "_attn_implementation": "sdpa"})()

        def forward(self, **kw):
            return self.inner(**kw)

    ok, why = pack_rows_of(Other())
    assert not ok and "gpt2" in why
    with pytest.raises(ValueError, match="actor.pack_rows=on: cannot pack rows for this model .*gpt2"):
        response_logits(Other(), b, pack_rows="on")
    torch.testing.assert_close(response_logits(Other(), b, pack_rows="auto"), response_logits(model, b))


def test_the_chunked_head_scores_the_response_tokens_only(model, monkeypatch):
    from workers import log_probs

    seen = []
    real = log_probs.log_probs_from_hidden
    monkeypatch.setattr(log_probs, "log_probs_from_hidden", lambda h, *a, **k: seen.append(len(h)) or real(h, *a, **k))
    b = _batch()
    lp, _ = sequence_log_probs(model, b, temperature=1.0, lm_head="chunked", pack_rows="on")
    full, _ = sequence_log_probs(model, b, temperature=1.0, lm_head="full", pack_rows="off")
    assert seen == [int(b["response_mask"].sum())]  # not B × R: padding is not scored
    mask = b["response_mask"]
    torch.testing.assert_close(lp[mask], full[mask], rtol=1e-5, atol=1e-5)
    assert bool((lp[~mask] == 0).all())


def test_yaml_on_and_off_are_the_pack_rows_values():
    from hybridflow.config import ConfigError, load_config

    assert load_config(None, ["actor.pack_rows=off"]).actor.pack_rows == "off"
    assert load_config(None, ["actor.pack_rows=on"]).actor.pack_rows == "on"
    assert load_config(None, []).actor.pack_rows == "auto"
    with pytest.raises(ConfigError, match="actor.pack_rows"):
        load_config(None, ["actor.pack_rows=sometimes"])


def test_rows_with_a_hole_or_a_right_padded_prompt_are_not_packed(model):
    b = _batch(lengths=(8, 5, 3, 8))
    rm = b["response_mask"].clone()
    rm[0, 3] = False  # a hole inside a response, no observation_mask
    holed = Batch.from_dict({**{k: b[k] for k in ("prompt_ids", "prompt_mask", "response_ids")}, "response_mask": rm})
    enc = TOK(["abc", "hello", "xy", "a"], return_tensors="pt", padding=True, padding_side="right")
    right = Batch.from_dict({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask.bool(),
                             "response_ids": b["response_ids"], "response_mask": b["response_mask"]})
    for batch in (holed, right):
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        attn = shared_prefix.attention_mask(batch)
        assert plan_packing(ids, attn, position_ids_from_mask(attn)) is None
        # so every layout computes what the padded one does, pads' outputs included
        torch.testing.assert_close(response_logits(model, batch, pack_rows="on"), response_logits(model, batch))


def test_auto_does_not_pack_where_the_full_head_would_compute_more_logits(model, monkeypatch):
    # prompts of very different widths, short responses: the bins need most columns of the head
    texts = ["a", "hello world, how are you today my friend", "xy", "a much longer prompt than the others here"]
    b = _batch(lengths=(2, 3, 1, 2), texts=texts)
    ids = torch.cat([b["prompt_ids"], b["response_ids"]], 1)
    attn = shared_prefix.attention_mask(b)
    plan = plan_packing(ids, attn, position_ids_from_mask(attn))
    p_len, r_len = b["prompt_ids"].shape[1], b["response_ids"].shape[1]
    assert plan is not None and plan.tokens < ids.numel()  # fewer body positions...
    assert packed_rows.head_rows(plan, p_len, r_len) > len(ids) * (r_len + 1)  # ...but more head rows
    calls = []
    real = packed_rows.packed_response_positions
    monkeypatch.setattr(packed_rows, "packed_response_positions", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    sequence_log_probs(model, b, temperature=1.0, lm_head="full", pack_rows="auto")
    assert calls == []  # the full head keeps the padded layout
    sequence_log_probs(model, b, temperature=1.0, lm_head="chunked", pack_rows="auto")
    assert calls == ["last_hidden_state"]  # the chunked head scores response tokens only: packing pays
