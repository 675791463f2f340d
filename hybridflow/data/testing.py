"""A tiny character-level tokenizer for tests (no downloads): every character is a token,
plus special tokens, with a ChatML chat template that may or may not emit BOS.

Used by the data tests and useful to any test that needs a real ``transformers`` tokenizer.
"""

from __future__ import annotations

import string
from typing import Any

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def char_tokenizer(*, template_emits_bos: bool = False, adds_bos: bool = False, pad: bool = True) -> Any:
    """A ``PreTrainedTokenizerFast`` over printable ASCII characters.

    template_emits_bos: the chat template starts with ``<s>`` (like Llama 3's). adds_bos: the
    tokenizer's post-processor prepends ``<s>`` when ``add_special_tokens=True``. pad: whether
    a pad token (``<pad>``, id 0) is set. Ids: specials 0..4, then characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>" if pad else None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = ("<s>" if template_emits_bos else "") + CHATML_TEMPLATE
    return fast


__all__ = ["char_tokenizer", "CHATML_TEMPLATE"]
