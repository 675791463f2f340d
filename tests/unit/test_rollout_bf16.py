"""The hf engine generating in bfloat16 against a float32 model (issue 41, rollout.dtype): the fused
decoder's bfloat16 weights and KV cache, bfloat16-packed linears for other models, autocast where
neither applies; log-probs stay float32. Tolerances are the ones measured on the tiny models here
(logits of magnitude ~0.5; bfloat16 has 8 mantissa bits)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridflow.algorithms.sequences import position_ids_from_mask
from workers.rollout.base import SamplingParams
from workers.rollout.decode import decode
from workers.rollout.fused_decode import fused_decoder, why_not_fused
from workers.rollout.hf import HFRolloutEngine
from workers.rollout.packed_weights import available, packed_linears, packs

sys.path.insert(0, str(Path(__file__).parent))
from test_rollout_fused_decode import STOPS, TEXTS, TOK, llama, llama_bias, mistral, prompts, qwen2  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def _teacher_forced(build):
    """Logits after the prompt at 6 forced tokens: float32 forward, bfloat16 model forward, fused
    bfloat16 decoder on the float32 model and on the bfloat16 model (plus the decoder)."""
    m, mb = build(), build().to(torch.bfloat16)
    ids, mask = prompts(TEXTS)
    follow = torch.randint(5, 100, (len(TEXTS), 6), generator=torch.Generator().manual_seed(0))
    full_ids = torch.cat([ids, follow], 1)
    full_mask = torch.cat([mask, torch.ones_like(follow, dtype=torch.bool)], 1)
    pos, cols = position_ids_from_mask(full_mask), ids.shape[1]
    out = {}
    with torch.no_grad():
        for name, mod in (("fp32", m), ("bf16_forward", mb)):
            logits = mod(input_ids=full_ids, attention_mask=full_mask.long(), position_ids=pos).logits
            out[name] = logits[:, cols - 1 : cols + 5].float()
        for name, mod, dtype in (("fused_from_fp32", m, torch.bfloat16), ("fused_bf16_model", mb, None)):
            dec = fused_decoder(mod, 4, dtype)
            dec.prefill(ids, mask, None, 6)
            out[name] = torch.stack([dec.step(full_ids[:, c], pos[:, c]) for c in range(cols - 1, cols + 5)], 1)
            out[name + "_decoder"] = dec
    return out


# the fused decoder packs its weights with oneDNN, which packs bfloat16 only on CPUs with
# avx512bw/vl/dq or avx_ne_convert; elsewhere the engine falls back (tested below on every CPU)
BF16_PACKS = packs(torch.bfloat16)
needs_bf16_packing = pytest.mark.skipif(not BF16_PACKS, reason="this CPU's oneDNN cannot pack bfloat16 weights "
                                        "(needs avx512bw/vl/dq or avx_ne_convert); the engine's fallback is tested")


@needs_bf16_packing
@pytest.mark.parametrize("build", [llama, llama_bias, qwen2, mistral])
def test_fused_bf16_logits_are_as_close_to_float32_as_a_bf16_forward(build):
    out = _teacher_forced(build)
    dec = out["fused_from_fp32_decoder"]
    assert dec.dtype == torch.bfloat16 and dec.keys[0].dtype == dec.values[0].dtype == torch.bfloat16
    assert out["fused_from_fp32"].dtype == torch.float32  # log-softmax in float32
    assert out["fused_bf16_model_decoder"].dtype == torch.bfloat16  # bf16 weights decode fused too
    bf16_err = (out["bf16_forward"] - out["fp32"]).abs().max()  # 2.1e-3 .. 3.3e-3 measured
    for name in ("fused_from_fp32", "fused_bf16_model"):
        assert (out[name] - out["fp32"]).abs().max() <= 2 * bf16_err  # measured 0.8x .. 1.4x
        assert (out[name] - out["bf16_forward"]).abs().max() <= 3 * bf16_err  # measured <= 1.9x
    # same bf16 weights; only the rotary frequencies differ (model.to(bfloat16) rounds inv_freq too)
    assert (out["fused_from_fp32"] - out["fused_bf16_model"]).abs().max() <= 2 * bf16_err


@needs_bf16_packing
@pytest.mark.parametrize("build, agree", [(llama, 1.0), (qwen2, 1.0), (mistral, 0.75)])
def test_fused_bf16_greedy_tokens_match_a_bf16_forward(build, agree):
    """Greedy decode with stops and repeated prompts: rows equal to a bfloat16 model forward's
    (all rows on llama and qwen2; 9 of 12 on the tiny mistral, whose logits sit within bfloat16
    rounding of a tie: there the float32 forward disagrees with the bfloat16 forward alike)."""
    m, mb = build(), build().to(torch.bfloat16)
    ids, mask = prompts(TEXTS)
    rows = torch.arange(len(TEXTS)).repeat_interleave(3)
    s = SamplingParams(max_new_tokens=20, stop_token_ids=STOPS, n=3, temperature=0.0)
    with torch.no_grad():
        ref = decode(mb, ids[rows], mask[rows], s, None, 2)
        dec = fused_decoder(m, len(rows), torch.bfloat16)
        dec.prefill(ids, mask, rows, 20)
        got = decode(m, ids[rows], mask[rows], s, None, 2, steps=dec)
    same = (got.response_ids == ref.response_ids).all(-1)
    assert same.float().mean() >= agree
    assert got.log_probs.dtype == torch.float32
    assert (got.log_probs - ref.log_probs)[same].abs().max() < 1e-2  # measured 2.1e-3 .. 4.0e-3


def test_float32_decoder_is_unchanged_by_the_dtype_argument():
    m = llama()
    ids, mask = prompts(TEXTS)
    with torch.no_grad():
        a, b = fused_decoder(m, 4), fused_decoder(m, 4, torch.float32)
        a.prefill(ids, mask, None, 2)
        b.prefill(ids, mask, None, 2)
        pos = position_ids_from_mask(mask)[:, -1]
        assert torch.equal(a.step(ids[:, -1], pos), b.step(ids[:, -1], pos))
    assert a.keys[0].dtype == torch.float32
    with pytest.raises(ValueError, match="float16"):
        fused_decoder(m, 4, torch.float16)


def test_engine_generates_fused_in_bf16_on_a_float32_model_and_reports_the_gap():
    """Fused in bfloat16 where oneDNN packs it; elsewhere under autocast, saying why (a CPU with
    AVX2 only: before the fallback, oneDNN's refusal crashed the rollout)."""
    model = llama(seed=2)
    bf16, fp32 = HFRolloutEngine(model, TOK, dtype="bfloat16"), HFRolloutEngine(model, TOK)
    ids, mask = prompts(["hello", "abc d", "hello"])
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=STOPS, n=2)
    a, b = bf16.generate(ids, mask, greedy), fp32.generate(ids, mask, greedy)
    if BF16_PACKS:
        assert bf16.fused_decode_reason is None and bf16._fused is None
    else:
        assert "cannot pack bfloat16" in bf16.fused_decode_reason and bf16.packed_linears == 0
    assert fp32.fused_decode_reason is None  # float32 still decodes fused
    assert a.rollout_log_probs.dtype == torch.float32
    same = (a.response_ids == b.response_ids).all(-1)
    assert same.all()
    gap = (a.rollout_log_probs - b.rollout_log_probs)[a.response_mask].abs()
    assert 0 < float(gap.max()) < 1e-2  # bf16 vs float32 engine: measured max 2.1e-3, mean 5.4e-4 (50 tokens)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the module is untouched


@pytest.mark.skipif(not available(), reason="no oneDNN linear kernels")
def test_packed_linears_in_bf16_compute_in_bf16_and_return_the_inputs_dtype():
    lin = nn.Linear(32, 16)
    x = torch.randn(5, 32)
    with torch.no_grad(), packed_linears(lin, 5, torch.bfloat16) as n:
        y = lin(x)
    assert "forward" not in lin.__dict__
    if not BF16_PACKS:  # nothing packed; the module runs as it is
        assert n == 0 and torch.equal(y, lin(x))
        return
    assert n == 1 and y.dtype == torch.float32
    want = nn.functional.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()).float()
    assert (y - want).abs().max() < 2e-2 and (y - lin(x)).abs().max() > 0  # bf16 numbers, not float32's
    with torch.no_grad(), packed_linears(lin, 5) as n:  # float32 as before: packed on the float32 weight
        assert torch.allclose(lin(x), nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)


def test_models_without_the_fused_path_generate_in_bf16_too():
    """GPT-2 (no fused path): bfloat16-packed linears; with packed_weights off: under autocast."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(TOK), n_embd=32, n_layer=1, n_head=4)).eval()
    assert "gpt2" in why_not_fused(gpt2)
    ids, mask = prompts(["hello", "abc d"])
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, n=1)
    ref = HFRolloutEngine(gpt2, TOK).generate(ids, mask, greedy)
    for kwargs in ({}, {"packed_weights": False}):
        engine = HFRolloutEngine(gpt2, TOK, dtype=torch.bfloat16, **kwargs)
        out = engine.generate(ids, mask, greedy)
        assert out.rollout_log_probs.dtype == torch.float32
        assert (engine.packed_linears > 0) == (not kwargs and BF16_PACKS)  # packed in bf16, else autocast
        gap = (out.rollout_log_probs - ref.rollout_log_probs).abs().max()
        assert 0 < float(gap) < 5e-2, gap


def test_the_engine_takes_the_resolved_rollout_dtype_from_the_config():
    from hybridflow.config import ExperimentConfig
    from workers.rollout.base import build_engine

    model = llama()
    for precision, want in (("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)):
        cfg = ExperimentConfig(model={"precision": precision}, trainer={"device": "cpu"}, rollout={"dtype": "auto"})
        engine = build_engine(cfg, model=model, tokenizer=TOK, device=torch.device("cpu"))
        assert engine.dtype == want and engine._cast_dtype() == (want if want != torch.float32 else None)


def test_the_compiled_steps_static_cache_takes_the_autocast_dtype():
    """rollout.compile with rollout.dtype bfloat16 decodes under autocast: its K/V are bfloat16, so
    is the static cache (float32 otherwise, as before). (Not compiled here: cache allocation only.)"""
    from workers.rollout.compiled import CompiledDecodeStep

    step = CompiledDecodeStep(llama())
    assert step.cache(2, 64, None).layers[0].keys.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert step.cache(2, 64, None).layers[0].keys.dtype == torch.bfloat16
