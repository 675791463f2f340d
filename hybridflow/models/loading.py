"""Load the policy's tokenizer and causal LM from a :class:`~hybridflow.config.ModelConfig`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.config import ModelConfig
from hybridflow.models.gguf import materialize_gguf
from hybridflow.models.resolve import ResolvedModel, resolve_model_path
from hybridflow.models.tiny import TINY_MAX_POSITIONS, build_tiny_model, build_tiny_tokenizer
from hybridflow.precision import model_precision

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tokens that end a turn in common chat formats; each is a stop when the vocabulary has it.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def torch_dtype(name: str) -> torch.dtype:
    """"float32" | "bfloat16" | "float16" → the torch dtype. KeyError lists the allowed names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}; allowed: {', '.join(_DTYPES)}") from None


def hf_folder(resolved: ResolvedModel) -> Path:
    """A plain HF folder for a resolved model: the folder itself, or the GGUF's cached copy.

    Raises ValueError for "tiny" (it exists only in memory; save it with save_hf_checkpoint).
    """
    if resolved.is_gguf:
        return materialize_gguf(resolved.path)
    if resolved.path is None:
        raise ValueError(f"model {resolved.source!r} has no folder on disk")
    return resolved.path


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer for ``model_cfg.tokenizer_path or model_cfg.path``, ready for rollouts.

    Guarantees: ``padding_side == "left"``; a pad token (the tokenizer's own, else its EOS —
    SmolLM2's pad is its EOS ``<|im_end|>``). The tiny and SmolLM2 tokenizers carry a ChatML
    chat template (GGUF: transformers reads it from the file's metadata).
    Raises ValueError when the tokenizer has neither a pad nor an EOS token.
    """
    resolved = resolve_model_path(model_cfg.tokenizer_path or model_cfg.path)
    if resolved.kind == "tiny":
        tok = build_tiny_tokenizer()
    else:
        tok = AutoTokenizer.from_pretrained(hf_folder(resolved))
    return prepare_tokenizer(tok)


def prepare_tokenizer(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Set left padding and a pad token (EOS when missing), in place; returns ``tok``."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer {tok.name_or_path!r} has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_stop_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end a response: the EOS id first, then end-of-turn tokens the vocab has.

    For SmolLM2: [2 (<|im_end|>), 0 (<|endoftext|>)]; for the tiny tokenizer: [2].
    Raises ValueError when there is no stop token at all.
    """
    vocab = tokenizer.get_vocab()
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    for tok in _END_OF_TURN_TOKENS:
        if tok in vocab and vocab[tok] not in ids:
            ids.append(int(vocab[tok]))
    if not ids:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS / end-of-turn token")
    return ids


def context_length(model_cfg: ModelConfig) -> int | None:
    """The policy's context in tokens (``max_position_embeddings``, or ``n_positions`` /
    ``max_sequence_length`` / ``seq_length`` for architectures that name it so) from its
    config alone, no weights; None when the config does not say. "tiny": 512. GGUF: the cached
    HF copy's config (:func:`hf_folder`, which the tokenizer already needs)."""
    resolved = resolve_model_path(model_cfg.path)
    if resolved.kind == "tiny":
        return TINY_MAX_POSITIONS
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder(resolved))
    config = getattr(config, "text_config", None) or config  # multimodal wrappers
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_widths(model_cfg: ModelConfig) -> tuple[int, int]:
    """(hidden_size, intermediate_size) of the policy from its config alone, no weights (the
    precision probe's widths). "tiny": (tiny_hidden_size, 2 × that). A config without
    ``intermediate_size`` gives 4 × hidden."""
    resolved = resolve_model_path(model_cfg.path)
    if resolved.kind == "tiny":
        return model_cfg.tiny_hidden_size, 2 * model_cfg.tiny_hidden_size
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder(resolved))
    config = getattr(config, "text_config", None) or config  # multimodal wrappers
    hidden = int(config.hidden_size)
    return hidden, int(getattr(config, "intermediate_size", None) or 4 * hidden)


def load_causal_lm(model_cfg: ModelConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> PreTrainedModel:
    """The policy model in the run's parameter dtype (:func:`hybridflow.precision.model_precision`:
    float32 for fp32 and bf16-mixed, bfloat16 for bf16-true) on ``device``, in train mode.

    "tiny": a random Llama sized by ``tiny_hidden_size`` / ``tiny_layers`` over the tiny
    tokenizer's vocabulary, initialised from ``seed``. GGUF (a .gguf path or
    "smollm2-135m-instruct"): dequantised once and cached as safetensors (see
    :mod:`hybridflow.models.gguf`). HF folder / cached hub id: ``from_pretrained``.
    ``model_cfg.gradient_checkpointing`` is applied here. LoRA is not: see
    :func:`hybridflow.models.lora.apply_lora`.
    Raises ModelNotFoundError / ValueError from :func:`resolve_model_path`.
    """
    resolved = resolve_model_path(model_cfg.path)
    dtype = model_precision(model_cfg).torch_param_dtype()
    if resolved.kind == "tiny":
        vocab = len(build_tiny_tokenizer())
        model = build_tiny_model(vocab, hidden_size=model_cfg.tiny_hidden_size, layers=model_cfg.tiny_layers, seed=seed)
        model = model.to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(hf_folder(resolved), dtype=dtype)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device).train()
