"""Tiny random models and a char-level tokenizer for tests (no downloads).

The tokenizer mirrors the demo model's conventions: ChatML special tokens, and its pad
token is its EOS ``<|im_end|>`` (as in SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
SPECIAL_TOKENS = (UNK, IM_START, IM_END)
TINY_MAX_POSITIONS = 512  # the tiny models' context (max_position_embeddings)
# ChatML without a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level tokenizer: ids 0..2 = <unk>, <|im_start|>, <|im_end|>; then '\\n', '\\t' and
    printable ASCII 32..126 (100 tokens in all). eos = pad = <|im_end|>; left padding; ChatML
    chat template. A character outside the vocabulary becomes <unk>.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ["\n", "\t"] + [chr(i) for i in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=UNK, eos_token=IM_END, pad_token=IM_END, padding_side="left"
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = 32,
    layers: int = 2,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 2,
) -> LlamaForCausalLM:
    """A random float32 LlamaForCausalLM (4 heads, 2 KV heads, MLP 2×hidden, 512 positions).

    Initialised under ``torch.random.fork_rng`` seeded with ``seed``: the same seed gives the
    same weights, and the caller's global RNG state is left untouched.
    Default special ids match :func:`build_tiny_tokenizer` (and SmolLM2: pad = eos).
    """
    config = _tiny_llama_config(
        vocab_size, hidden_size, layers, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )
    return _seeded(LlamaForCausalLM, config, seed)


def _tiny_llama_config(vocab_size: int, hidden_size: int, layers: int, **extra: object) -> LlamaConfig:
    """The tiny models' shape: 4 heads, 2 KV heads, MLP 2×hidden, 512 positions, float32."""
    if hidden_size % 4:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of 4 (4 attention heads)")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_POSITIONS,
        dtype="float32",
        **extra,
    )


def _seeded(model_cls: type, config: LlamaConfig, seed: int):
    """``model_cls(config)`` initialised under ``fork_rng`` seeded with ``seed``, in float32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float()


def build_tiny_reward_model(
    vocab_size: int, *, hidden_size: int = 32, layers: int = 2, seed: int = 0, pad_token_id: int = 2
) -> LlamaForSequenceClassification:
    """A random float32 ``LlamaForSequenceClassification`` with one label (a reward model).

    Same shape conventions as :func:`build_tiny_model` (4 heads, 2 KV heads, MLP 2×hidden, 512
    positions); ``pad_token_id`` is what transformers pools by (the last non-pad token's logit).
    Initialised under ``torch.random.fork_rng`` seeded with ``seed`` (the caller's RNG is untouched).
    """
    config = _tiny_llama_config(vocab_size, hidden_size, layers, num_labels=1, pad_token_id=pad_token_id)
    return _seeded(LlamaForSequenceClassification, config, seed)
