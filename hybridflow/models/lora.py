"""LoRA through peft (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021).

With LoRA the reference policy needs no second copy: the base weights are frozen, so the
model with its adapters disabled *is* the initial policy (:func:`adapter_disabled`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hybridflow.config import ModelConfig


def apply_lora(model: nn.Module, model_cfg: ModelConfig, *, seed: int | None = None) -> nn.Module:
    """Wrap ``model`` with LoRA adapters when ``model_cfg.lora_rank > 0``; else return it unchanged.

    Adapters: rank ``lora_rank``, scaling ``lora_alpha / lora_rank``, on ``target_modules``,
    no dropout (so a recomputed log-prob equals the rollout's), B initialised to zero (the
    wrapped model starts equal to the base). Only adapter weights are trainable.
    seed: initialise A (Kaiming-uniform, peft's default) from this seed without touching the
    global RNG, so two workers of one config — or a worker restarted before the first
    checkpoint — start from the same adapters; None draws from the global RNG.
    """
    if model_cfg.lora_rank == 0:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        target_modules=list(model_cfg.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    if seed is None:
        return get_peft_model(model, config)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def is_lora_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model`` computes with its LoRA adapters off (the reference policy).

    Raises ValueError for a model without adapters (the reference then needs its own copy).
    """
    if not is_lora_model(model):
        raise ValueError(
            f"{type(model).__name__} has no LoRA adapters; a reference without adapters needs a separate model copy"
        )
    with model.disable_adapter():
        yield model


def merged_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in plain Hugging Face names, with LoRA deltas merged into the weights.

    A plain model yields its state dict. A peft model yields ``W + scaling·B·A`` under the
    base model's names (``model.layers.0.self_attn.q_proj.weight``), no ``lora_`` tensors,
    and leaves the live model untouched. Tensors are detached (no copy for unmerged ones).
    """
    if not is_lora_model(model):
        for name, t in model.state_dict().items():
            yield name, t.detach()
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for mod_name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    delta = module.get_delta_weight(adapter).detach()
                    key = f"{mod_name}.base_layer.weight"
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        out = t.detach() + deltas[name] if name in deltas else t.detach()
        yield name.replace(".base_layer.", "."), out


def lora_adapter_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The active LoRA adapter of a peft model as PEFT writes it to disk: (tensors, config).

    tensors: ``peft.get_peft_model_state_dict`` — only ``lora_A`` / ``lora_B`` weights, named
    as in ``adapter_model.safetensors`` (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``,
    no adapter name), detached, contiguous. config: the adapter's ``LoraConfig`` as the JSON
    ``adapter_config.json`` holds (sets → sorted lists, enums → their values, ``inference_mode``
    True). This is what vLLM's LoRA loader reads from an adapter folder.
    Raises ValueError for a model without adapters.
    """
    if not is_lora_model(model):
        raise ValueError(f"{type(model).__name__} has no LoRA adapters")
    from peft import get_peft_model_state_dict

    name = model.active_adapter
    tensors = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    config = {k: _jsonable(v) for k, v in model.peft_config[name].to_dict().items()}
    config["inference_mode"] = True
    return tensors, config


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
