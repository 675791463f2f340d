"""Plain Hugging Face model folders (safetensors) that transformers and vLLM load as they are."""

from __future__ import annotations

import copy
import errno
import re
from pathlib import Path

from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.models.fsutil import OnExists, atomic_directory


class WriteError(OSError):
    """Model or checkpoint files could not be written (disk full, I/O error, ...). ``errno`` is
    the OS error's; the message names the path and the OS error in words."""


_RUST_IO = re.compile(r'Os \{ code: (\d+), kind: \w+, message: "([^"]*)" \}')


def io_error_text(exc: BaseException) -> str:
    """The OS error behind ``exc`` in a few words: ``No space left on device`` for an OSError,
    or for the Rust ``IoError(Os { code: 28, ... })`` text safetensors raises; else ``str(exc)``."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    match = _RUST_IO.search(str(exc))
    return match.group(2) if match else " ".join(str(exc).split())


def errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    match = _RUST_IO.search(str(exc))
    return int(match.group(1)) if match else None


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
    Returns the folder path. Raises WriteError (an OSError naming the folder and the OS
    error, e.g. "No space left on device") when writing fails; nothing is left at ``path``.
    """
    plain = plain_model_for_saving(model)
    final = Path(path)
    try:
        with atomic_directory(final, on_exists=on_exists) as tmp:
            plain.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    except (OSError, SafetensorError) as e:  # safetensors' writer raises its own type for a full disk
        if isinstance(e, FileExistsError):
            raise
        raise WriteError(errno_of(e) or errno.EIO, f"cannot write {final}: {io_error_text(e)}") from e
    return final
