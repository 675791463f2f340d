"""The fused CPU decode step (workers/rollout/fused_decode.py) against the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridflow.algorithms.sequences import position_ids_from_mask
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers.rollout.base import SamplingParams
from workers.rollout.decode import ModelSteps, decode
from workers.rollout.fused_decode import fused_decoder, why_not_fused, why_not_fused_engine
from workers.rollout.hf import HFRolloutEngine

TOK = build_tiny_tokenizer()
STOPS = (2, *TOK.convert_tokens_to_ids(list("abcde")))  # ~6 % of steps stop on the tiny model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def _norms_off_one(model, seed=0):
    """RMSNorm weights drawn from [0.5, 1.5) (they start at 1) and biases from N(0, 0.1²) (they
    start at 0), so a mis-applied norm or bias shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _seeded(cls, cfg, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg).float()
    return _norms_off_one(model, seed)


def llama(seed=0):  # 4 heads on 2 KV heads, tied head
    return _norms_off_one(build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=seed), seed)


def llama_bias(seed=0):  # attention_bias: q/k/v and o biases
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attention_bias=True, pad_token_id=2)  # fmt: skip
    return _seeded(LlamaForCausalLM, cfg, seed)


def qwen2(seed=0):  # q/k/v bias, 8 heads on 2 KV heads, untied head
    cfg = Qwen2Config(vocab_size=len(TOK), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=2)  # fmt: skip
    return _seeded(Qwen2ForCausalLM, cfg, seed)


def mistral(seed=0):  # no GQA, RoPE theta of its own
    cfg = MistralConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                        sliding_window=None, rope_theta=500.0, pad_token_id=2)  # fmt: skip
    return _seeded(MistralForCausalLM, cfg, seed)


def prompts(texts):
    enc = TOK(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"].bool()


TEXTS = ["abc", "hello there, how are you", "zz top", "q"]


@pytest.mark.parametrize("build", [llama, llama_bias, qwen2, mistral])
def test_prefill_and_steps_give_the_models_logits(build):
    """Teacher-forced: the fused prefill + steps give the logits of one full forward pass over the
    same left-padded sequences, at every real position after the prompt."""
    model = build()
    assert why_not_fused(model) is None
    ids, mask = prompts(TEXTS)
    follow = torch.randint(5, len(TOK), (len(TEXTS), 6), generator=torch.Generator().manual_seed(0))
    full_ids = torch.cat([ids, follow], 1)
    full_mask = torch.cat([mask, torch.ones_like(follow, dtype=torch.bool)], 1)
    with torch.no_grad():
        ref = model(input_ids=full_ids, attention_mask=full_mask.long(),
                    position_ids=position_ids_from_mask(full_mask)).logits  # fmt: skip
        dec = fused_decoder(model, 4)
        dec.prefill(ids, mask, None, follow.shape[1])
        pos = position_ids_from_mask(full_mask)
        cols = ids.shape[1]
        got = [dec.step(full_ids[:, c], pos[:, c]) for c in range(cols - 1, cols + follow.shape[1] - 1)]
    got = torch.stack(got, 1)
    want = ref[:, cols - 1 : cols + follow.shape[1] - 1]
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()


@pytest.mark.parametrize("build", [llama, qwen2, mistral])
@pytest.mark.parametrize("temperature,n", [(0.0, 1), (0.0, 3), (1.0, 4), (0.7, 2)])
def test_decode_equals_the_model_forward_loop(build, temperature, n):
    """The decode loop on the fused steps against the same loop on the model's forward: repeated
    prompts (prefilled once, rows gathered), rows finishing at stop tokens and leaving the batch."""
    model = build()
    ids, mask = prompts(TEXTS)
    rows = torch.arange(len(TEXTS)).repeat_interleave(n)
    uniforms = None if temperature == 0 else torch.rand(len(rows), 20, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # row 0's 6th token becomes a stop too, so at least one row leaves early
        probe = decode(model, ids[rows], mask[rows], SamplingParams(max_new_tokens=20, n=n, temperature=temperature),
                       uniforms, 2)  # fmt: skip
    stops = (*STOPS, int(probe.response_ids[0, 5]))
    sampling = SamplingParams(max_new_tokens=20, stop_token_ids=stops, n=n, seed=3, temperature=temperature)
    with torch.no_grad():
        ref = decode(model, ids[rows], mask[rows], sampling, uniforms, 2)
        dec = fused_decoder(model, len(rows))
        dec.prefill(ids, mask, rows, 20)
        got = decode(model, ids[rows], mask[rows], sampling, uniforms, 2, steps=dec)
    assert got.row_steps == got.useful_row_steps  # finished rows cost nothing
    lengths = (got.log_probs != 0).sum(-1)
    assert int(lengths.min()) < 20 and int(lengths.max()) == got.response_ids.shape[1]  # rows left early
    same = (got.response_ids == ref.response_ids).all(-1)
    if sampling.greedy:
        assert bool(same.all())
    else:  # a token flips only where float rounding moves a uniform across a CDF boundary
        assert same.float().mean() >= 0.9
    assert (got.log_probs - ref.log_probs)[same].abs().max() < 2e-5


def test_engine_runs_fused_and_matches_the_unfused_engine_after_a_weight_update():
    """The engine prepares the fused weights per call: an optimizer step between two calls is
    seen (same greedy tokens as the unfused engine on the new weights)."""
    model = llama(seed=2)
    fused, plain = HFRolloutEngine(model, TOK), HFRolloutEngine(model, TOK, fused_decode=False)
    ids, mask = prompts(["hello", "abc d", "hello"])
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=STOPS, n=2)
    before = fused.generate(ids, mask, greedy)
    assert fused.fused_decode_reason is None and fused.packed_linears == 0 and fused._fused is None
    assert plain.fused_decode_reason is not None
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    model(input_ids=ids).logits[..., 3].sum().backward()
    opt.step()
    a, b = fused.generate(ids, mask, greedy), plain.generate(ids, mask, greedy)
    assert not torch.equal(before.response_ids, b.response_ids)  # the update changed the output
    assert torch.equal(a.response_ids, b.response_ids) and a.finish_reason == b.finish_reason
    assert (a.rollout_log_probs - b.rollout_log_probs).abs().max() < 1e-4
    assert model.training  # generate restores the mode


def test_models_it_cannot_run_decode_through_their_forward():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(TOK), n_embd=32, n_layer=1, n_head=4)).eval()
    assert "model_type 'gpt2'" in why_not_fused(gpt2)
    lora = get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "q/k/v projections" in why_not_fused(lora.get_base_model())
    hooked = llama()
    handle = hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert "model.layers.1.mlp" in why_not_fused(hooked)
    handle.remove()
    windowed = mistral()
    windowed.config.sliding_window = 8
    assert "sliding" in why_not_fused(windowed)
    mixed = qwen2()
    mixed.config.layer_types = ["full_attention", "sliding_attention"]
    assert "sliding" in why_not_fused(mixed)
    # the engine falls back and says why
    ids, mask = prompts(["hello", "abc d"])
    engine = HFRolloutEngine(lora, TOK)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=5, temperature=0.0, n=1))
    assert out.response_ids.shape[0] == 2 and "q/k/v projections" in engine.fused_decode_reason


def test_prefill_rejects_prompts_ending_in_padding():
    dec = fused_decoder(llama(), 2)
    ids = torch.tensor([[5, 6, 2], [5, 6, 7]])
    with pytest.raises(ValueError, match="end in a real token"):
        dec.prefill(ids, torch.tensor([[True, True, False], [True, True, True]]), None, 4)


def test_model_steps_is_the_default_of_decode():
    model = llama()
    ids, mask = prompts(TEXTS)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, n=1)
    with torch.no_grad():
        a = decode(model, ids, mask, sampling, None, 2)
        b = decode(model, ids, mask, sampling, None, 2, steps=ModelSteps(model, ids, mask, position_ids_from_mask(mask)))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)


def test_kv_buffers_grow_as_rows_decode_and_hold_only_live_rows(monkeypatch):
    """Room for 1 new column at first: the buffers double (up to the call's total) as decoding goes
    on, keep only the live rows when they grow, and the results stay the forward loop's."""
    import workers.rollout.fused_decode as fd

    monkeypatch.setattr(fd, "GROW_COLUMNS", 1)
    model = qwen2(seed=4)
    ids, mask = prompts(TEXTS)
    rows = torch.arange(len(TEXTS)).repeat_interleave(3)
    sampling = SamplingParams(max_new_tokens=100, stop_token_ids=STOPS, n=3, temperature=0.0)
    widths = []
    with torch.no_grad():
        ref = decode(model, ids[rows], mask[rows], sampling, None, 2)
        dec = fd.fused_decoder(model, len(rows))
        dec.prefill(ids, mask, rows, 100)
        assert dec.keys[0].shape[2] == ids.shape[1] + 1 and dec.total == ids.shape[1] + 99
        step = dec.step
        dec.step = lambda tok, pos: (widths.append((len(tok), dec.keys[0].shape[0], dec.keys[0].shape[2])),
                                     step(tok, pos))[1]  # fmt: skip
        got = decode(model, ids[rows], mask[rows], sampling, None, 2, steps=dec)
    assert torch.equal(got.response_ids, ref.response_ids)
    assert (got.log_probs - ref.log_probs).abs().max() < 2e-5
    capacities = sorted({w[2] for w in widths})
    assert len(capacities) >= 3 and capacities[-1] <= ids.shape[1] + 99
    grown = [w for prev, w in zip(widths, widths[1:], strict=False) if w[2] > prev[2]]
    assert any(rows_held < len(rows) for _, rows_held, _ in grown)  # a growth after rows had left
    assert all(live <= held for live, held, _ in widths)


def test_a_step_past_the_room_prefill_made_raises():
    dec = fused_decoder(llama(), 1)
    ids, mask = prompts(["abc"])
    with torch.no_grad():
        dec.prefill(ids, mask, None, 1)
        pos = position_ids_from_mask(mask)[:, -1]
        dec.step(ids[:, -1], pos)
        with pytest.raises(ValueError, match="past the"):
            dec.step(ids[:, -1], pos + 1)


def test_what_the_fused_path_would_get_wrong_falls_back():
    """Found by review: each of these would decode differently (or pointlessly) through the fused
    step, so the engine takes the model's forward and says why."""
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    # a LoRA adapter on the embedding (the fused step reads embed_tokens.weight directly)
    emb = get_peft_model(llama(), LoraConfig(r=2, target_modules=["embed_tokens"]))
    assert "embed_tokens" in why_not_fused(emb.get_base_model())
    # a subclass (or remote code declaring model_type llama) may change the math
    sub = type("MyLlama", (type(llama()),), {})(llama().config)
    assert "not transformers' LlamaForCausalLM" in why_not_fused(sub)
    # torch.compile's wrapper: generate decodes it, so no fused weights are made for nothing
    assert "torch.compile" in why_not_fused_engine(torch.compile(llama()))
    # another dtype is named as such (bfloat16 weights decode fused since issue 41: test_rollout_bf16.py)
    assert "float16" in why_not_fused(llama().to(torch.float16))
    assert "float64" in why_not_fused(llama().to(torch.float64))
    # what turned it off is named
    ids, mask = prompts(["hello"])
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0, n=1)
    for kwargs, words in [({"fused_decode": False}, "fused_decode is false"),
                          ({"drop_finished_rows": False}, "drop_finished_rows is false"),
                          ({"compile": True}, "rollout.compile is on")]:
        off = HFRolloutEngine(llama(), TOK, **kwargs)
        if "compile" not in kwargs:  # (a compiled generate call would compile; the reason is set per call)
            off.generate(ids, mask, greedy)
        else:
            with off._generating(1, fused=True):
                pass
        assert words in off.fused_decode_reason
    # CPU autocast would make the forward compute in bfloat16
    plain = llama()
    assert why_not_fused_engine(plain) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in why_not_fused_engine(plain)
    # a prompt-learning adapter's virtual tokens live outside the base model
    prompt = get_peft_model(llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert "prompt-learning" in why_not_fused_engine(prompt)


def test_only_the_layers_the_forward_runs_are_fused():
    """transformers runs the first config.num_hidden_layers layers; so does the fused step."""
    model = mistral()
    model.config.num_hidden_layers = 2  # of 3
    ids, mask = prompts(TEXTS)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask)).logits
        dec = fused_decoder(model, 4)
        assert len(dec.layers) == 2
        dec.prefill(ids, mask, None, 1)
        got = dec.step(ids[:, -1], position_ids_from_mask(mask)[:, -1])
    assert (got - ref[:, -1]).abs().max() < 1e-4
