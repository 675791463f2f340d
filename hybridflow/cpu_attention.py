"""Attention under bf16 autocast on a CPU: transformers' sdpa kernel, computed in float32.

Under ``model.precision: bf16-mixed`` the trainers' forwards (policy update, old and reference
log-probs, critic) run in ``torch.autocast("cpu", bfloat16)``, which casts
``scaled_dot_product_attention``'s inputs to bfloat16. On a CPU, torch's bfloat16 flash-attention
backward is slower than its float32 one at the lengths RL trains on. Measured (2-core Intel Xeon
with AMX, torch 2.13.0+cpu, 8 rows × 9 heads × 64, causal, forward + backward, best of 5):
11.5 vs 5.0 ms at 96 tokens, 22.7 vs 14.2 ms at 160, 27.0 vs 27.4 ms at 256; a 6-layer
SmolLM2-width decoder's training step at 8 × 96 took 0.31 s with float32 attention against 0.35–0.37
s in bfloat16, the same at 8 × 256 (``docs/benchmarks.md#train``).

:func:`install` registers :func:`sdpa_attention` under transformers' ``"sdpa"`` name
(``AttentionInterface.register``, transformers' extension point), in this process. It computes
attention in float32 — with autocast off inside, so the float32 inputs stay float32 — only when
all of these hold: the tensors are on a CPU, CPU autocast is on in bfloat16, and more than one
query position is computed (a forward over a sequence, not a decode step reading a KV cache). It
returns the attention output in the dtype autocast would have given (bfloat16); everywhere else it
is transformers' own ``sdpa_attention_forward``, unchanged. Attention in float32 is also closer to
the float32 model than bfloat16 attention (FSDP2's and TRL's mixed precision compute it in bf16).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

_installed = False


def sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention (same arguments: query [B, heads, q, D], key / value
    [B, kv_heads, k, D], mask bool or additive), in float32 under CPU bf16 autocast over more than
    one query position; the output [B, q, heads, D] in bfloat16 there, else as transformers gives it."""
    if not _float32_here(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    mask = attention_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.float()
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(torch.get_autocast_dtype("cpu")), weights


def _float32_here(query: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16 and query.shape[2] > 1)


def install() -> None:
    """Register :func:`sdpa_attention` as transformers' ``"sdpa"`` attention in this process (idempotent)."""
    global _installed
    if not _installed:
        AttentionInterface.register("sdpa", sdpa_attention)
        _installed = True


__all__ = ["install", "sdpa_attention"]
