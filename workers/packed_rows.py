"""Rows packed without padding for the trainer's forward passes (verl's ``use_remove_padding``).

A padded forward over ``[prompt ‖ response]`` computes B × W token positions, W being the widest
row; with response lengths from 3 to 256 most of them can be padding. Here the rows' real tokens
are packed first-fit-decreasing into bins of width W (the longest row's real length): a bin
holds several rows back to back, each with position ids restarting at 0, and the forward runs
with ``attention_mask=None``. transformers then builds a block-diagonal causal mask from the
position ids (``masking_utils.find_packed_sequence_indices``: a new sequence wherever a position
is not the previous one + 1) for the sdpa, eager and flex kernels, and flash-attention takes the
same position ids as its variable-length boundaries. So each row attends to itself only, exactly
as in the padded forward, on ``n_bins × W`` positions instead of ``B × W``; attention per bin
stays within W², no more than one padded row's.

The cost model (:func:`layout_tokens`) counts token positions; :func:`pack_rows_of` says whether a
model can take packed rows at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from workers.distributed import unwrapped

PackRows = Literal["auto", "on", "off"]

# causal LMs whose forward builds its attention mask with transformers' masking_utils (so packed
# position ids give a block-diagonal mask) and whose attention kernels honour it.
PACKABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "olmo2", "phi3"})
PACKABLE_ATTENTION = frozenset({"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"})


def pack_rows_of(model: nn.Module) -> tuple[bool, str]:
    """(whether ``model`` — plain, DDP/FSDP2- or PEFT-wrapped — can run packed rows, why not).

    Needs a transformers causal LM of a type in ``PACKABLE_MODEL_TYPES`` whose
    ``config._attn_implementation`` is one of ``PACKABLE_ATTENTION``. One forward either way, so
    DDP and FSDP2 (which expect one forward per backward) are fine.
    """
    config = getattr(unwrapped(model), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKABLE_MODEL_TYPES:
        return False, f"model_type {model_type!r} is not one of {sorted(PACKABLE_MODEL_TYPES)}"
    attn = getattr(config, "_attn_implementation", None)
    if attn not in PACKABLE_ATTENTION:
        return False, f"attention implementation {attn!r} is not one of {sorted(PACKABLE_ATTENTION)}"
    return True, ""


@dataclass(frozen=True)
class PackPlan:
    """Where each row's real tokens sit in the packed bins.

    ids/position_ids: [n_bins, width] int64, the packed input (a bin's unused tail is token 0 at
    positions 0, 1, ... — a sequence of its own that nothing reads); bin_of: [B] the bin of each
    row; offset: [B] the column its first real token lands on; keep: [B, W] bool the source
    columns that were packed (the attention mask); rank: [B, W] int64 each kept column's index
    among its row's kept columns.
    """

    ids: Tensor
    position_ids: Tensor
    bin_of: Tensor
    offset: Tensor
    keep: Tensor
    rank: Tensor

    @property
    def tokens(self) -> int:
        return self.ids.numel()


def bin_rows(lengths: list[int]) -> tuple[int, list[int], list[int]]:
    """First-fit decreasing of rows of ``lengths`` into bins of width max(lengths).

    Returns (width, bin of each row, offset of each row in its bin). Rows of equal length keep
    their order. Deterministic: the same lengths always give the same bins.
    """
    width = max(lengths, default=0)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    used: list[int] = []
    bin_of, offset = [0] * len(lengths), [0] * len(lengths)
    for i in order:
        n = lengths[i]
        b = next((k for k, u in enumerate(used) if u + n <= width), len(used))
        if b == len(used):
            used.append(0)
        bin_of[i], offset[i] = b, used[b]
        used[b] += n
    return width, bin_of, offset


def plan_packing(ids: Tensor, keep: Tensor, position_ids: Tensor) -> PackPlan | None:
    """The packing of rows ``ids`` [B, W] (real tokens where ``keep`` [B, W] bool), or None when
    the rows cannot be packed without changing what they compute: a row whose kept positions
    are not 0, 1, 2, ... (``position_ids`` [B, W], e.g. positions a caller chose), a row with
    no real token, or a row whose real tokens are not contiguous (a right-padded prompt, a hole
    in a response: the padded layout computes those pads' outputs, and a token after one is
    predicted from it)."""
    keep = keep.bool()
    rank = keep.long().cumsum(1) - 1
    lengths = keep.sum(1)
    if len(lengths) == 0 or bool((lengths == 0).any()):
        return None
    first = keep.long().argmax(1)
    last = keep.shape[1] - 1 - keep.flip(1).long().argmax(1)
    if not bool((last - first + 1 == lengths).all()):
        return None
    if not bool((position_ids.to(rank.device)[keep] == rank[keep]).all()):
        return None
    width, bin_of, offset = bin_rows(lengths.tolist())
    n_bins = max(bin_of) + 1
    device = ids.device
    bin_t = torch.tensor(bin_of, device=device)
    off_t = torch.tensor(offset, device=device)
    # packed positions: every column counts from the start of its segment; tails count from 0
    packed_ids = torch.zeros(n_bins, width, dtype=ids.dtype, device=device)
    packed_pos = torch.zeros(n_bins, width, dtype=torch.long, device=device)
    rows, cols = keep.nonzero(as_tuple=True)
    dest = off_t[rows] + rank[rows, cols]
    packed_ids[bin_t[rows], dest] = ids[rows, cols]
    packed_pos[bin_t[rows], dest] = rank[rows, cols]
    ends = off_t + lengths.to(device)
    for b in range(n_bins):  # a bin's unused tail is a sequence of its own: positions 0, 1, ...
        end = int(ends[bin_t == b].max())
        packed_pos[b, end:] = torch.arange(width - end, device=device)
    return PackPlan(packed_ids, packed_pos, bin_t, off_t, keep, rank)


def packed_response_positions(run: nn.Module, plan: PackPlan, p_len: int, r_len: int, output: str,
                              logits_to_keep: bool) -> Tensor:
    """``run``'s ``output`` at the positions predicting each response token, [B, r_len, ...].

    The packed forward of :func:`plan_packing`'s bins; response token t of row i (source column
    p_len + t) is predicted at the packed place of source column p_len + t − 1. Places whose
    token or predictor is padding hold zeros (the caller masks them). logits_to_keep: the
    model's forward takes ``logits_to_keep``, so the LM head runs on the needed columns only.
    """
    keep, rank = plan.keep, plan.rank
    b = len(keep)
    target = keep[:, p_len:]  # [B, R] the response token is real
    pred = keep[:, p_len - 1 : p_len - 1 + r_len] & target  # and so is its predictor
    col = plan.offset[:, None] + rank[:, p_len - 1 : p_len - 1 + r_len]  # [B, R] packed column
    bins = plan.bin_of[:, None].expand(b, r_len)
    kwargs: dict[str, object] = {}
    if logits_to_keep and output == "logits":
        needed = torch.unique(col[pred])  # sorted
        kwargs["logits_to_keep"] = needed
        col = torch.searchsorted(needed, col.clamp(min=0)).clamp(max=max(len(needed) - 1, 0))
    out = getattr(run(input_ids=plan.ids, position_ids=plan.position_ids, attention_mask=None, use_cache=False,
                      **kwargs), output)
    values = out[bins[pred], col[pred]]  # [n, ...]
    result = out.new_zeros((b, r_len, *out.shape[2:]))
    result[pred] = values
    return result


def head_rows(plan: PackPlan, p_len: int, r_len: int) -> int:
    """Rows the LM head computes in :func:`packed_response_positions` on the full-logits path:
    every bin, at each column some bin needs (``logits_to_keep`` is one set for all bins)."""
    keep = plan.keep
    pred = keep[:, p_len - 1 : p_len - 1 + r_len] & keep[:, p_len:]
    col = plan.offset[:, None] + plan.rank[:, p_len - 1 : p_len - 1 + r_len]
    return len(plan.ids) * int(torch.unique(col[pred]).numel())


def layout_tokens(keep: Tensor, p_len: int, groups: tuple[Tensor, Tensor] | None) -> dict[str, int]:
    """Token positions each forward layout computes for rows with real tokens at ``keep`` [B, P+R]:
    ``padded`` B·(P+R); ``shared_prompt`` U·(P−1) + B·R (groups = (first row of each distinct
    prompt [U], prompt of each row [B]) from :func:`workers.shared_prefix.prompt_groups`, None =
    not available); ``packed`` n_bins · longest row. A proxy for compute: attention (quadratic
    in the row width) is a small share at these widths."""
    b, w = keep.shape
    out = {"padded": b * w}
    if groups is not None:
        out["shared_prompt"] = len(groups[0]) * (p_len - 1) + b * (w - p_len)
    lengths = keep.sum(1).tolist()
    if lengths and min(lengths) > 0:
        width, bin_of, _ = bin_rows(lengths)
        out["packed"] = (max(bin_of) + 1) * width
    return out


__all__ = ["PACKABLE_ATTENTION", "PACKABLE_MODEL_TYPES", "PackPlan", "PackRows", "bin_rows", "head_rows", "layout_tokens",
           "pack_rows_of", "packed_response_positions", "plan_packing"]
