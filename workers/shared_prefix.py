"""Response logits with each distinct prompt computed once (GRPO-style groups share a prompt).

With n samples per prompt a plain forward pass over ``[prompt ‖ response]`` runs every prompt n
times. Here the prompts are deduplicated: the distinct prompts minus their last token go through
the model once, their KV cache is gathered per trajectory, and the trajectories' suffixes (last
prompt token + response tokens but the last) run on that cache. Under autograd the cache is part
of the graph, so backward sums each prompt's gradient over its samples — the same gradient as
the n separate passes (the same sum of the same terms, up to float rounding), on
``U·(P−1) + B·R`` tokens instead of ``B·(P+R)``. This is the shared-prefix idea of "Prefix
Grouper: Efficient GRPO Training through Shared-Prefix Forward" (Liu et al., 2025), done with
the model's own KV cache.

Used for plain modules only: DDP and FSDP2 expect one forward per backward, so wrapped training
modules take the full forward (as do models without a batch-selectable cache, and training
under gradient checkpointing, where transformers switches the cache off).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

from hybridflow.algorithms.sequences import position_ids_from_mask
from hybridflow.batch import Batch
from workers.distributed import unwrapped  # re-exported: rollout engines import it from here


def forward_kwargs(model: nn.Module) -> tuple[str | None, dict[str, int]]:
    """(the name under which the causal LM takes and returns its KV cache — ``cache`` from
    transformers 5.2x, where ``past_key_values`` is deprecated, else ``past_key_values``, None
    when its forward takes neither —,
    ``{"logits_to_keep": 1}`` when its forward can skip the LM head on all but the last position)."""
    return _forward_kwargs_of(type(unwrapped(model)))


@functools.cache
def _forward_kwargs_of(model_cls: type) -> tuple[str | None, dict[str, int]]:
    try:
        params = inspect.signature(model_cls.forward).parameters
    except (TypeError, ValueError):
        params = {}
    cache = next((n for n in ("cache", "past_key_values") if n in params), None)
    return cache, ({"logits_to_keep": 1} if "logits_to_keep" in params else {})


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor,
                  prompt_position_ids: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """(first row of each distinct prompt [U], distinct prompt of each row [B]) when some prompt
    repeats and every prompt ends in a real token (left padding), else None. Prompts are equal
    when their real tokens, their padding and (if given, [B, P]) their position ids are."""
    if prompt_ids.shape[1] < 2 or not bool(prompt_mask[:, -1].all()):
        return None
    keys = prompt_ids.masked_fill(~prompt_mask.bool(), -1)
    if prompt_position_ids is not None:  # from the mask by contract; a caller's own positions count too
        keys = torch.cat([keys, prompt_position_ids.to(keys.device)], 1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    if int(inverse.max()) + 1 == len(inverse):
        return None
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), dtype=torch.long, device=inverse.device)
    first.scatter_reduce_(0, inverse, rows, reduce="amin")
    return first, inverse


def shares_prompts(model: nn.Module) -> bool:
    """Whether :func:`response_logits` may split the forward for ``model``: a plain module (not
    DDP/FSDP2), and not training under gradient checkpointing (transformers turns the cache off
    there, so the split would only add a pass)."""
    from torch.nn.parallel import DistributedDataParallel

    from workers import distributed as D

    if isinstance(model, DistributedDataParallel) or D.is_fsdp(model):
        return False
    return not (model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()))


def shared_prompt_cache(model: nn.Module, prefix_ids: Tensor, prefix_mask: Tensor, prefix_pos: Tensor,
                        inverse: Tensor) -> dict[str, object]:
    """Run the U distinct prompt prefixes once and give each of the B rows a copy of its KV cache.

    prefix_ids/prefix_mask/prefix_pos: [U, L] (the prompts minus their last token, left padded,
    positions from the mask); inverse: [B] int64, the prefix of each row. Returns the forward
    kwargs that continue from the gathered cache (``{"cache": <[B, L] cache>}``, or
    ``past_key_values`` on older transformers), or {} when the model takes no cache argument or
    its cache cannot be gathered by row (then the caller runs the full forward). Differentiable:
    under autograd the gathered cache keeps its graph back to the prefix forward.
    """
    name, keep_last = forward_kwargs(model)
    if name is None:
        return {}
    out = model(input_ids=prefix_ids, attention_mask=prefix_mask.long(), position_ids=prefix_pos,
                use_cache=True, **keep_last)
    cache = getattr(out, name, None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return {}
    gather_rows(cache, inverse)
    return {name: cache}


def gather_rows(cache: object, rows: Tensor) -> None:
    """Give the cache one batch row per entry of ``rows`` ([B] int64; repeats allowed), in place.

    transformers' ``batch_select_indices`` gathers with advanced indexing (``keys[rows, ...]``),
    whose backward is ``index_put_(accumulate=True)``: on CPU with more than one thread it adds the
    repeated rows' gradients with atomic adds in whatever order the threads run, so two identical
    updates differed in the last bits (issue 15: the demo diverged after its first update).
    ``index_select``'s backward (``index_add_``) adds them in index order, the same every time.
    Layers of other kinds (extra per-row state) keep their own ``batch_select_indices``.
    """
    from transformers.cache_utils import DynamicLayer

    for layer in getattr(cache, "layers", None) or [cache]:
        if type(layer).batch_select_indices is not DynamicLayer.batch_select_indices:
            layer.batch_select_indices(rows)
            continue
        if layer.get_seq_length() > 0:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))


def attention_mask(batch: Batch) -> Tensor:
    """[B, P+R] bool: prompt_mask ‖ response_mask, plus ``observation_mask`` where a multi-turn
    rollout set one (the model attends to its observation tokens; the loss does not count them)."""
    response = batch["response_mask"]
    if "observation_mask" in batch:
        response = response | batch["observation_mask"]
    return torch.cat([batch["prompt_mask"], response], 1)


def response_logits(model: nn.Module, batch: Batch, *, pack_rows: str = "off") -> Tensor:
    """[B, R, V] logits whose position t predicts ``response_ids[:, t]``, on the model's device.

    batch: prompt_ids/prompt_mask [B, P] (left padded), response_ids/response_mask [B, R],
    position_ids [B, P+R] when present (else from the attention mask). Shares each distinct
    prompt's forward pass across its rows when :func:`shares_prompts` allows and a prompt
    repeats; otherwise one forward over ``[prompt ‖ response]`` with the LM head on the response
    positions only when the model takes ``logits_to_keep``. pack_rows: "off" = those two layouts;
    "auto" = rows packed without padding (:mod:`workers.packed_rows`) when that computes fewer
    token positions than the layout that would run; "on" = packed whenever the model and the
    rows' positions allow (ValueError, naming why, for a model that cannot take packed rows).
    """
    return _response_positions(model, model, batch, "logits", pack_rows)


def response_hidden_states(model: nn.Module, body: nn.Module, batch: Batch, *, pack_rows: str = "off") -> Tensor:
    """[B, R, H] final hidden states (after the last norm) whose position t predicts
    ``response_ids[:, t]``: the LM head applied to them gives :func:`response_logits`.

    model: the causal LM (decides prompt sharing); body: its decoder without the head
    (``model.base_model``, e.g. ``LlamaModel``), which is what runs — the head never does.
    Same batch fields, prompt sharing, packing and devices as :func:`response_logits`.
    """
    return _response_positions(model, body, batch, "last_hidden_state", pack_rows)


def _response_positions(model: nn.Module, run: nn.Module, batch: Batch, output: str, pack_rows: str) -> Tensor:
    """``run``'s ``output`` ([B, R, ...]) at the positions that predict the response tokens."""
    device = next(model.parameters()).device
    p_len, r_len = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).to(device)
    attn = attention_mask(batch).to(device)
    pos = batch["position_ids"].to(device) if "position_ids" in batch else position_ids_from_mask(attn)
    groups = None
    if r_len > 0 and shares_prompts(model):
        prompt_pos = batch["position_ids"][:, :p_len] if "position_ids" in batch else None
        groups = prompt_groups(batch["prompt_ids"], batch["prompt_mask"], prompt_pos)
    if r_len > 0 and pack_rows != "off":
        packed = _packed(model, run, ids, attn, pos, p_len, r_len, output, groups, pack_rows)
        if packed is not None:
            return packed
    if groups is not None:
        first, inverse = (g.to(device) for g in groups)
        cache = shared_prompt_cache(run, ids[first, : p_len - 1], attn[first, : p_len - 1],
                                    pos[first, : p_len - 1], inverse)
        if cache:
            end = p_len + r_len - 1  # the last response token is never an input
            out = run(input_ids=ids[:, p_len - 1 : end], attention_mask=attn[:, :end].long(),
                      position_ids=pos[:, p_len - 1 : end], use_cache=True, **cache)
            return getattr(out, output)
    kwargs = {"logits_to_keep": r_len + 1} if forward_kwargs(run)[1] else {}
    values = getattr(run(input_ids=ids, attention_mask=attn.long(), position_ids=pos, use_cache=False, **kwargs), output)
    # with logits_to_keep the head ran on the last prompt position and the response positions only
    return values[:, -(r_len + 1) : -1] if kwargs else values[:, p_len - 1 : -1]

def _packed(model: nn.Module, run: nn.Module, ids: Tensor, attn: Tensor, pos: Tensor, p_len: int, r_len: int,
            output: str, groups: tuple[Tensor, Tensor] | None, pack_rows: str) -> Tensor | None:
    """The packed layout's output, or None where the other layouts run (see :func:`response_logits`)."""
    from workers import packed_rows

    ok, why = packed_rows.pack_rows_of(model)
    if not ok:
        if pack_rows == "on":
            raise ValueError(f"actor.pack_rows=on: cannot pack rows for this model ({why}); use auto or off")
        return None
    plan = packed_rows.plan_packing(ids, attn, pos)
    if plan is None:
        return None
    keep_logits = bool(forward_kwargs(run)[1])
    if pack_rows == "auto":
        cost = packed_rows.layout_tokens(attn, p_len, groups)
        other = cost["shared_prompt"] if groups is not None and forward_kwargs(run)[0] else cost["padded"]
        if plan.tokens >= other:
            return None
        # the full-logits path: the head runs on every bin at each column some bin needs, which can
        # be several times the padded layout's B × (R + 1) rows (and their [.., vocab] logits)
        if output == "logits" and packed_rows.head_rows(plan, p_len, r_len) > len(ids) * (r_len + 1 if keep_logits else ids.shape[1]):
            return None
    return packed_rows.packed_response_positions(run, plan, p_len, r_len, output, keep_logits)


__all__ = ["attention_mask", "forward_kwargs", "gather_rows", "prompt_groups", "response_hidden_states", "response_logits", "shared_prompt_cache", "shares_prompts"]
