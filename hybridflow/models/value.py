"""The critic: a transformer backbone + a float32 linear value head (PPO, Schulman et al. 2017)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, PreTrainedModel

from hybridflow.config import ModelConfig
from hybridflow.models.fsutil import OnExists, atomic_directory
from hybridflow.models.loading import load_causal_lm
from hybridflow.precision import model_precision

VALUE_HEAD_FILE = "value_head.safetensors"


def backbone_of(causal_lm: PreTrainedModel) -> PreTrainedModel:
    """The decoder stack of a causal LM without its LM head (``LlamaForCausalLM.model``)."""
    return getattr(causal_lm, causal_lm.base_model_prefix)


class ValueModel(nn.Module):
    """values = head(backbone(tokens).last_hidden_state), one scalar per position.

    The head is ``Linear(hidden, 1)`` in float32 whatever the backbone dtype, weights
    ~ N(0, 1/(hidden+1)) and bias 0 (OpenRLHF's init), drawn from a generator seeded by ``seed``.
    """

    def __init__(self, backbone: PreTrainedModel, *, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(1, hidden, generator=gen) / (hidden + 1))
            self.value_head.bias.zero_()

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """input_ids [B, T] int64, attention_mask [B, T] bool/int (True = real token),
        position_ids [B, T] int64 (from the mask, so left padding does not shift positions).

        Returns values [B, T] float32: ``values[:, t]`` is read from the hidden state after
        token t; padded positions hold numbers that the caller masks out.
        """
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids, use_cache=False
        )
        return self.value_head(out.last_hidden_state.float()).squeeze(-1)


def load_value_model(
    model_cfg: ModelConfig,
    *,
    critic_path: str | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> ValueModel:
    """The critic for ``critic_path`` (``CriticConfig.model_path``), else the policy model.

    A folder written by :func:`save_value_model` (it holds ``value_head.safetensors``)
    restores backbone and head. Anything else ``model_cfg.path`` accepts (HF folder, hub id
    in the cache, GGUF, "tiny") gives that model's backbone + a fresh head seeded by ``seed``
    ("tiny" backbones are initialised from ``seed`` as well).
    """
    path = critic_path or model_cfg.path
    p = Path(path).expanduser()
    if (p / VALUE_HEAD_FILE).is_file():
        backbone = AutoModel.from_pretrained(p, dtype=model_precision(model_cfg).torch_param_dtype())
        model = ValueModel(backbone, seed=seed)
        model.value_head.load_state_dict(load_file(p / VALUE_HEAD_FILE))
    else:
        lm = load_causal_lm(model_cfg.model_copy(update={"path": path}), device="cpu", seed=seed)
        model = ValueModel(backbone_of(lm), seed=seed)
    return model.to(device).train()


def save_value_model(model: ValueModel, path: str | Path, *, on_exists: OnExists = "replace") -> Path:
    """Write the backbone as an HF folder + ``value_head.safetensors``, atomically."""
    final = Path(path)
    with atomic_directory(final, on_exists=on_exists) as tmp:
        model.backbone.save_pretrained(tmp)
        head = {k: v.detach().contiguous().cpu() for k, v in model.value_head.state_dict().items()}
        save_file(head, tmp / VALUE_HEAD_FILE)
    return final
