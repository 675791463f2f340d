"""Model resolution and loading: tiny models, HF folders, the offline hub cache, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config import ModelConfig
from hybridflow.models import (
    ModelNotFoundError,
    build_tiny_model,
    build_tiny_tokenizer,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
    save_hf_checkpoint,
    smollm2_gguf_path,
    tokenizer_stop_ids,
)
from hybridflow.models.fsutil import atomic_directory

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def logits_of(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


IDS = torch.tensor([[1, 40, 41, 42, 2, 50]])


# ---- resolve ------------------------------------------------------------------------------------
def test_resolve_aliases_files_and_folders(tmp_path):
    assert resolve_model_path("tiny").kind == "tiny"
    smol = resolve_model_path("smollm2-135m-instruct")
    assert smol.kind == "smollm2" and smol.path == smollm2_gguf_path() and smol.path.suffix == ".gguf"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path(str(gguf)).kind == "gguf"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path / "hf")) .kind == "hf_dir"


def test_resolve_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nope" / "model")
    with pytest.raises(FileNotFoundError, match="nope/model"):
        resolve_model_path(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(tmp_path / "w.bin"))


def test_hub_id_resolves_from_the_local_cache_only(tmp_path):
    # the hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "models--acme--tiny-llama"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = resolve_model_path("acme/tiny-llama", hub_cache_dir=tmp_path)
    assert r.kind == "hub_cache" and r.path == snap
    with pytest.raises(ModelNotFoundError, match=r"'acme/other'.*not in the local Hugging Face cache at .*"):
        resolve_model_path("acme/other", hub_cache_dir=tmp_path)


# ---- tiny tokenizer / model -----------------------------------------------------------------------
def test_tiny_tokenizer_is_char_level_chatml_with_pad_equal_eos():
    tok = build_tiny_tokenizer()
    assert len(tok) == 100  # 3 specials + '\n' + '\t' + 95 printable ASCII
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.padding_side == "left"
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    # <|im_start|> (1) + "user" (4) + \n (1) + "2+2?" (4) + <|im_end|> (1) + \n (1) + <|im_start|> (1)
    # + "assistant" (9) + \n (1) = 23 tokens; <|im_end|> (id 2) is token 1 + 4 + 1 + 4 = index 10
    assert len(ids) == 23 and ids[0] == 1 and ids[10] == 2
    assert tok.decode(ids) == text
    assert tokenizer_stop_ids(tok) == [2]


def test_load_tiny_model_from_config_is_seeded_and_sized():
    cfg = ModelConfig(path="tiny", tiny_hidden_size=16, tiny_layers=3)
    a, b, c = load_causal_lm(cfg, seed=0), load_causal_lm(cfg, seed=0), load_causal_lm(cfg, seed=1)
    assert a.config.hidden_size == 16 and a.config.num_hidden_layers == 3 and a.config.vocab_size == 100
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied, like SmolLM2
    assert a.training and a.dtype == torch.float32
    assert torch.equal(logits_of(a, IDS), logits_of(b, IDS))
    assert not torch.equal(logits_of(a, IDS), logits_of(c, IDS))
    tok = load_tokenizer(cfg)
    assert tok.padding_side == "left" and tok.pad_token_id == 2


def test_untied_tiny_model():
    m = build_tiny_model(100, tie_word_embeddings=False)
    assert m.lm_head.weight is not m.model.embed_tokens.weight


# ---- checkpoints ----------------------------------------------------------------------------------
def test_save_hf_checkpoint_round_trips_through_from_pretrained(tmp_path):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), seed=4)
    out = save_hf_checkpoint(model, tok, tmp_path / "ckpt")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".ckpt.tmp-*"))  # the temporary folder was renamed away
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits_of(model, IDS), logits_of(loaded, IDS))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tok2 = AutoTokenizer.from_pretrained(out)
    assert tok2("<|im_start|>ab")["input_ids"] == [1, 70, 71] and tok2.chat_template == tok.chat_template
    # and through our own loader
    again = load_causal_lm(ModelConfig(path=str(out)))
    assert torch.equal(logits_of(model, IDS), logits_of(again, IDS))


def test_atomic_directory_cleans_up_on_error_and_respects_on_exists(tmp_path):
    target = tmp_path / "d"
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "f").write_text("half")
        raise RuntimeError("writer crashed")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_directory(target) as tmp:
        (tmp / "f").write_text("one")
    with pytest.raises(FileExistsError):
        with atomic_directory(target, on_exists="error"):
            pass
    with atomic_directory(target, on_exists="keep") as tmp:
        (tmp / "f").write_text("two")
    assert (target / "f").read_text() == "one"
    with atomic_directory(target, on_exists="replace") as tmp:
        (tmp / "f").write_text("three")
    assert (target / "f").read_text() == "three" and len(list(tmp_path.iterdir())) == 1
