"""Attention under bf16 autocast on a CPU (hybridflow/cpu_attention.py): float32 sdpa over a
sequence, transformers' own kernel everywhere else."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybridflow.cpu_attention import install, sdpa_attention
from hybridflow.precision import resolve_precision


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def _qkv(q_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, q_len, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, generator=g, requires_grad=True)
    return q, k, v


def test_under_cpu_bf16_autocast_a_sequence_is_attended_in_float32():
    q, k, v = _qkv(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = sdpa_attention(_Module(), q, k, v, None)
        bf16, _ = sdpa_attention_forward(_Module(), q, k, v, None)  # what autocast alone computes
    want, _ = sdpa_attention_forward(_Module(), q, k, v, None)  # float32 throughout
    assert out.dtype == bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out, want.to(torch.bfloat16), rtol=0, atol=0)
    assert (out.float() - want).abs().max() < (bf16.float() - want).abs().max()  # closer than bf16 attention
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_elsewhere_it_is_transformers_kernel_unchanged():
    q, k, v = _qkv(6)
    got, _ = sdpa_attention(_Module(), q, k, v, None)  # no autocast
    want, _ = sdpa_attention_forward(_Module(), q, k, v, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    q1, k1, v1 = _qkv(1)  # a decode step (one query position) under autocast stays bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = sdpa_attention(_Module(), q1, k1, v1, None)
        want, _ = sdpa_attention_forward(_Module(), q1, k1, v1, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_additive_mask_is_made_float32():
    q, k, v = _qkv(6)
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.bfloat16)
    mask[..., 0] = float("-inf")  # nobody attends to column 0 (every row keeps others)
    mask[..., 0, 0] = 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = sdpa_attention(_Module(), q, k, v, mask)
    want, _ = sdpa_attention_forward(_Module(), q, k, v, mask.float())
    torch.testing.assert_close(out, want.to(torch.bfloat16), rtol=0, atol=0)


def test_the_bf16_mixed_autocast_installs_it_for_the_models_sdpa():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=50, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 50, (2, 7))
    with resolve_precision("bf16-mixed", device_type="cpu").autocast("cpu"):
        logits = model(input_ids=ids).logits
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention
    install()  # idempotent
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention
    logits.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
