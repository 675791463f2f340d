"""LoRA (peft) wrapping, the adapter-off reference, merged weights, and the critic's value model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.algorithms.sequences import position_ids_from_mask
from hybridflow.config import ModelConfig
from hybridflow.models import (
    adapter_disabled,
    apply_lora,
    build_tiny_model,
    load_value_model,
    merged_named_tensors,
    save_hf_checkpoint,
    save_value_model,
)
from workers.rollout.hf import HFRolloutEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


IDS = torch.tensor([[1, 40, 41, 42, 2, 50], [1, 60, 61, 62, 63, 64]])
LORA = ModelConfig(path="tiny", lora_rank=4, lora_alpha=8)


def logits_of(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def lora_model_with_trained_adapters():
    base_logits = logits_of(build_tiny_model(100, seed=0).eval())
    model = apply_lora(build_tiny_model(100, seed=0), LORA).eval()
    with torch.no_grad():  # stand-in for training: B starts at 0, give it values
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    return model, base_logits


def test_apply_lora_only_when_rank_positive_and_trains_only_adapters():
    plain = build_tiny_model(100)
    assert apply_lora(plain, ModelConfig(path="tiny")) is plain
    model = apply_lora(build_tiny_model(100), LORA)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_adapter_disabled_gives_the_base_model_reference():
    model, base_logits = lora_model_with_trained_adapters()
    assert not torch.allclose(logits_of(model), base_logits)  # the adapters do something
    with adapter_disabled(model):
        assert torch.allclose(logits_of(model), base_logits, atol=1e-6)
    assert not torch.allclose(logits_of(model), base_logits)  # back on after the block
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with adapter_disabled(build_tiny_model(100)):
            pass


def test_merged_tensors_and_checkpoint_reproduce_the_lora_model(tmp_path):
    model, _ = lora_model_with_trained_adapters()
    want = logits_of(model)
    merged = dict(merged_named_tensors(model))
    assert not any("lora_" in n or "base_layer" in n for n in merged)
    plain = build_tiny_model(100, seed=9).eval()
    plain.load_state_dict(merged)
    assert torch.allclose(logits_of(plain), want, atol=1e-5)
    # the live model is untouched: still a peft model whose output did not move
    assert torch.equal(logits_of(model), want)
    out = save_hf_checkpoint(model, None, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.allclose(logits_of(loaded), want, atol=1e-5)
    # the HF engine accepts merged HF names on a separate plain model
    HFRolloutEngine(plain, _Tok()).load_weights(merged_named_tensors(model))


class _Tok:
    pad_token_id = 2


def test_value_model_shapes_padding_invariance_and_save_load(tmp_path):
    vm = load_value_model(ModelConfig(path="tiny"), seed=0).eval()
    assert vm.value_head.weight.dtype == torch.float32 and vm.value_head.bias.item() == 0.0
    ids = torch.tensor([[2, 2, 2, 40, 41, 42], [40, 41, 42, 43, 44, 45]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        values = vm(ids, mask, position_ids_from_mask(mask))
        alone = vm(ids[:1, 3:], mask[:1, 3:], position_ids_from_mask(mask[:1, 3:]))
    assert values.shape == (2, 6) and values.dtype == torch.float32
    assert torch.allclose(values[0, 3:], alone[0], atol=1e-5)  # 3 left pads change nothing
    out = save_value_model(vm, tmp_path / "critic")
    again = load_value_model(ModelConfig(path="tiny"), critic_path=str(out)).eval()
    with torch.no_grad():
        assert torch.equal(again(ids, mask, position_ids_from_mask(mask)), values)


def test_value_model_from_a_separate_critic_path(tmp_path):
    policy_dir = save_hf_checkpoint(build_tiny_model(100, seed=5), None, tmp_path / "critic_lm")
    vm = load_value_model(ModelConfig(path="tiny"), critic_path=str(policy_dir), seed=1)
    lm = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert torch.equal(vm.backbone.embed_tokens.weight, lm.model.embed_tokens.weight)


def test_lora_adapters_start_from_the_seed_not_the_global_rng():
    from hybridflow.models.lora import apply_lora

    cfg = ModelConfig(path="tiny", lora_rank=4, target_modules=["q_proj", "v_proj"])

    def adapters(global_seed: int, seed: int) -> dict:
        torch.manual_seed(global_seed)
        m = apply_lora(build_tiny_model(100, hidden_size=16, layers=1, seed=0), cfg, seed=seed)
        return {k: v.detach().clone() for k, v in m.state_dict().items() if "lora_A" in k}

    a, b, other = adapters(1, seed=7), adapters(2, seed=7), adapters(1, seed=8)
    assert a and all(torch.equal(a[k], b[k]) for k in a)  # same seed, whatever the global RNG
    assert not all(torch.equal(a[k], other[k]) for k in a)
    base = build_tiny_model(100, hidden_size=16, layers=1, seed=0)
    before = torch.get_rng_state()
    apply_lora(base, cfg, seed=7)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is untouched
