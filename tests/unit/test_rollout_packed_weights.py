"""rollout.packed_weights: the hf engine's linears on oneDNN-packed weights during generation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridflow.config import load_config
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers.rollout.base import SamplingParams
from workers.rollout.hf import HFRolloutEngine
from workers.rollout.packed_weights import available, packed_linears

TOK = build_tiny_tokenizer()
STOPS = (2, *TOK.convert_tokens_to_ids(list("abcde")))

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not available(), reason="this torch build has no oneDNN CPU kernels"),
]


def prompts(texts):
    enc = TOK(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"].bool()


def linears(model):
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_packs_every_plain_linear_inside_the_block_only_and_matches_f_linear():
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval()
    ids = torch.randint(0, len(TOK), (3, 7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with packed_linears(model, 3) as count:
            assert count == len(linears(model)) > 0
            assert all("forward" in m.__dict__ for m in linears(model))
            got = model(input_ids=ids).logits
    assert all("forward" not in m.__dict__ for m in linears(model))
    assert not torch.equal(got, torch.zeros_like(got))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_forward_is_restored_when_the_block_raises():
    layer = nn.Linear(4, 3)
    with pytest.raises(RuntimeError, match="boom"), packed_linears(layer, 2):
        assert "forward" in layer.__dict__
        raise RuntimeError("boom")
    assert "forward" not in layer.__dict__


def test_leaves_layers_it_cannot_pack_alone():
    class MyLinear(nn.Linear):  # a subclass may compute something else (quantized, LoRA, ...)
        pass

    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    model = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4), nn.Linear(4, 4).to(torch.float64), hooked,
                          nn.Linear(4, 4, bias=False))  # fmt: skip
    with packed_linears(model, 1) as count:
        packed = [i for i, m in enumerate(model) if "forward" in m.__dict__]
    assert count == 2 and packed == [0, 4]


def test_packed_weights_follow_an_update_between_generate_calls():
    """The pack is made per call: after an optimizer step the packed engine generates what an
    unpacked one does on the new weights (same greedy tokens; log-probs to float rounding)."""
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0)
    packed, plain = HFRolloutEngine(model, TOK, fused_decode=False), HFRolloutEngine(model, TOK, packed_weights=False, fused_decode=False)
    ids, mask = prompts(["hello", "abc d"])
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=STOPS, n=2)
    before = packed.generate(ids, mask, greedy)
    assert packed.packed_linears == len(linears(model)) and plain.packed_linears == 0
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    model(input_ids=ids).logits[..., 3].sum().backward()
    opt.step()
    after_packed, after_plain = packed.generate(ids, mask, greedy), plain.generate(ids, mask, greedy)
    assert not torch.equal(before.response_ids, after_plain.response_ids)  # the update changed the output
    assert torch.equal(after_packed.response_ids, after_plain.response_ids)
    assert (after_packed.rollout_log_probs - after_plain.rollout_log_probs).abs().max() < 1e-4
    assert model.training  # generate restores the mode


@pytest.mark.parametrize("drop_finished_rows", [True, False])
def test_sampled_rollout_equals_the_unpacked_engine(drop_finished_rows):
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=1).eval()
    ids, mask = prompts(["a", "hello there", "xyz"])
    sampling = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, stop_token_ids=STOPS, n=4, seed=5)
    a = HFRolloutEngine(model, TOK, drop_finished_rows=drop_finished_rows, fused_decode=False).generate(ids, mask, sampling)
    b = HFRolloutEngine(model, TOK, drop_finished_rows=drop_finished_rows, packed_weights=False, fused_decode=False).generate(
        ids, mask, sampling)
    same = (a.response_ids == b.response_ids).all(-1)
    assert same.float().mean() >= 0.9  # a token flips only where a uniform sits at a CDF boundary
    assert (a.rollout_log_probs - b.rollout_log_probs).abs()[same].max() < 1e-4


def test_config_reaches_the_engine_and_compile_turns_packing_off():
    cfg = load_config(overrides=["rollout.packed_weights=false"])
    model = build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0)
    engine = HFRolloutEngine.from_config(model=model, tokenizer=TOK, model_cfg=cfg.model, rollout_cfg=cfg.rollout)
    assert engine.packed_weights is False
    assert load_config().rollout.packed_weights is True
    assert HFRolloutEngine(model, TOK, compile=True).packed_weights is False


def test_a_non_contiguous_bias_gives_the_same_output():
    """oneDNN reads the bias as dense: a strided bias is passed as a contiguous copy."""
    layer = nn.Linear(16, 8)
    layer.bias = nn.Parameter(torch.randn(16)[::2])
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = layer(x)
        with packed_linears(layer, 4) as count:
            got = layer(x)
    assert count == 1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_calls_that_need_a_gradient_or_run_under_autocast_take_f_linear():
    layer = nn.Linear(6, 5)
    x = torch.randn(3, 6, requires_grad=True)
    with packed_linears(layer, 3) as count:
        assert count == 1
        layer(x).sum().backward()  # grad mode on, weights require grad: nn.Linear's own path
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16  # autocast as nn.Linear applies it
    assert x.grad is not None and layer.weight.grad is not None and layer.bias.grad is not None
    torch.testing.assert_close(layer.weight.grad, torch.ones(5, 1) * x.detach().sum(0))


def test_empty_linears_are_not_packed():
    model = nn.Sequential(nn.Linear(0, 4), nn.Linear(4, 4), nn.Linear(4, 0))
    with packed_linears(model, 2) as count:
        assert count == 1 and "forward" in model[1].__dict__
        with torch.no_grad():
            assert model(torch.zeros(2, 0)).shape == (2, 0)
