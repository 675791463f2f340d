"""Log-probs of the response tokens under a policy module, and the trainer-vs-rollout log-prob gap
(``rollout/logprob_diff_*``).

Two ways to the log-probs: the full path (the causal LM's [B, R, V] logits, then
:func:`log_probs_from_logits`), and the chunked LM head (the decoder body's [B, R, H] hidden
states, then :func:`log_probs_from_hidden`, which never holds more than a chunk of the logits).
The chunked head is taken only where it computes what the model's own head does — see
:func:`chunked_head_of`; everything else keeps the full path.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import torch
from torch import Tensor, nn

from hybridflow.algorithms import entropy_from_logits, log_probs_from_hidden, log_probs_from_logits
from hybridflow.batch import Batch
from hybridflow.precision import ResolvedPrecision
from workers import distributed as D
from workers import shared_prefix

LmHead = Literal["auto", "chunked", "full"]

# causal LMs whose logits are exactly ``lm_head(norm(last hidden))``: no softcapping, scaling or
# extra head logic in their forward (checked in transformers' modeling_*.py). "auto" chunks only these.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "olmo2", "phi3"})
# config attributes that change logits after the head (Gemma 2/3 softcapping, Cohere, Granite, MiniCPM)
SCALED_HEAD_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "scale_width", "dim_model_base")


def chunked_head_of(model: nn.Module) -> tuple[tuple[nn.Module, nn.Linear] | None, str]:
    """((decoder body, LM head) when the chunked head computes this model's logits, else None, why not).

    Needs a plain transformers causal LM (not DDP/FSDP2, which expect their own forward; not a
    PEFT wrapper, whose forward hooks the body call would skip) of a type in
    ``PLAIN_HEAD_MODEL_TYPES`` whose config sets none of ``SCALED_HEAD_ATTRS`` and whose output
    embeddings are exactly an ``nn.Linear`` (not a LoRA-wrapped head); tied or not, bias or not.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or D.is_fsdp(model):
        return None, "a DDP/FSDP2-wrapped module runs its own forward"
    if hasattr(model, "get_base_model"):
        return None, "a PEFT-wrapped model"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PLAIN_HEAD_MODEL_TYPES:
        return None, f"model_type {model_type!r} is not one of {sorted(PLAIN_HEAD_MODEL_TYPES)}"
    scaled = [a for a in SCALED_HEAD_ATTRS if getattr(config, a, None) not in (None, 1, 1.0)]
    if scaled:
        return None, f"its config scales the logits ({', '.join(scaled)})"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "base_model", None)
    if type(head) is not nn.Linear or not isinstance(body, nn.Module) or body is model:
        return None, f"its LM head is {type(head).__name__}, not a plain nn.Linear after a decoder body"
    return (body, head), ""


def resolve_lm_head(model: nn.Module, lm_head: LmHead) -> tuple[nn.Module, nn.Linear] | None:
    """(body, head) to run the chunked head with, or None for the full path.

    lm_head: "full" → None; "auto" → chunked when :func:`chunked_head_of` allows; "chunked" →
    the same, but raises ValueError naming the reason when it does not.
    """
    if lm_head == "full":
        return None
    parts, why = chunked_head_of(model)
    if parts is None and lm_head == "chunked":
        raise ValueError(f"actor.lm_head=chunked: cannot chunk this model's LM head ({why}); use auto or full")
    return parts


def sequence_log_probs(
    model: nn.Module, batch: Batch, *, temperature: float, with_entropy: bool = False, entropy_grad: bool = False,
    lm_head: LmHead = "full", pack_rows: str = "off", precision: ResolvedPrecision | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens under ``model`` on logits / temperature.

    batch: prompt_ids/prompt_mask [B, P] (left padded), response_ids/response_mask [B, R];
    position_ids [B, P+R] when present, else from the attention mask. Tensors are moved to
    the model's device. Returns ([B, R] float32 nats, [B, R] float32 entropy or None), on the
    model's device; positions outside response_mask hold numbers the caller masks out (0 on the
    chunked head, which scores the response tokens only).
    entropy_grad: keep the entropy in the autograd graph (for an entropy bonus).
    lm_head: "full" = the model's [B, R, V] logits; "auto"/"chunked" = the chunked LM head
    (:func:`resolve_lm_head`), the same numbers up to float rounding without those logits.
    pack_rows: "off" / "auto" / "on", rows packed without padding (:mod:`workers.packed_rows`,
    see :func:`workers.shared_prefix.response_logits`); the same numbers up to float rounding.
    precision: the run's (:func:`hybridflow.precision.resolved_precision`); under bf16-mixed the
    model's forward runs in ``autocast(bfloat16)`` while the chunked LM head stays outside it: its
    matmuls in ``precision.head_matmul_dtype`` (bfloat16 under bf16-mixed / bf16-true), its
    log-softmax in float32 (None: no autocast, a float32 head).
    """
    autocast = precision.autocast(_device_type(model)) if precision is not None else nullcontext()
    parts = resolve_lm_head(model, lm_head)
    if parts is not None:
        body, head = parts
        with autocast:
            hidden = shared_prefix.response_hidden_states(model, body, batch, pack_rows=pack_rows)  # [B, R, H]
        labels = batch["response_ids"].to(hidden.device)
        # the head runs on the response tokens only: padding (up to half the positions when response
        # lengths vary) and multi-turn observation tokens are not scored, and hold 0 here
        sel = batch["response_mask"].to(hidden.device).reshape(-1).nonzero().squeeze(1)
        mm = getattr(torch, precision.head_matmul_dtype) if precision is not None else torch.float32
        lp_sel, ent_sel = log_probs_from_hidden(hidden.reshape(-1, hidden.shape[-1]).index_select(0, sel), head.weight,
                                                labels.reshape(-1).index_select(0, sel), temperature=temperature,
                                                bias=head.bias, with_entropy=with_entropy, matmul_dtype=mm)
        lp = lp_sel.new_zeros(labels.numel()).index_copy(0, sel, lp_sel).view(labels.shape)
        ent = None
        if ent_sel is not None:
            ent = ent_sel.new_zeros(labels.numel()).index_copy(0, sel, ent_sel if entropy_grad else ent_sel.detach())
            ent = ent.view(labels.shape)
        return lp, ent
    with autocast:
        response_logits = shared_prefix.response_logits(model, batch, pack_rows=pack_rows)
    device = response_logits.device
    log_probs = log_probs_from_logits(response_logits, batch["response_ids"].to(device), temperature=temperature)
    entropy = None
    if with_entropy:
        src = response_logits if entropy_grad else response_logits.detach()
        entropy = entropy_from_logits(src, temperature=temperature)
    return log_probs, entropy


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the (possibly DDP/FSDP/PEFT-wrapped) causal LM's forward takes ``logits_to_keep``."""
    return bool(shared_prefix.forward_kwargs(model)[1])


class LogprobGap:
    """Trainer vs rollout numbers over response tokens: |trainer − rollout| log-probs
    (``rollout/logprob_diff_max`` / ``_mean``) and verl's probability gap |p_rollout − p_trainer|
    (``training/rollout_probs_diff_mean`` / ``_max`` / ``_std``, as verl's
    ``compute_rollout_correction_and_add_to_batch`` reports it). :meth:`add` per chunk on this
    rank, :meth:`metrics` reduces over ranks (collective)."""

    def __init__(self) -> None:
        self.total, self.tokens, self.max = 0.0, 0.0, 0.0
        self.p_total, self.p_squares, self.p_max = 0.0, 0.0, 0.0

    def add(self, log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> None:
        """log_probs / rollout_log_probs [B, R] nats, mask [B, R] bool (True = response token)."""
        mask = mask.to(log_probs.device)
        trainer, rollout = log_probs.detach().float(), rollout_log_probs.to(log_probs.device).float()
        diff = (trainer - rollout).abs().masked_fill(~mask, 0.0)
        p_diff = (trainer.exp() - rollout.exp()).abs().masked_fill(~mask, 0.0)
        self.total += float(diff.sum())
        self.tokens += float(mask.sum())
        self.max = max(self.max, float(diff.max()) if diff.numel() else 0.0)
        self.p_total += float(p_diff.sum())
        self.p_squares += float(p_diff.double().square().sum())
        self.p_max = max(self.p_max, float(p_diff.max()) if p_diff.numel() else 0.0)

    def metrics(self) -> dict[str, float]:
        sums = [self.total, self.tokens, self.p_total, self.p_squares]
        tot = D.all_reduce_sum(torch.tensor(sums, dtype=torch.float64)).tolist()
        mx = D.all_reduce_max(torch.tensor([self.max, self.p_max], dtype=torch.float64)).tolist()
        n = max(tot[1], 1.0)
        p_mean = tot[2] / n
        p_var = max(tot[3] / n - p_mean * p_mean, 0.0)
        return {"rollout/logprob_diff_max": mx[0], "rollout/logprob_diff_mean": tot[0] / n,
                "training/rollout_probs_diff_mean": p_mean, "training/rollout_probs_diff_max": mx[1],
                "training/rollout_probs_diff_std": p_var**0.5}


__all__ = ["LmHead", "LogprobGap", "accepts_logits_to_keep", "chunked_head_of", "resolve_lm_head", "sequence_log_probs"]
