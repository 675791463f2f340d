"""HF rollout engine on a tiny random Llama + the char tokenizer (no downloads)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.logits import log_probs_from_logits
from hybridflow.algorithms.sequences import position_ids_from_mask
from hybridflow.models import build_tiny_model, build_tiny_tokenizer
from workers.rollout.base import RolloutEngine, SamplingParams
from workers.rollout.hf import HFRolloutEngine

TOK = build_tiny_tokenizer()
# '<|im_end|>' plus the ids of 'a'..'e': with a near-uniform tiny model (100 tokens) about 6% of
# steps stop, so a batch holds both "stop" and "length" rows.
STOPS = (2, *TOK.convert_tokens_to_ids(list("abcde")))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(len(TOK), hidden_size=32, layers=2, seed=0).eval()


def prompts(texts):
    enc = TOK(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"].bool()


def recompute(model, prompt_ids, prompt_mask, out, n, temperature):
    """Teacher-forced log-probs of the responses, the way the trainer computes old_log_probs."""
    ids = torch.cat([prompt_ids.repeat_interleave(n, 0), out.response_ids], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(n, 0), out.response_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask)).logits
    p = prompt_ids.shape[1]
    lp = log_probs_from_logits(logits[:, p - 1 : -1], out.response_ids, temperature=temperature)
    return lp.masked_fill(~out.response_mask, 0.0)


def test_shapes_masks_and_finish_reasons(model):
    ids, mask = prompts(["hi", "hello there", "xyz"])  # left padded to 11
    engine = HFRolloutEngine(model, TOK, generation_batch_trajectories=64)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=16, stop_token_ids=STOPS, n=4, seed=3))
    assert out.response_ids.shape == (12, 16) and out.response_ids.dtype == torch.int64
    assert out.response_mask.dtype == torch.bool and out.rollout_log_probs.dtype == torch.float32
    assert set(out.finish_reason) == {"stop", "length"}  # seed 3 gives both kinds
    for row, reason in enumerate(out.finish_reason):
        m, r = out.response_mask[row], out.response_ids[row]
        length = int(m.sum())
        assert m[:length].all() and not m[length:].any()  # one contiguous run from the start
        if reason == "stop":
            assert r[length - 1].item() in STOPS  # the stop token itself counts
            assert not any(t in STOPS for t in r[: length - 1].tolist())
            assert (r[length:] == TOK.pad_token_id).all()
        else:
            assert length == 16 and not any(t in STOPS for t in r.tolist())
    assert (out.rollout_log_probs[~out.response_mask] == 0).all()
    assert (out.rollout_log_probs[out.response_mask] < 0).all()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, 5, 0.9), (0.0, -1, 1.0)])
def test_rollout_log_probs_match_teacher_forced_recompute(model, temperature, top_k, top_p):
    ids, mask = prompts(["a", "hello there", "abc d"])  # 10, 0 and 6 left pads
    sampling = SamplingParams(
        max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=STOPS, n=2, seed=7
    )
    out = HFRolloutEngine(model, TOK).generate(ids, mask, sampling)
    ref = recompute(model, ids, mask, out, 2, sampling.logprob_temperature)
    # full-distribution log-probs at temperature T (T = 1 for greedy), even with top-k/top-p filtering
    assert (out.rollout_log_probs - ref).abs().max().item() < 1e-4


def test_left_padding_does_not_change_a_sequence(model):
    alone_ids, alone_mask = prompts(["hello"])
    batch_ids, batch_mask = prompts(["hello", "longer!!"])  # "hello" gets 3 left pads
    assert (~batch_mask[0]).sum() == 3
    engine = HFRolloutEngine(model, TOK)
    for sampling in (
        SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(2,)),
        SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=(2,), seed=11),
    ):
        a = engine.generate(alone_ids, alone_mask, sampling)
        b = engine.generate(batch_ids, batch_mask, sampling)
        assert torch.equal(a.response_ids[0], b.response_ids[0])
        assert torch.allclose(a.rollout_log_probs[0], b.rollout_log_probs[0], atol=1e-5, rtol=0)


def test_greedy_is_deterministic_and_takes_the_argmax(model):
    ids, mask = prompts(["abc", "q"])
    engine = HFRolloutEngine(model, TOK)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(2,))
    a, b = engine.generate(ids, mask, greedy), engine.generate(ids, mask, greedy)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask)).logits
    assert torch.equal(a.response_ids[:, 0], first[:, -1].argmax(-1))
    # top_k = 1 sampling is greedy whatever the seed
    k1 = engine.generate(ids, mask, SamplingParams(max_new_tokens=8, top_k=1, stop_token_ids=(2,), seed=5))
    assert torch.equal(k1.response_ids, a.response_ids)


def test_seeded_sampling_is_reproducible_and_independent_of_chunking(model):
    ids, mask = prompts(["abc", "hello", "zz top"])
    sampling = SamplingParams(max_new_tokens=10, stop_token_ids=STOPS, n=3, seed=123)
    big = HFRolloutEngine(model, TOK, generation_batch_trajectories=64)
    small = HFRolloutEngine(model, TOK, generation_batch_trajectories=2)
    a, b, c = big.generate(ids, mask, sampling), big.generate(ids, mask, sampling), small.generate(ids, mask, sampling)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_ids, c.response_ids) and a.finish_reason == c.finish_reason
    assert torch.allclose(a.rollout_log_probs, c.rollout_log_probs, atol=1e-5, rtol=0)
    other = big.generate(ids, mask, SamplingParams(max_new_tokens=10, stop_token_ids=STOPS, n=3, seed=124))
    assert not torch.equal(a.response_ids, other.response_ids)
    # prompt-major rows: prompt i's samples are rows 3i..3i+2; samples of one prompt differ
    assert not torch.equal(a.response_ids[0], a.response_ids[1])


def test_generation_restores_train_mode_and_ignores_model_generation_config(model):
    ids, mask = prompts(["abc"])
    engine = HFRolloutEngine(model, TOK)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(2,))
    ref = engine.generate(ids, mask, greedy)
    model.train()
    model.generation_config.do_sample = True
    model.generation_config.repetition_penalty = 5.0
    try:
        out = engine.generate(ids, mask, greedy)
        assert model.training
        assert torch.equal(out.response_ids, ref.response_ids)
    finally:
        model.generation_config.do_sample = False
        model.generation_config.repetition_penalty = 1.0
        model.eval()


def test_load_weights_is_a_noop_on_the_shared_module_and_copies_otherwise():
    trainer_model = build_tiny_model(len(TOK), seed=0)
    engine = HFRolloutEngine(trainer_model, TOK)
    before = {k: v.clone() for k, v in trainer_model.state_dict().items()}
    engine.load_weights(trainer_model.state_dict())  # same tensors: nothing copied, nothing changed
    assert all(torch.equal(before[k], v) for k, v in trainer_model.state_dict().items())
    separate = build_tiny_model(len(TOK), seed=1)
    HFRolloutEngine(separate, TOK).load_weights(trainer_model.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(separate.parameters(), trainer_model.parameters(), strict=True))
    with pytest.raises(KeyError, match="no weight 'nope'"):
        engine.load_weights({"nope": torch.zeros(1)})


def test_lora_model_log_probs_match_recompute_with_adapters_on():
    from hybridflow.config import ModelConfig
    from hybridflow.models import apply_lora

    lora = apply_lora(build_tiny_model(len(TOK), seed=0), ModelConfig(path="tiny", lora_rank=4)).eval()
    with torch.no_grad():  # non-zero B, as after some training
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    ids, mask = prompts(["ab", "hello"])
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=STOPS, n=2, seed=1)
    out = HFRolloutEngine(lora, TOK).generate(ids, mask, sampling)
    assert (out.rollout_log_probs - recompute(lora, ids, mask, out, 2, 1.0)).abs().max().item() < 1e-4
    base = build_tiny_model(len(TOK), seed=0).eval()
    assert (out.rollout_log_probs - recompute(base, ids, mask, out, 2, 1.0)).abs().max().item() > 1e-2


@pytest.mark.parametrize("drop_finished_rows", [True, False])
def test_each_prompt_is_prefilled_once_and_samples_match_unshared_generation(model, monkeypatch, drop_finished_rows):
    ids, mask = prompts(["abc", "hello there", "zz top"])  # 8, 0 and 5 left pads
    sampling = SamplingParams(max_new_tokens=10, stop_token_ids=STOPS, n=4, seed=9)
    rows_seen = []  # (rows, positions) of every forward pass of the model's decoder
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: rows_seen.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    try:
        shared = HFRolloutEngine(model, TOK, drop_finished_rows=drop_finished_rows).generate(ids, mask, sampling)
        prefill = rows_seen[0]
        rows_seen.clear()
        monkeypatch.setattr(HFRolloutEngine, "_shared_prompt_cache", lambda self, *a: {})
        plain = HFRolloutEngine(model, TOK, drop_finished_rows=drop_finished_rows).generate(ids, mask, sampling)
    finally:
        hook.remove()
    # shared: 3 prompts × 10 tokens (all but the last) once; unshared: 12 rows × 11 tokens with
    # generate, 12 rows × 10 tokens then the last one with the own decode loop
    assert prefill == (3, ids.shape[1] - 1)
    assert rows_seen[0] == ((12, ids.shape[1] - 1) if drop_finished_rows else (12, ids.shape[1]))
    assert torch.equal(shared.response_ids, plain.response_ids) and shared.finish_reason == plain.finish_reason
    assert torch.allclose(shared.rollout_log_probs, plain.rollout_log_probs, atol=1e-5, rtol=0)
    ref = recompute(model, ids, mask, shared, 4, 1.0)
    assert (shared.rollout_log_probs - ref).abs().max().item() < 1e-4


def test_prompts_without_a_real_token_are_rejected_by_row(model):
    """A prompt row whose mask is all False (or a prompt tensor of zero columns) would index past
    the prompt in the decode loop; the engine names the rows instead."""
    engine = HFRolloutEngine(model, TOK)
    ids, mask = prompts(["hi", "hello"])
    mask[1] = False
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0, n=1)
    with pytest.raises(ValueError, match=r"prompt rows \[1\] have no real token"):
        engine.generate(ids, mask, sampling)
    with pytest.raises(ValueError, match=r"prompt rows \[0, 1\] have no real token"):
        engine.generate(ids[:, :0], mask[:, :0], sampling)
