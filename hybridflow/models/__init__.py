"""Loading policy / critic / tokenizer: HF folder, cached hub id, GGUF file, tiny test models.

Importing this package imports torch and transformers.
"""

from hybridflow.models.checkpoint import plain_model_for_saving, save_hf_checkpoint
from hybridflow.models.gguf import cache_root, dequantize_gguf, gguf_cache_dir, materialize_gguf
from hybridflow.models.loading import (
    hf_folder,
    load_causal_lm,
    load_tokenizer,
    prepare_tokenizer,
    tokenizer_stop_ids,
    torch_dtype,
)
from hybridflow.models.lora import (
    adapter_disabled,
    apply_lora,
    is_lora_model,
    lora_adapter_state,
    merged_named_tensors,
)
from hybridflow.models.resolve import ModelNotFoundError, ResolvedModel, resolve_model_path, smollm2_gguf_path
from hybridflow.models.reward_model import RewardModelScorer, RewardModelScores, load_reward_model
from hybridflow.models.tiny import build_tiny_model, build_tiny_reward_model, build_tiny_tokenizer
from hybridflow.models.value import ValueModel, backbone_of, load_value_model, save_value_model

__all__ = [
    "ModelNotFoundError",
    "ResolvedModel",
    "RewardModelScorer",
    "RewardModelScores",
    "ValueModel",
    "adapter_disabled",
    "apply_lora",
    "backbone_of",
    "build_tiny_model",
    "build_tiny_reward_model",
    "build_tiny_tokenizer",
    "cache_root",
    "dequantize_gguf",
    "gguf_cache_dir",
    "hf_folder",
    "is_lora_model",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "load_value_model",
    "lora_adapter_state",
    "materialize_gguf",
    "merged_named_tensors",
    "plain_model_for_saving",
    "prepare_tokenizer",
    "resolve_model_path",
    "save_hf_checkpoint",
    "save_value_model",
    "smollm2_gguf_path",
    "tokenizer_stop_ids",
    "torch_dtype",
]
