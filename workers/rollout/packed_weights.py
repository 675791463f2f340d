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
no second copy of the weights outlives the call. Packing costs one pass over the weights
(about 0.2 s for SmolLM2), once per generate call. Results are those of ``F.linear`` up to
float rounding (another summation order): logits within ~1e-4 of the unpacked ones.

Only exact ``nn.Linear`` modules with a plain float32 CPU weight, no hooks and no forward of
their own are packed; anything else (quantized or sharded layers, peft's LoRA layers,
which keep their ``base_layer`` packed but their adapters as they are) runs unchanged.
Generation runs under ``torch.no_grad``; the packed forward has no backward and is not used
outside the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn


def available() -> bool:
    """True when this torch build has oneDNN (mkldnn) CPU kernels and the two ops used here."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))  # fmt: skip


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and type(w) is nn.Parameter
        and type(w.data) is Tensor
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and (module.bias is None or module.bias.dtype == torch.float32)
        and "forward" not in module.__dict__
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def _packed_forward(packed: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@contextmanager
def packed_linears(model: nn.Module, batch_hint: int) -> Iterator[int]:
    """Run ``model``'s packable ``nn.Linear`` modules on oneDNN-packed weights inside the block.

    batch_hint: the expected rows per call (oneDNN picks the layout for it; any row count
    still gives the right result). Yields the number of modules packed (0 when oneDNN is not
    available or nothing qualifies). Each packed module gets an instance ``forward`` for the
    duration of the block; it is removed on exit, also when the block raises. Use under
    ``torch.no_grad`` only.
    """
    patched: list[nn.Module] = []
    try:
        if available():
            hint = max(1, int(batch_hint))
            for module in model.modules():
                if not _packable(module):
                    continue
                with torch.no_grad():
                    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), hint)
                bias = None if module.bias is None else module.bias.detach()
                module.forward = partial(_packed_forward, packed, bias)
                patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


__all__ = ["available", "packed_linears"]
