"""Plain Hugging Face model folders (safetensors) that transformers and vLLM load as they are."""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.models.fsutil import OnExists, atomic_directory


def plain_model_for_saving(model: nn.Module) -> PreTrainedModel:
    """The transformers model to save: ``model`` itself, or for a peft model a merged copy.

    A LoRA model is deep-copied and ``merge_and_unload``-ed, so the live model (and its
    adapters) is not modified; that costs one extra copy of the weights while saving.
    Raises TypeError for a module that is neither a PreTrainedModel nor a peft model.
    """
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        PeftModel = ()  # noqa: N806
    if PeftModel and isinstance(model, PeftModel):
        return copy.deepcopy(model).merge_and_unload()
    if isinstance(model, PreTrainedModel):
        return model
    raise TypeError(f"cannot save {type(model).__name__} as a Hugging Face model (unwrap FSDP/DDP first)")


def save_hf_checkpoint(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    path: str | Path,
    *,
    on_exists: OnExists = "replace",
) -> Path:
    """Write ``model`` (+ ``tokenizer``) as a plain HF folder with safetensors weights, atomically.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(path)`` (and vLLM): no
    quantization_config, no peft wrapper (LoRA adapters merged into the weights), tied
    embeddings stored once. It is written to a temporary sibling and renamed into place.
    on_exists: "replace" (default), "error" or "keep" when ``path`` already exists.
    Returns the folder path.
    """
    plain = plain_model_for_saving(model)
    final = Path(path)
    with atomic_directory(final, on_exists=on_exists) as tmp:
        plain.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return final
