"""A learned reward model: ``AutoModelForSequenceClassification`` with one label.

The score of a (prompt, response) pair is the model's logit at the sequence's last non-pad
token — transformers' own pooling, the one TRL's RewardTrainer trains with — as in verl's
RewardModelWorker and OpenRLHF (Ouyang et al., "Training language models to follow
instructions with human feedback", 2022). The reward model has its own tokenizer: responses
arrive as text and are re-tokenized here (:func:`encode_for_reward_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from hybridflow.algorithms.sequences import position_ids_from_mask
from hybridflow.config import RewardModelConfig
from hybridflow.models.loading import torch_dtype
from hybridflow.models.resolve import ModelNotFoundError, resolve_model_path
from hybridflow.models.tiny import build_tiny_reward_model, build_tiny_tokenizer

Prompt = str | list[dict[str, Any]]  # rendered / plain prompt text, or chat messages [{role, content}]


@dataclass(frozen=True)
class RewardModelScores:
    """scores: one float per row (the model's logit, float32 precision, before any weight).
    truncated: whether the row lost tokens from the left to fit ``max_length``."""

    scores: list[float]
    truncated: list[bool]


def load_reward_model(
    rm_cfg: RewardModelConfig, *, dtype: str = "float32", device: str | torch.device = "cpu", seed: int = 0
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """The reward model (eval mode, on ``device``) and its own tokenizer.

    "tiny": :func:`build_tiny_reward_model` over the tiny char tokenizer, initialised from ``seed``.
    A folder / cached hub id: ``AutoModelForSequenceClassification`` + ``AutoTokenizer`` from it;
    the tokenizer keeps its own padding side and gets its EOS as pad token when it has none.
    Raises ModelNotFoundError / ValueError naming ``reward.model.path``: missing model, a GGUF file
    (a causal LM), a config whose architectures are not a sequence classifier (its score head
    would be random), or num_labels != 1; ValueError when ``rm_cfg.path`` is None.
    """
    where = f"reward.model.path={rm_cfg.path!r}"
    if rm_cfg.path is None:
        raise ValueError("reward.model.path is None: no reward model is configured")
    try:
        resolved = resolve_model_path(rm_cfg.path)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"{where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if resolved.is_gguf:
        raise ValueError(f"{where}: a GGUF file holds a causal LM, not a sequence-classification reward model")
    if resolved.kind == "tiny":
        tok = build_tiny_tokenizer()
        model: nn.Module = build_tiny_reward_model(len(tok), seed=seed, pad_token_id=tok.pad_token_id)
        model = model.to(torch_dtype(dtype))
    else:
        tok = AutoTokenizer.from_pretrained(resolved.path)
        _check_architecture(resolved.path, where)
        model = AutoModelForSequenceClassification.from_pretrained(resolved.path, dtype=torch_dtype(dtype))
    if model.config.num_labels != 1:
        raise ValueError(f"{where}: the model has num_labels={model.config.num_labels}; a reward model has 1")
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"{where}: the tokenizer has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    if model.config.pad_token_id is None:  # transformers pools at the last token that is not this id
        model.config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok


def _check_architecture(folder: Any, where: str) -> None:
    import json

    archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{where}: config.json lists architectures {archs}, not a *ForSequenceClassification model "
            "(its score head would be random)"
        )


def prompt_text(prompt: Prompt) -> str:
    """A prompt as plain text: the string itself, or the messages' contents joined by newlines
    with a trailing newline (``[{user: "a"}, {assistant: "b"}]`` → ``"a\\nb\\n"``)."""
    if isinstance(prompt, str):
        return prompt
    return "".join(f"{m['content']}\n" for m in prompt)


def encode_for_reward_model(
    prompts: Sequence[Prompt], responses: Sequence[str], tokenizer: PreTrainedTokenizerBase, *,
    apply_chat_template: bool,
) -> list[list[int]]:
    """Token ids of each (prompt, response) conversation in the reward model's tokenizer.

    Chat messages, with ``apply_chat_template`` and a tokenizer that has a chat template:
    ``apply_chat_template(messages + [{"role": "assistant", "content": response}])`` tokenized
    without added special tokens (the template writes its own). Otherwise the plain text
    ``prompt_text(prompt) + response`` with the tokenizer's usual special tokens — also for a
    string prompt, which is used as it is (the dataset's ``raw_prompt`` is the prompt already
    rendered by the *policy's* template, so the reward model sees the policy's format).
    Raises ValueError for a row that encodes to no token.
    """
    use_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    rows: list[list[int]] = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        if use_template and isinstance(prompt, list):
            text = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": response}], tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt_text(prompt) + response, add_special_tokens=True)["input_ids"]
        if not ids:
            raise ValueError(f"row {i}: prompt and response encode to no reward-model token")
        rows.append(list(ids))
    return rows


def truncate_left(ids: list[int], max_length: int) -> tuple[list[int], bool]:
    """The last ``max_length`` tokens (the prompt's start is dropped first) and whether any was dropped.
    Example: ([1, 2, 3, 4], 3) → ([2, 3, 4], True)."""
    if len(ids) <= max_length:
        return ids, False
    return ids[-max_length:], True


def pad_rows(rows: Sequence[list[int]], pad_token_id: int, side: str) -> tuple[Tensor, Tensor]:
    """[B, L] int64 ids padded with ``pad_token_id`` on ``side`` ("left" | "right") and a [B, L]
    bool mask (True = token); L = the longest row. Example: [[5], [6, 7]], left → [[p, 5], [6, 7]]."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side {side!r}; allowed: left, right")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.int64)
        mask[i, cols] = True
    return ids, mask


class RewardModelScorer:
    """Scores (prompt, response) text pairs with a reward model, ``micro_batch_trajectories`` rows
    per forward, in eval mode without gradients.

    model: a sequence classifier with one label (``config.pad_token_id`` set);
    tokenizer: the model's own (its ``padding_side`` is used); cfg: ``reward.model``.
    """

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: RewardModelConfig) -> None:
        self.model, self.tokenizer, self.cfg = model.eval(), tokenizer, cfg
        self.pad_token_id = int(model.config.pad_token_id)

    @classmethod
    def from_config(
        cls, cfg: RewardModelConfig, *, dtype: str = "float32", device: str | torch.device = "cpu", seed: int = 0
    ) -> RewardModelScorer:
        model, tokenizer = load_reward_model(cfg, dtype=dtype, device=device, seed=seed)
        return cls(model, tokenizer, cfg)

    def encode(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> tuple[list[list[int]], list[bool]]:
        """Each row's reward-model ids, cut to ``max_length`` from the left, and whether it was cut."""
        rows = encode_for_reward_model(prompts, responses, self.tokenizer,
                                       apply_chat_template=self.cfg.apply_chat_template)
        cut = [truncate_left(r, self.cfg.max_length) for r in rows]
        return [ids for ids, _ in cut], [was_cut for _, was_cut in cut]

    @torch.no_grad()
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> RewardModelScores:
        """One logit per row (see :class:`RewardModelScores`); the result does not depend on the
        micro-batch size or on padding (positions come from the attention mask)."""
        rows, truncated = self.encode(prompts, responses)
        device = next(self.model.parameters()).device
        scores: list[float] = []
        step = self.cfg.micro_batch_trajectories
        for start in range(0, len(rows), step):
            ids, mask = pad_rows(rows[start : start + step], self.pad_token_id, self.tokenizer.padding_side)
            out = self.model(input_ids=ids.to(device), attention_mask=mask.long().to(device),
                             position_ids=position_ids_from_mask(mask).to(device), use_cache=False)
            scores.extend(out.logits[:, 0].float().cpu().tolist())
        return RewardModelScores(scores, truncated)


__all__ = [
    "RewardModelScorer",
    "RewardModelScores",
    "encode_for_reward_model",
    "load_reward_model",
    "pad_rows",
    "prompt_text",
    "truncate_left",
]
