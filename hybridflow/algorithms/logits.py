"""Log-probabilities and entropies from logits without a [.., vocab] float32 copy, and from the
final hidden states without the [rows, vocab] logits at all (:func:`log_probs_from_hidden`).

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


def _head_rows(vocab: int, chunk_rows: int | None) -> int:
    return chunk_rows if chunk_rows is not None else max(1, BLOCK_ELEMENTS // max(vocab, 1))


class _HiddenLogProbs(torch.autograd.Function):
    """The LM head + log-softmax (+ entropy) over row chunks; see :func:`log_probs_from_hidden`."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                with_entropy: bool, chunk_rows: int, matmul_dtype: torch.dtype) -> tuple[Tensor, Tensor]:  # fmt: skip
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        w = weight.to(matmul_dtype)  # a no-op when the weight is in it already; one [V, H] copy otherwise
        b = None if bias is None else bias.to(matmul_dtype)
        for s in range(0, n, chunk_rows):  # at most two [rows, V] float32 buffers live at once
            log_p = _chunk_logits(hidden[s : s + chunk_rows], w, b, temperature)  # z = logits / T
            lse_c = torch.logsumexp(log_p, -1)
            log_p.sub_(lse_c[:, None])  # in place: z − lse = log p
            lse[s : s + chunk_rows] = lse_c
            out[s : s + chunk_rows] = log_p.gather(-1, labels[s : s + chunk_rows, None])[:, 0]
            if with_entropy:  # H = −Σ p log p; 0·(−inf) at banned tokens counts 0
                ent[s : s + chunk_rows] = -torch.exp(log_p).mul_(log_p).nan_to_num_(nan=0.0).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.temperature, ctx.chunk_rows, ctx.matmul_dtype = temperature, chunk_rows, matmul_dtype
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no work for it
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor | None, grad_ent: Tensor | None):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        t, rows, mm = ctx.temperature, ctx.chunk_rows, ctx.matmul_dtype
        w = weight.to(mm)
        b = None if bias is None else bias.to(mm)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        grad_b = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if want_b and b is not None else None
        if grad_ent is not None and not ent.numel():
            grad_ent = None
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]
            log_p = _chunk_logits(h, w, b, t).sub_(lse[s : s + rows, None])  # two [rows, V] buffers
            g = torch.exp(log_p)  # p, turned into d loss / d z in place (z = logits / T)
            term = None
            if grad_ent is not None:  # dH/dz_j = −p_j (log p_j + H), in log_p's buffer
                term = log_p.add_(ent[s : s + rows, None]).mul_(g).nan_to_num_(nan=0.0)
                term.mul_(grad_ent[s : s + rows, None])
            if grad_out is not None:  # d log p_y / d z_j = 1[j = y] − p_j
                go = grad_out[s : s + rows, None]
                g.mul_(-go).scatter_add_(-1, labels[s : s + rows, None], go)
            else:
                g.zero_()
            if term is not None:
                g.sub_(term)
            g.div_(t)  # d loss / d logits
            g_mm = g.to(mm)  # float32: g itself; bfloat16: the matmuls' inputs, their sums float32 (grad_w)
            if grad_h is not None:
                grad_h[s : s + rows] = g_mm @ w
            if grad_w is not None:
                if mm == torch.float32:
                    grad_w.addmm_(g.T, h.float())
                else:  # no bf16 x bf16 -> float32 matmul on CPU: each chunk's bf16 product added in float32
                    grad_w.add_(g_mm.T @ h.to(mm))
            if grad_b is not None:
                grad_b.add_(g.sum(0))
        cast = lambda x, like: None if x is None else x.to(like.dtype)  # noqa: E731
        return (cast(grad_h, hidden), cast(grad_w, weight), cast(grad_b, bias) if bias is not None else None,
                None, None, None, None, None)


def _chunk_logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    """[rows, V] float32 logits / T of the hidden rows ``h`` [rows, H] under the head ``w`` [V, H] (+ b [V]);
    the matmul runs in ``w``'s dtype (bfloat16 logits are rounded once, then made float32)."""
    x = h.to(w.dtype)
    z = x @ w.T if b is None else torch.addmm(b, x, w.T)
    return z.float().div_(temperature)


def log_probs_from_hidden(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, temperature: float = 1.0, bias: Tensor | None = None,
    with_entropy: bool = False, chunk_rows: int | None = None, matmul_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None]:
    """log softmax((hidden·Wᵀ + b) / T)[label] (and the entropy) per row, without the [rows, vocab] logits.

    The LM head's matmul runs in chunks of ``chunk_rows`` rows (default: about
    ``BLOCK_ELEMENTS`` logits per chunk), in ``matmul_dtype``; forward keeps only ``hidden`` and one
    float per row (the log-sum-exp, and the entropy when asked), and backward recomputes each
    chunk's logits to accumulate d hidden = g·W and d W += gᵀ·hidden (d b += Σ g). So the
    largest temporaries are [chunk_rows, vocab] float32, in forward and backward alike.
    The log-softmax, the entropy and d loss / d logits are float32 whatever ``matmul_dtype``:
    with ``torch.bfloat16`` (bf16-mixed, bf16-true) the three matmuls take bfloat16 inputs, the
    logits are rounded to bfloat16 once and then made float32 (what a bf16 LM head under
    autocast followed by a float32 log-softmax computes, as TRL's ``bf16=True`` and verl's FSDP
    mixed precision do), d W is summed over the chunks in float32 and d hidden is float32.
    On a CPU with AMX the bf16 matmuls run ~3.8x faster (869 vs 226 GFLOP/s at 1024 x 576 x
    49152, a 2-core Xeon; docs/benchmarks.md#train).
    The idea of Liger Kernel's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989)
    and verl's ``use_fused_kernels``, here in plain torch.

    hidden: [N, H] any float dtype (the final hidden states, after the model's last norm);
    weight: [V, H] the LM head (a tied embedding matrix is fine: its gradient adds to the
    embedding's); bias: [V] or None; labels: [N] int64 token ids. Returns ([N] float32 nats,
    [N] float32 entropy in nats, or None without ``with_entropy``); both differentiable w.r.t.
    hidden, weight and bias (the entropy only costs backward work when its gradient is used).
    matmul_dtype: ``torch.float32`` (default) or ``torch.bfloat16``.
    Double backward is not supported. Raises ValueError for T ≤ 0, mismatched shapes or another
    matmul_dtype.
    """
    _check_temperature(temperature)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise ValueError(f"need hidden [N, H], weight [V, H], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be [V] = [{weight.shape[0]}]")
    rows = _head_rows(weight.shape[0], chunk_rows)
    if matmul_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"matmul_dtype must be torch.float32 or torch.bfloat16, got {matmul_dtype}")
    lp, ent = _HiddenLogProbs.apply(hidden, weight, bias, labels.long(), float(temperature), with_entropy, rows,
                                    matmul_dtype)
    return lp, (ent if with_entropy else None)


__all__ = ["log_probs_from_logits", "entropy_from_logits", "log_probs_from_hidden", "BLOCK_ELEMENTS"]
