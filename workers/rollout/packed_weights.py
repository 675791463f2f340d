"""CPU decoding on oneDNN-packed linear weights (``rollout.packed_weights``).

A decode step multiplies a few rows (the live trajectories) by every weight matrix of the model.
On a CPU, ``F.linear`` (MKL sgemm) re-lays-out the weight for each call, which at 16 rows
costs about as much as the product itself: SmolLM2-135M's LM head ([49152, 576]) took 21 ms per
call at 16 rows, 11 ms from a weight reordered once into oneDNN's blocked layout. Here each
``nn.Linear`` of the model runs through ``torch.ops.mkldnn._linear_pointwise`` on a weight
reordered once by ``torch.ops.mkldnn._reorder_linear_weight``, the pair PyTorch's inductor emits
for frozen CPU linears (``torch/_inductor/fx_passes/mkldnn_fusion.py``). Measured with SmolLM2
at 16 rows and a 113-token cache: 134 → 97 ms per decode step (docs/benchmarks.md,
``packed_weights``).

The packed copies are made when the block is entered and dropped when it exits: a weight
update (an optimizer step, ``load_weights``) between two generate calls is always seen, and
no second copy of the weights outlives the call. A load *inside* a call (``rollout.partial:
pause``) is followed by :func:`repack_linears`, which packs the new weights again. Packing costs one pass over the weights
(0.31 s for SmolLM2's 211 linears, median of 5), once per generate call. Results are those
of ``F.linear`` up to float rounding (another summation order): logits within ~1e-4 of the
unpacked ones.

Only exact ``nn.Linear`` modules with a plain, non-empty float32 CPU weight, no hooks and no
forward of their own are packed; anything else (quantized or sharded layers) runs unchanged.
With peft, LoRA's frozen ``base_layer`` and the adapters' own ``lora_A`` / ``lora_B`` linears
are all plain ``nn.Linear`` and are packed alike. The packed forward has no backward: where a
call needs a gradient (grad mode on and an input or weight requiring one), or runs under CPU
autocast, it falls back to ``F.linear`` on the module's own weight, so a packed module always
computes what ``nn.Linear`` would. The bias is passed to oneDNN as a contiguous copy (the op
reads it as dense).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def available() -> bool:
    """True when this torch build has oneDNN (mkldnn) CPU kernels and the two ops used here."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))  # fmt: skip


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """True when this machine's oneDNN can pack (and multiply) linear weights of ``dtype``: tried
    once per process on a small weight. bfloat16 needs avx512bw/vl/dq or avx_ne_convert; on a CPU
    with AVX2 only (e.g. an AMD EPYC before Zen 4) oneDNN refuses it, and a bfloat16 product runs
    unpacked (under autocast) instead."""
    if not available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 4)
        torch.ops.mkldnn._linear_pointwise(torch.ones(4, 16, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def packable(module: nn.Module, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """True for an exact ``nn.Linear`` with a plain, non-empty CPU weight (and bias) of one of
    ``dtypes`` (float32 by default), no hooks and no forward of its own (see the module docstring)."""
    w = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and type(w) is nn.Parameter
        and type(w.data) is Tensor
        and w.numel() > 0
        and w.device.type == "cpu"
        and w.dtype in dtypes
        and (module.bias is None or module.bias.dtype == w.dtype)
        and "forward" not in module.__dict__
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def _packed_forward(module: nn.Linear, packed: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad
                                              or (module.bias is not None and module.bias.requires_grad))
    if needs_grad or torch.is_autocast_enabled("cpu") or x.dtype != torch.float32:
        return F.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _cast_packed_forward(module: nn.Linear, packed: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    """The product on a weight packed in another dtype (bfloat16): x cast to it, the result cast
    back to x's dtype (so the rest of the model runs in its own dtype)."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad
                                              or (module.bias is not None and module.bias.requires_grad))
    if needs_grad or torch.is_autocast_enabled("cpu") or x.dtype != module.weight.dtype:
        return F.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, bias, "none", [], "").to(x.dtype)


@contextmanager
def packed_linears(model: nn.Module, batch_hint: int, dtype: torch.dtype | None = None) -> Iterator[int]:
    """Run ``model``'s packable ``nn.Linear`` modules on oneDNN-packed weights inside the block.

    dtype: the dtype the products run in (None or float32: the weights' own, as before;
    bfloat16: float32 weights packed as bfloat16 copies, inputs cast to it and outputs cast back,
    so the model's other ops and its KV cache stay in its own dtype; issue 41).

    batch_hint: the expected rows per call (oneDNN picks the layout for it; any row count
    still gives the right result). Yields the number of modules packed (0 when oneDNN is not
    available, cannot pack ``dtype`` on this CPU (:func:`packs`), or nothing qualifies). Each packed module gets an instance ``forward`` for the
    duration of the block; it is removed on exit, also when the block raises. Calls that need
    a gradient, or run under CPU autocast, take ``F.linear`` instead (see the module docstring).
    """
    patched: list[nn.Module] = []
    try:
        if available() and packs(dtype or torch.float32):
            hint = max(1, int(batch_hint))
            for module in model.modules():
                if packable(module):
                    _pack(module, hint, dtype)
                    patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def _pack(module: nn.Linear, hint: int, dtype: torch.dtype | None) -> None:
    """Give ``module`` an instance forward on a packed copy of its current weight (and bias)."""
    cast = dtype is not None and dtype != module.weight.dtype
    with torch.no_grad():
        w = module.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous() if cast else w, hint)
    bias = None if module.bias is None else module.bias.detach().to(packed.dtype).contiguous()
    module.forward = partial(_cast_packed_forward if cast else _packed_forward, module, packed, bias)


def repack_linears(model: nn.Module, batch_hint: int, dtype: torch.dtype | None = None) -> int:
    """Inside a :func:`packed_linears` block (same ``batch_hint`` and ``dtype``), pack again every
    module it packed, from the module's weight as it is now: after weights were loaded in place in
    the middle of a generate call (``rollout.partial: pause``), the packed copies would otherwise
    still hold the old weights. Returns the number of modules packed again."""
    hint, count = max(1, int(batch_hint)), 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, partial) and forward.func in (_packed_forward, _cast_packed_forward):
            _pack(module, hint, dtype)
            count += 1
    return count


__all__ = ["available", "packable", "packed_linears", "packs", "repack_linears"]
