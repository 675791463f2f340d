"""Log-probabilities and entropies from logits without a [.., vocab] float32 copy.

A plain ``log_softmax(logits / T).gather(...)`` materialises (and autograd keeps) a full
float32 [batch, seq, vocab] tensor — for a 150k vocabulary that is the largest tensor of a
training step. Here both forward and backward walk the rows in blocks of about
``BLOCK_ELEMENTS`` values, keep only one float per row (the log-sum-exp) for backward, and
write the gradient straight into a tensor shaped like the logits (which backward has to
produce anyway). Double backward is not supported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

BLOCK_ELEMENTS = 1 << 24  # 16M values = 64 MB of float32 temporaries per block


def _for_row_blocks(logits: Tensor, others: list[Tensor], fn: Callable[[Tensor, list[Tensor]], None]) -> None:
    """Call ``fn(block [rows, V], [other blocks])`` over row blocks of ``logits [..., V]``.

    ``others`` share the leading shape of ``logits``; the ones written to must be contiguous
    (then their blocks are views). A non-viewable ``logits`` (e.g. a sliced [B, S, V]) is
    walked along its first dim instead of being copied.
    """
    vocab = logits.shape[-1]
    try:
        flat = logits.view(-1, vocab)
    except RuntimeError:
        for i in range(logits.shape[0]):
            _for_row_blocks(logits[i], [o[i] for o in others], fn)
        return
    n = flat.shape[0]
    lead = logits.dim() - 1
    flats = [o.reshape(n, *o.shape[lead:]) for o in others]
    rows = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    for s in range(0, n, rows):
        fn(flat[s : s + rows], [f[s : s + rows] for f in flats])


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)

        def block(x: Tensor, o: list[Tensor]) -> None:
            lab, out_b, lse_b = o
            z = x.float() / temperature
            lse_b.copy_(torch.logsumexp(z, -1))
            out_b.copy_(z.gather(-1, lab.unsqueeze(-1)).squeeze(-1) - lse_b)

        _for_row_blocks(logits, [labels, out, lse], block)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_out = grad_out.contiguous()

        def block(x: Tensor, o: list[Tensor]) -> None:
            lab, lse_b, g_out, g_b = o
            p = torch.exp(x.float() / t - lse_b.unsqueeze(-1))
            g = p.mul_(-g_out.unsqueeze(-1))
            g.scatter_add_(-1, lab.unsqueeze(-1), g_out.unsqueeze(-1))
            g_b.copy_(g.div_(t))

        _for_row_blocks(logits, [labels, lse, grad_out, grad], block)
        return grad, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float) -> Tensor:
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)

        def block(x: Tensor, o: list[Tensor]) -> None:
            out_b, lse_b = o
            z = x.float() / temperature
            lse_b.copy_(torch.logsumexp(z, -1))
            p = torch.exp(z - lse_b.unsqueeze(-1))
            out_b.copy_(lse_b - (p * z).nan_to_num_(nan=0.0).sum(-1))  # 0·(−inf) at banned tokens

        _for_row_blocks(logits, [out, lse], block)
        ctx.save_for_backward(logits, lse, out)
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse, entropy = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_out = grad_out.contiguous()

        def block(x: Tensor, o: list[Tensor]) -> None:
            lse_b, h_b, g_out, g_b = o
            log_p = x.float() / t - lse_b.unsqueeze(-1)
            # dH/dz_j = −p_j (log p_j + H); z = x / T
            g = (torch.exp(log_p) * (log_p + h_b.unsqueeze(-1))).nan_to_num_(nan=0.0)
            g_b.copy_(g.mul_(-g_out.unsqueeze(-1) / t))

        _for_row_blocks(logits, [lse, entropy, grad_out, grad], block)
        return grad, None


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def log_probs_from_logits(logits: Tensor, labels: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T)[label] per position, memory-frugal, differentiable.

    logits: [..., vocab] any float dtype (e.g. [batch, seq, vocab]; may be a non-contiguous
    slice); labels: [...] int64 token ids. Returns [...] float32 nats.
    Example: logits [2, 1, 0], T = 0.5 → log-probs −0.142932, −2.142932, −4.142932.
    Raises ValueError for T ≤ 0 or mismatched shapes.
    """
    _check_temperature(temperature)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without vocab")
    return _LogProbs.apply(logits, labels.long(), float(temperature))


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy H = −Σ p log p of softmax(logits / T) per position, memory-frugal, differentiable.

    logits: [..., vocab] any float dtype. Returns [...] float32 nats (0 ≤ H ≤ log vocab).
    Aggregate over the response with :func:`aggregate_loss` / :func:`masked_mean`.
    """
    _check_temperature(temperature)
    return _Entropy.apply(logits, float(temperature))


__all__ = ["log_probs_from_logits", "entropy_from_logits", "BLOCK_ELEMENTS"]
